"""The order a tensor's elements are kept in: its memory format, as the flat buffers keep it.

[Note: element order]
A parameter's memory format is the user's choice and kernels depend on it: a conv weight in
``channels_last`` (shape ``(O, C, H, W)``, strides ``(C·H·W, 1, W·C, C)``) is stored one
output channel after another, each as ``(H, W, C)``, and convolutions pick their algorithm
(and their rounding) by it. torch DDP keeps it: parameters stay the user's tensors and the
gradient buckets are views with the parameters' strides. shardpar keeps parameters as views
of flat buffers, so it keeps the format the same way: a tensor's range of a flat buffer holds
its elements in *memory order* (the order of their addresses in the tensor as wrapped), and
the parameter, each of its gradient views (stage 0's gradient buffer, the staging copies of
stages 2-3) and its master copy are ``as_strided`` over that range with the tensor's own
strides. Any *dense* layout is kept this way: contiguous, ``channels_last``,
``channels_last_3d``, any permutation of the dims. A parameter whose elements are not one dense
block (a view with gaps, or with elements that overlap) cannot be a view of a flat range and
is refused at wrap, by name (:func:`dense_order`).

Param space ([Note: index spaces] in layout.py) counts elements in memory order, so shards,
optimizer pieces, reductions and gathers, which are all elementwise, never need to know.
Outside shardpar tensors are row-major: checkpoints on disk, state dicts, Hugging Face files.
Where a range in param space meets them it is translated, in units of *blocks*: a block is the
largest run of elements that is the same range in both orders (for ``channels_last``, one
output channel: ``C·H·W`` elements; a tensor kept row-major needs no translation). A range of
whole blocks is translated locally, by permuting within each block
(:meth:`ElementOrder.to_row_major`, :meth:`ElementOrder.to_memory_order`); how a shard that
cuts a block is written and read is in ``shardpar/checkpoint/reorder.py``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

Strides = tuple[int, ...]


def row_major_strides(shape: torch.Size) -> Strides:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def is_dense(shape: torch.Size, strides: Strides) -> bool:
    """Whether a tensor of ``shape`` and ``strides`` covers exactly ``numel`` consecutive
    elements of memory, each once (no gaps, no overlaps); size-1 dims may have any stride."""
    if math.prod(shape) == 0:
        return True
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(strides, shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass(frozen=True)
class ElementOrder:
    """How one tensor of ``shape`` keeps its elements in a flat range (see the Note)."""

    shape: torch.Size
    strides: Strides | None = None
    """The tensor's own strides where they are not row-major ones; None: row-major."""

    @staticmethod
    def of(shape: torch.Size, strides: Strides) -> ElementOrder:
        """The order of a dense tensor with these strides (check :func:`is_dense` first)."""
        shape, strides = torch.Size(shape), tuple(strides)
        assert is_dense(shape, strides), (shape, strides)
        return ElementOrder(shape, None if strides == row_major_strides(shape) else strides)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def _leading_dims(self) -> int:
        """How many leading dims keep row-major strides (size-1 dims always do): the dims
        that number the blocks. All of them when the elements are in row-major order."""
        if self.strides is None:
            return len(self.shape)
        row_major = row_major_strides(self.shape)
        for dim, (size, stride) in enumerate(zip(self.shape, self.strides)):
            if size != 1 and stride != row_major[dim]:
                return dim
        return len(self.shape)

    @property
    def reorders(self) -> bool:
        """Whether memory order differs from row-major order (only then is there anything to
        translate; strides that differ in size-1 dims only do not reorder anything)."""
        return self._leading_dims < len(self.shape)

    @property
    def block(self) -> int:
        """Elements per block: ranges of whole blocks are the same in both orders."""
        return math.prod(self.shape[self._leading_dims :]) if self.reorders else 1

    def block_span(self, start: int, end: int) -> tuple[int, int]:
        """The smallest range of whole blocks containing ``[start, end)``."""
        block = self.block
        return start // block * block, -(-end // block) * block

    # ------------------------------------------------------------------ views and copies

    def shaped(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (1-D, contiguous: the tensor's elements in memory order) as the tensor:
        its shape and strides, a view."""
        if self.strides is None:
            return values.view(self.shape)
        return values.as_strided(self.shape, self.strides)

    def flatten(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (this shape, any strides) as 1-D in memory order: a view where its
        strides are this order's, else a copy."""
        if not self.reorders:
            return tensor.reshape(-1)
        if tensor.stride() == self.strides:
            return tensor.as_strided((self.numel,), (1,))
        flat = torch.empty(self.numel, dtype=tensor.dtype, device=tensor.device)
        self.shaped(flat).copy_(tensor)
        return flat

    def empty(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new tensor of this shape and strides (as ``torch.empty_like`` of the parameter)."""
        return self.shaped(torch.empty(self.numel, dtype=dtype, device=device))

    def _blocks(self, values: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        """``values`` (1-D, whole blocks in memory order) as (blocks, *block dims) in logical
        order, a strided view; and that logical shape."""
        assert self.strides is not None, "blocks exist only where the order differs from row-major"
        lead = self._leading_dims
        tail_shape = tuple(self.shape[lead:])
        count = values.numel() // self.block
        assert count * self.block == values.numel(), "a range of whole blocks"
        return values.as_strided((count, *tail_shape), (self.block, *self.strides[lead:])), (count, *tail_shape)

    def to_row_major(self, values: torch.Tensor) -> torch.Tensor:
        """Whole blocks in memory order (1-D) -> the same blocks in row-major order (1-D, a copy
        unless nothing is reordered)."""
        if not self.reorders:
            return values
        blocks, _ = self._blocks(values)
        return blocks.reshape(-1)

    def to_memory_order(self, values: torch.Tensor) -> torch.Tensor:
        """Whole blocks in row-major order (1-D) -> the same blocks in memory order (1-D)."""
        if not self.reorders:
            return values
        out = torch.empty_like(values)
        blocks, logical_shape = self._blocks(out)
        blocks.copy_(values.view(logical_shape))
        return out


def dense_order(name: str, shape: torch.Size, strides: Strides) -> ElementOrder:
    """The element order of parameter ``name`` (of ``shape`` and ``strides``); a ValueError
    naming it when its elements are not one dense block of memory (see [Note: element order])."""
    if not is_dense(shape, strides):
        raise ValueError(
            f"parameter '{name}' has shape {tuple(shape)} and strides {strides}: its elements are not one dense "
            "block of memory (a view with gaps or overlapping elements). shardpar keeps every parameter as a view "
            "of a flat buffer, with its strides when they are a dense layout (contiguous, channels_last, any "
            "permutation of the dims); give it storage of its own before shardpar.wrap, e.g. "
            "`module.weight = nn.Parameter(module.weight.detach().clone(memory_format=torch.contiguous_format))`"
        )
    return ElementOrder.of(shape, strides)
