"""What the backend serving a group's tensors can do, as the collectives use it: average
inside the collective, reduce-scatter and all-gather natively or built from other
collectives, tolerate a gather whose messages are shorter than posted, align layouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import devices
from .process_group import ProcessGroup, get_world_size


@dataclass(frozen=True)
class BackendTraits:
    """What the backend that serves one device type of a group can do, as the collectives
    use it. Read per device type ([Note: a rank's device] in devices.py): a
    ``"cpu:gloo,cuda:nccl"`` group runs NCCL for CUDA tensors and gloo for CPU ones."""

    backend: str
    averages: bool
    """``ReduceOp.AVG`` divides by N inside the collective (NCCL); elsewhere the caller divides."""
    emulated_split: bool
    """Reduce-scatter and all-gather are built from all-to-all and broadcasts (gloo: see
    [Note: gloo reduce-scatter and all-gather] in collectives.py); else the backend's own
    collectives."""
    tolerant_gathers: bool
    """A receiver may post more bytes than a sender sends (gloo's broadcast), so a tagged gather
    of units of different sizes completes and shows the mismatch. Where it may not (NCCL: a
    mismatch hangs), no rank may post a gather it does not know the others post too: see
    [Note: deferred tag checks] in core/unit_order.py."""
    aligns: bool
    """Layouts are aligned for bandwidth when ``align_for_bandwidth`` is None ([Note: alignment])."""


_KNOWN_BACKENDS = {
    "gloo": BackendTraits("gloo", averages=False, emulated_split=True, tolerant_gathers=True, aligns=False),
    "nccl": BackendTraits("nccl", averages=True, emulated_split=False, tolerant_gathers=False, aligns=True),
}
_forced_native = False


@contextlib.contextmanager
def forcing_native_paths() -> Iterator[None]:
    """Within, every backend is treated as one without gloo's emulated collectives or tolerant
    gathers: the code paths NCCL takes run on gloo, whose native collectives serve them (tests)."""
    global _forced_native
    before, _forced_native = _forced_native, True
    try:
        yield
    finally:
        _forced_native = before


def traits(group: ProcessGroup | None, device: torch.device | None = None) -> BackendTraits:
    """What the backend of ``group`` (None: the default group, which must exist) for tensors on
    ``device`` can do (None: the group's CUDA backend if it has one, else its only one). A
    backend shardpar does not know is taken at its weakest: no average, native collectives,
    no tolerance of a size mismatch."""
    served = devices.group_backends(group)
    if device is not None and device.type in served:
        name = served[device.type]
    elif device is None and "cuda" in served:
        name = served["cuda"]
    else:
        name = str(dist.get_backend(group)).lower()
    found = _KNOWN_BACKENDS.get(name) or BackendTraits(
        name, averages=False, emulated_split=False, tolerant_gathers=False, aligns=True
    )
    if _forced_native:
        found = dataclasses.replace(found, emulated_split=False, tolerant_gathers=False)
    return found


def backend_averages(group: ProcessGroup | None, device: torch.device | None = None) -> bool:
    """Whether the backend divides by N inside the collective (``ReduceOp.AVG``): NCCL does,
    gloo does not (there the caller divides in a pass of its own)."""
    return get_world_size(group) > 1 and traits(group, device).averages
