"""A tensor's bytes on the host, for the files: :func:`bytes_of` is a CPU tensor's storage as
bytes (no copy), :class:`PinnedBounce` carries a CUDA tensor's bytes to and from a file.

[Note: checkpoint bytes and the GPU]
Bytes of a CUDA tensor reach the file through two pinned host buffers taken in turn: chunk
k+1 is copied without blocking while chunk k is written, and a buffer is reused only after
the event behind its copy. Pageable memory would make every copy synchronous and stop the
host for each. Reads take the same way back (file -> pinned buffer -> device, without
blocking).
"""

from __future__ import annotations

from typing import Any, Callable

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
    return memoryview(dense.view(torch.uint8).numpy()).cast("B")


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
        event = torch.cuda.Event()
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
