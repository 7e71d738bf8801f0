"""The lifecycle every parameter gatherer answers (:class:`GatherPhases`), and the gatherers
of stages 0-2: none at stage 0, all-gathers after ``step()`` at stages 1-2 (stage 3's per-unit
gatherer is in gatherer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..comm import collectives as C
from .flat_param import FlatParamGroup, ShardState
from .wait_clock import WaitClock


class GatherPhases:
    """What the engine tells the gatherer of its stage at each point of a step, and asks of
    it. Every stage has a gatherer (stage 0 :class:`NoGatherer`), so the engine never asks which
    stage it runs: a gatherer with nothing to do at a point inherits the no-op here."""

    group: Any
    device: torch.device
    comm: C.CommStats

    def begin_forward(self) -> None:
        """The root's forward starts (not a recompute)."""

    def end_forward(self) -> None:
        """The root's forward ended."""

    def abandon_forward(self) -> None:
        """The root's forward raised."""

    def begin_backward(self) -> None:
        """The first hook of a backward ran."""

    def grads_final(self, space: Any) -> None:
        """Every gradient of bucketed parameter set ``space`` is final in this backward."""

    def check_previous_backward(self) -> None:
        """The end of a backward, before any wait for its reductions."""

    def finish_backward(self) -> None:
        """The end of a backward, after its reductions."""

    def check_tags(self, block: bool) -> None:
        """Check what arrived of deferred order checks (``block``: wait for all of it)."""

    def exchange(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values``, in rank order (collective): one object all-gather."""
        return [
            list(v)
            for v in C.all_gather_objects(values, group=self.group, device=self.device, stats=self.comm, kind="control")
        ]

    def follow_placement(self) -> None:
        """Its groups were laid out anew (tensors owned whole: [Note: whole-tensor ownership]
        in core/layout.py): forget what it prepared for their old sizes."""

    def memory_stats(self) -> dict[str, int]:
        """Bytes of its own to report beside ``memory_stats()``'s common kinds."""
        return {}

    def gathers_per_step(self) -> list[tuple[int, torch.dtype]]:
        """(elements with padding, dtype) of each parameter all-gather one steady step issues."""
        return []


class NoGatherer(GatherPhases):
    """Stage 0: every rank holds every parameter; nothing is gathered."""

    def __init__(self, group: Any, device: torch.device, comm: C.CommStats) -> None:
        self.group, self.device, self.comm = group, device, comm


class PostStepGatherer(GatherPhases):
    """Stages 1-2: all-gather every bucket's updated slices after ``step()``; completed lazily
    (see [Note: lazy parameter gather] in replicated.py)."""

    def __init__(
        self, groups: list[FlatParamGroup], group: Any, comm: C.CommStats, wait_clock: WaitClock, device: torch.device
    ) -> None:
        self.group = group
        self.comm = comm
        self.wait_clock = wait_clock
        self.device = device
        self.track(groups)

    def track(self, groups: list[FlatParamGroup]) -> None:
        """Gather ``groups`` from now on (at wrap, and again when the buckets are rebuilt)."""
        self.groups = groups

    def start(self, groups: Sequence[FlatParamGroup]) -> None:
        """Launch the all-gather of ``groups``' updated slices (returns at once)."""
        with torch.no_grad():
            for flat in groups:
                assert flat.state is not ShardState.GATHERING, f"'{flat.label}' is already gathering"
                own = flat.own_slice()
                if own.data_ptr() != flat.shard.data_ptr():  # gathered in the (narrower) compute dtype
                    own.copy_(flat.shard)
                handle = C.all_gather(
                    flat.full,
                    own,
                    group=self.group,
                    async_op=True,
                    stats=self.comm,
                    padding_numel=flat.layout.padding,
                )
                flat.begin_gather(handle, self)

    def wait_for_gather(self, flat: FlatParamGroup) -> None:
        """Complete ``flat``'s gather (a :class:`~.flat_param.GatherWaiter`: a guarded read or a
        use hook of stages 1-2 waits here too)."""
        self.wait_clock.wait(flat.take_handle(), gather=True)
        flat.complete_gather()

    def wait(self, groups: Sequence[FlatParamGroup]) -> None:
        for flat in groups:
            if flat.state is not ShardState.UNSHARDED:
                assert flat.state is ShardState.GATHERING, f"'{flat.label}' is {flat.state.value}, not gathering"
                self.wait_for_gather(flat)

    def wait_all(self) -> None:
        self.wait(self.groups)

    def gathers_per_step(self) -> list[tuple[int, torch.dtype]]:
        return [(flat.layout.numel, flat.dtype) for flat in self.groups]
