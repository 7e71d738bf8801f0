"""Values that cross between the host and the device without stopping the host.

[Note: no host sync in a step]
On CUDA the host queues work and runs ahead; anything that makes it wait for the device
(``.item()``, ``.tolist()``, ``bool(tensor)``, a copy from pageable memory) drains that queue
and leaves the GPU idle while the host catches up. A steady-state training step at any stage
makes no such wait (an invariant: docs/design.md, "Invariants"). The few values that must cross go through this
module, and only through it:

- host -> device: Python values (gather tags, the used-parameter flags and counters) are
  written into *pinned* host memory and copied with ``non_blocking=True``
  (:func:`to_device`). torch's pinned-memory allocator keeps the block until the copy ran,
  so nothing is overwritten early.
- device -> host: :class:`DeviceToHost` copies a small result into pinned memory without
  blocking and records an event behind the copy. Its values are read *later*, where the
  host needs them (``ready()`` asks the event without waiting; ``values()`` waits). The
  callers decide when that is: see [Note: reading the used-parameter flags] in
  core/gradient_ledger.py and [Note: deferred tag checks] in core/unit_order.py.

On the CPU both directions are plain tensors already on the host: nothing is copied and
every result is ready at once, so CPU runs keep their immediate checks. ``tests`` make
``ready()`` answer False on the CPU (:func:`deferring_reads`) to run the deferred paths that
CUDA takes. tests/test_host_sync.py counts, during steady steps, every call from shardpar's
code that would sync a device; the reads here are the exempt ones: they read host memory,
behind an event.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

_defer_cpu_reads = False


@contextlib.contextmanager
def deferring_reads() -> Iterator[None]:
    """Within, a :class:`DeviceToHost` of a CPU tensor says it is not ready until it is read
    with ``values()``: the CPU then takes the deferred paths that CUDA takes (tests)."""
    global _defer_cpu_reads
    before, _defer_cpu_reads = _defer_cpu_reads, True
    try:
        yield
    finally:
        _defer_cpu_reads = before


def reads_deferred() -> bool:
    """Whether :func:`deferring_reads` is in force."""
    return _defer_cpu_reads


def pinned(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty 1-D host tensor from which a copy to ``device`` need not block (pinned where
    ``device`` is a GPU)."""
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


def _send(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A :func:`pinned` host tensor on ``device`` without blocking (on the CPU: itself)."""
    return host if device.type == "cpu" else host.to(device, non_blocking=True)


def to_device(values: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Python numbers as a new 1-D tensor on ``device``, copied from pinned memory without
    blocking the host."""
    on_cpu = device.type == "cpu"  # a stage-3 gather writes its tag through here
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host if on_cpu else host.to(device, non_blocking=True)


def flags_to_device(flags: bytearray, tail: Sequence[int], device: torch.device) -> torch.Tensor:
    """``flags`` (one byte each) followed by ``tail``, as one new int32 tensor on ``device``
    (pinned and non-blocking, as :func:`to_device`)."""
    host = pinned(len(flags) + len(tail), torch.int32, device)
    if flags:
        host[: len(flags)].copy_(torch.frombuffer(flags, dtype=torch.uint8))
    if tail:
        host[len(flags) :].copy_(torch.tensor(tail, dtype=torch.int32))
    return _send(host, device)


class DeviceToHost:
    """A small device tensor's values on their way to the host (see the Note). Make it after
    the work that produces ``tensor`` is ordered before the current stream (a collective's
    ``wait()``); ``stream``: copy on that stream instead (it must wait for the producer)."""

    def __init__(self, tensor: torch.Tensor, stream: torch.cuda.Stream | None = None) -> None:
        self.event: torch.cuda.Event | None = None
        if tensor.device.type == "cpu":
            self.host = tensor
            return
        self.host = pinned(tensor.numel(), tensor.dtype, tensor.device).view(tensor.shape)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's Event.__new__ is unannotated
            self.event.record()

    @property
    def immediate(self) -> bool:
        """Read where it was made, on every rank alike: a CPU tensor outside :func:`deferring_reads`."""
        return self.event is None and not _defer_cpu_reads

    def ready(self) -> bool:
        """Whether ``values()`` would return without waiting for the device."""
        if self.event is None:
            return not _defer_cpu_reads
        return bool(self.event.query())  # type: ignore[no-untyped-call]  # torch's Event.query is unannotated

    def values(self) -> list[Any]:
        """The values as Python numbers (waits for the copy on a GPU)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def read_host(tensor: torch.Tensor) -> list[Any]:
    """The values of a tensor in host memory, as Python numbers (no device is involved: the
    gloo paths' received bytes, which live on the CPU)."""
    assert tensor.device.type == "cpu", f"read_host of a {tensor.device} tensor would wait for the device"
    return tensor.tolist()
