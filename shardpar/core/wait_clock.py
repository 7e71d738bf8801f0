"""Where the host waited for collectives: seconds and waits per training phase.

[Note: exposed communication]
A collective launched asynchronously overlaps whatever the host does next, until someone
waits for its handle. The wall time the main thread then spends blocked in
``Handle.wait()`` is communication that was *not* hidden: the *exposed* communication. One
:class:`WaitClock` per engine adds it up by where the wait happened, which the engine's
training state says at the moment of the wait:

    forward          parameter all-gathers completed in forward: stages 1-2's lazy
                     post-step gathers (a use module's pre-hook, or a guarded parameter
                     read), stage 3's unit gathers; buffer broadcasts
    backward_gather  stage 3's unit gathers waited in backward (pre-backward hooks,
                     activation-checkpointing recomputes)
    backward         gradient reductions: what the end of backward waits for, and a
                     bucket waited for early to bound stages 2-3's staging
    step             everything outside forward and backward: optimizer ``step()`` (which
                     first completes the post-step gathers still in flight),
                     ``clip_grad_norm_`` and loss scaling's all-reduces, state dicts

A wait's time includes the work its handle runs when the collective completes (on gloo the
local sum that finishes a reduce-scatter, the copy out of a tagged gather), which is part
of the collective. Waits the engine makes once, on set-up (broadcasts at wrap, the
launch-order agreement of the first backward), are not counted. The clock only reads
``time.perf_counter`` around waits the engine makes anyway: it adds no collective and no
synchronisation. On NCCL a wait only makes the compute stream wait, so the host blocks for
next to nothing and the clock reads about zero: it measures the waits that block the host
(gloo on CPU). ``tools/bench.py`` resets it before each step and reads it after.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .training_state import Phase, TrainingState

if TYPE_CHECKING:
    from ..comm.collectives import Handle

PHASES = ("forward", "backward_gather", "backward", "step")
"""See [Note: exposed communication]."""


_GATHER_PHASES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward_gather"}
"""The clock's phase of a parameter gather's wait, by the engine's phase (any other: "step")."""
_REDUCTION_PHASES = {Phase.FORWARD: "forward", Phase.BACKWARD: "backward"}
"""The same for any other wait (a gradient reduction)."""


class WaitClock:
    """See [Note: exposed communication]."""

    def __init__(self, state: TrainingState) -> None:
        self.state = state
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)
        """Seconds blocked in waits since the last :meth:`reset`, per phase."""
        self.waits: dict[str, int] = dict.fromkeys(PHASES, 0)
        """Handles waited for since the last :meth:`reset`, per phase."""

    def wait(self, handle: Handle, *, gather: bool) -> Any:
        """``handle.wait()``, timed under the phase the engine is in (``gather``: a parameter
        all-gather, told apart from a gradient reduction in backward)."""
        started = time.perf_counter()
        result = handle.wait()
        elapsed = time.perf_counter() - started
        phase = (_GATHER_PHASES if gather else _REDUCTION_PHASES).get(self.state.phase, "step")
        self.seconds[phase] += elapsed
        self.waits[phase] += 1
        return result

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def reset(self) -> None:
        for phase in PHASES:
            self.seconds[phase] = 0.0
            self.waits[phase] = 0

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{"seconds": {phase: s}, "waits": {phase: n}}``, copies."""
        return {"seconds": dict(self.seconds), "waits": dict(self.waits)}
