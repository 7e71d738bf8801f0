"""A tensor's bytes on the host, for the files: :func:`bytes_of` is a CPU tensor's storage as
bytes (no copy), :class:`PinnedBounce` carries a CUDA tensor's bytes to and from a file,
:class:`HostStaging` holds a copy of what an asynchronous save writes.

[Note: checkpoint bytes and the GPU]
Bytes of a CUDA tensor reach the file through two pinned host buffers taken in turn: chunk
k+1 is copied without blocking while chunk k is written, and a buffer is reused only after
the event behind its copy. Pageable memory would make every copy synchronous and stop the
host for each. Reads take the same way back (file -> pinned buffer -> device, without
blocking).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

CHUNK_BYTES = 16 * 2**20
"""The bounded buffer: the most bytes copied through a temporary at once (casts, sends)."""


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable view of its storage (no copy).
    torch calls a one-element view with any stride contiguous (``dest[::2]`` of two
    elements), so the strides are set to 1 explicitly; ``as_strided`` keeps the storage
    offset."""
    if tensor.numel() == 0:
        return memoryview(b"")
    dense = tensor.detach().as_strided((tensor.numel(),), (1,))
    # numpy's stubs give ndarray a __buffer__ only for Python >= 3.12 (the config's target is 3.11)
    return memoryview(dense.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


class PinnedBounce:
    """The bytes of a CUDA tensor to and from a file, through two pinned host buffers of at
    most ``chunk_bytes``; see [Note: checkpoint bytes and the GPU]."""

    def __init__(self, dtype: torch.dtype, device: torch.device, numel: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.step = max(1, min(numel, chunk_bytes // dtype.itemsize))  # a small tensor: small buffers
        on_gpu = device.type == "cuda"
        self.buffers = [torch.empty(self.step, dtype=dtype, pin_memory=on_gpu) for _ in range(2)]
        self.events: list[Any] = [None, None]
        self.device = device
        self._on_gpu = on_gpu
        """Else a CPU tensor (tests): the same turns, every copy done when it returns."""

    def _take(self, turn: int, numel: int) -> torch.Tensor:
        event = self.events[turn % 2]
        if event is not None:
            event.synchronize()  # its previous copy is done: the buffer may be reused
        return self.buffers[turn % 2][:numel]

    def _record(self, turn: int) -> None:
        if not self._on_gpu:
            return
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's Event.__new__ is unannotated
        event.record(torch.cuda.current_stream(self.device))
        self.events[turn % 2] = event

    def to_host(self, tensor: torch.Tensor, write: Callable[[memoryview], None]) -> None:
        """Write ``tensor``'s values (on the GPU, already in the buffers' dtype) through ``write``."""
        flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().flatten()
        pending: tuple[int, torch.Tensor] | None = None
        for turn, start in enumerate(range(0, flat.numel(), self.step)):
            part = flat[start : start + self.step]
            staged = self._take(turn, part.numel())
            staged.copy_(part, non_blocking=True)
            self._record(turn)
            if pending is not None:
                self._flush(*pending, write)
            pending = (turn, staged)
        if pending is not None:
            self._flush(*pending, write)

    def _flush(self, turn: int, staged: torch.Tensor, write: Callable[[memoryview], None]) -> None:
        if self.events[turn % 2] is not None:
            self.events[turn % 2].synchronize()
        write(bytes_of(staged))

    def from_file(self, dest: torch.Tensor, readinto: Callable[[int, memoryview], None], offset: int) -> None:
        """Fill ``dest`` (on the GPU, in the buffers' dtype) from the bytes at ``offset``."""
        flat = dest.view(-1)
        itemsize = dest.element_size()
        for turn, start in enumerate(range(0, flat.numel(), self.step)):
            part = flat[start : start + self.step]
            staged = self._take(turn, part.numel())
            readinto(offset + start * itemsize, bytes_of(staged))
            part.copy_(staged, non_blocking=True)
            self._record(turn)
        for event in self.events:
            if event is not None:
                event.synchronize()  # dest is complete when the load returns


STAGING_ALIGN = 64
"""Byte alignment of each tensor in the staging buffer (any dtype's view needs its itemsize;
64 keeps every tensor on its own cache lines)."""


class HostStaging:
    """One host buffer that an asynchronous save copies every tensor it writes into, so that
    training may change them while the copies are written. Reused by the next save (which
    starts only once the previous one is written), grown when a save needs more, and pinned
    where a tensor is on a GPU.

    [Note: staging a snapshot]
    The call of an asynchronous save blocks only for these copies. On a GPU they are
    ``non_blocking`` copies into pinned memory, all queued on the current stream, then one
    event is waited on: one host sync per save, not one per tensor, and the save returns
    once every byte is on the host, so nothing the training does next (an optimizer step
    on another stream included) can reach them. Pinned memory is slow to allocate (it is
    page-locked), hence the reuse: the buffer stays allocated between saves, one copy of
    what this rank writes. On the CPU the copies are plain ``copy_``; the buffer is reused
    all the same, which spares the page faults of fresh memory at every save.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None  # 1-D uint8

    @property
    def nbytes(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()

    def copy_in(
        self,
        sources: Sequence[tuple[torch.dtype, int, torch.Tensor | Callable[[], torch.Tensor]]],
        device: torch.device,
    ) -> list[torch.Tensor]:
        """Copies of ``sources`` (``(dtype, numel, 1-D tensor or what makes it)``, each made
        only when copied; on ``device``, or the CPU) as 1-D views into the buffer, complete
        when this returns."""
        offsets, total = [], 0
        for dtype, numel, _ in sources:
            offsets.append(total)
            total += -(-numel * dtype.itemsize // STAGING_ALIGN) * STAGING_ALIGN
        on_gpu = device.type == "cuda"
        pin = on_gpu and torch.cuda.is_available()
        buffer = self._buffer
        if buffer is None or buffer.numel() < total or (pin and not buffer.is_pinned()):
            self._buffer = buffer = None  # the old one goes before the new one is allocated
            buffer = self._buffer = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        copies = []
        for (dtype, numel, source), offset in zip(sources, offsets):
            copy = buffer[offset : offset + numel * dtype.itemsize].view(dtype)
            values = source() if callable(source) else source
            copy.copy_(values.detach().reshape(-1), non_blocking=values.device.type == "cuda")
            copies.append(copy)
        if on_gpu:
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's Event.__new__ is unannotated
            done.record(torch.cuda.current_stream(device))
            done.synchronize()  # the one host sync of the save: see [Note: staging a snapshot]
        return copies
