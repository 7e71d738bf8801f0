"""What an engine is doing right now, so that every hook can ask before it acts.

[Note: training state]
Hooks fire in many situations that look alike from inside one hook: a forward, an
evaluation forward under ``no_grad``, the recompute that activation checkpointing runs
*during* backward, a backward inside ``no_sync()``, the inner backward of reentrant
checkpointing. Each needs different behaviour (a recompute must not reshard what its graph
is about to use, nor prefetch in forward order; a no-sync backward accumulates and sends
nothing). One :class:`TrainingState` per engine holds the phase, and every hook asks it
first, as FSDP2's ``TrainingState`` does.

    IDLE ──root pre-forward──▶ FORWARD ──root post-forward──▶ IDLE
    IDLE ──root pre-backward (hook on the root's outputs)──▶ BACKWARD
    BACKWARD ──a unit's forward runs again──▶ (that call is a recompute) ──▶ BACKWARD
    BACKWARD ──end-of-backward callback──▶ IDLE

Whether a backward synchronises is fixed when it starts (``no_sync()`` decides), so a
context manager left in the middle of a backward cannot split one backward in two halves.
"Inside backward" is also asked of the autograd engine itself
(``torch._C._current_graph_task_id``), which is what tells a recompute from a forward even
when the backward did not start at our root (a backward through part of the model).
"""

from __future__ import annotations

import enum

import torch


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class TrainingState:
    """The phase of one engine plus the gradient-sync switch of ``no_sync()``."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.require_grad_sync = True
        """What ``no_sync()`` (or DDP's ``require_backward_grad_sync``) sets for the next backward."""
        self.backward_syncs = True
        """Whether the backward in progress (or the last one) synchronises gradients."""
        self.backward_count = 0
        """Backward passes that reached this engine since wrap (synchronising or not)."""
        self.sync_count = 0
        """Synchronising backward passes since wrap: carried in the used-parameter reduction so
        that a rank which skipped one is named (see the reducer)."""
        self.step_count = 0
        """``optimizer.step()`` calls since wrap (carried beside ``sync_count``)."""
        self.final_callback_queued = False
        """The end-of-backward callback is queued for the backward in progress."""
        self.unit: tuple[Phase, int, str, bool] | None = None
        """Stage 3: the unit whose forward or backward started last, with the phase, the backward
        count and whether autograd was on at that moment (set by the gatherer; read only by
        :meth:`describe` and :meth:`position`)."""

    def counters(self) -> list[int]:
        """What ranks in step agree on at every synchronising backward."""
        return [self.sync_count, self.backward_count, self.step_count]

    COUNTER_NAMES = ("synchronising backward passes", "backward passes in all", "optimizer steps")

    def describe(self) -> str:
        """Where this engine is, for the report of [Note: ranks out of step]."""
        if self.phase is Phase.BACKWARD:
            where = f"in backward pass {self.backward_count}"
        else:
            where = (
                f"in a forward pass after {self.backward_count} backward passes"
                if self.phase is Phase.FORWARD
                else f"between passes after backward pass {self.backward_count}"
            )
        details = ""
        unit = self._unit_now()
        if unit is not None and not unit[3]:
            details += ", without autograd (evaluation or generation)"
        if unit is not None:
            details += f", at unit '{unit[2]}'"
        return f"{where} and {self.step_count} optimizer steps{details}"

    def _unit_now(self) -> tuple[Phase, int, str, bool] | None:
        """:attr:`unit`, if it belongs to the pass in progress."""
        if self.unit is None or self.phase is Phase.IDLE:
            return None
        phase, backward_count = self.unit[:2]
        return self.unit if phase is self.phase and backward_count == self.backward_count else None

    def current_unit(self) -> str | None:
        """The stage-3 unit whose forward or backward started last in the pass in progress."""
        unit = self._unit_now()
        return unit[2] if unit is not None else None

    def position(self) -> dict[str, object]:
        """:meth:`describe` as values, for comparing ranks ([Note: stalled waits] in comm/stalls.py)."""
        return {
            "phase": self.phase.value,
            "backward_count": self.backward_count,
            "step_count": self.step_count,
            "unit": self.current_unit(),
        }

    @staticmethod
    def autograd_running() -> bool:
        """Whether the calling code runs inside the autograd engine (a backward pass)."""
        return torch._C._current_graph_task_id() != -1

    def is_recompute(self) -> bool:
        """A module forward that runs inside backward: activation checkpointing recomputing."""
        return torch._C._current_graph_task_id() != -1  # autograd is running (asked twice per unit use)

    def begin_backward(self) -> None:
        """The first hook of a backward: fix whether it synchronises."""
        self.phase = Phase.BACKWARD
        self.backward_syncs = self.require_grad_sync
        self.backward_count += 1
        if self.backward_syncs:
            self.sync_count += 1

    def end_backward(self) -> None:
        self.phase = Phase.IDLE
        self.final_callback_queued = False
