"""The lifecycle every parameter gatherer answers (:class:`GatherPhases`), and the gatherers
of stages 0-2: none at stage 0, all-gathers after ``step()`` at stages 1-2 (stage 3's per-unit
gatherer is in gatherer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..comm import collectives as C
from .flat_param import FlatParamGroup, GatherChannel
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
        """Every gradient of parameter space ``space`` is final in this backward."""

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


class PostStepGatherer(GatherPhases, GatherChannel):
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

    def issue_gather(self, flat: FlatParamGroup) -> C.Handle:
        return C.all_gather(
            flat.full,
            flat.own_slice(),
            group=self.group,
            async_op=True,
            stats=self.comm,
            padding_numel=flat.layout.padding,
        )

    def start_all(self) -> None:
        with torch.no_grad():
            for flat in self.groups:
                own = flat.own_slice()
                if own.data_ptr() != flat.shard.data_ptr():  # gathered in the (narrower) compute dtype
                    own.copy_(flat.shard)
                flat.start_unshard(self)

    def wait_gather(self, handle: C.Handle) -> Any:
        return self.wait_clock.wait(handle, gather=True)

    def wait(self, groups: Sequence[FlatParamGroup]) -> None:
        for flat in groups:
            flat.wait_unsharded()

    def wait_all(self) -> None:
        self.wait(self.groups)

    def gathers_per_step(self) -> list[tuple[int, torch.dtype]]:
        return [(flat.layout.numel, flat.dtype) for flat in self.groups]
