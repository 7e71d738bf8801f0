"""Flat buffers: where each tensor lives in one contiguous 1-D tensor, cut into buckets.

[Note: index spaces]
Sharding bugs live where offsets of different spaces get mixed, so every offset here is
a :class:`Range` in one of three named spaces:

- *buffer space*: offsets into the whole flat buffer (identical on every rank);
- *param space*: offsets into one parameter flattened to 1-D (``0 .. p.numel()``);
- *local space*: offsets into this rank's shard, the concatenation of its slice of every
  bucket in bucket order (``0 .. layout.shard_numel``), which is what ZeRO stores.

A :class:`ShardPiece` ties the three together for the part of one parameter a rank owns.

[Note: layout order]
Tensors are laid out in the order the caller gives, which for gradients is *reverse*
registration order: backward produces the last layers' gradients first, so bucket 0 (the
start of the buffer) completes first and its collective can start earliest. Stages 0-2 lay
the buffer out once more after the first backward, in the order gradients actually became
ready ([Note: bucket rebuild] in rebuild.py).
Every bucket is padded to a multiple of the world size N, so bucket b splits into N equal
slices and slice r belongs to rank r.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass(frozen=True)
class Range:
    """Half-open interval ``[start, end)`` of element offsets in one named index space."""

    start: int
    end: int

    def __post_init__(self) -> None:
        assert 0 <= self.start <= self.end, f"bad range [{self.start}, {self.end})"

    @property
    def size(self) -> int:
        return self.end - self.start

    def intersect(self, other: "Range") -> "Range | None":
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None

    def shift(self, offset: int) -> "Range":
        return Range(self.start + offset, self.end + offset)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The 1-D view ``flat[start:end]``."""
        return flat[self.start : self.end]


@dataclass(frozen=True)
class ParamSlot:
    """Where one tensor lives: its ``range`` is in buffer space."""

    name: str
    shape: torch.Size
    range: Range
    bucket: int


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range of the buffer whose gradients are reduced together."""

    index: int
    range: Range
    """Buffer space, padding included (``range.size % world_size == 0``)."""
    padding: int
    """Trailing elements of ``range`` that belong to no tensor."""
    names: tuple[str, ...]
    world_size: int

    @property
    def shard_size(self) -> int:
        return self.range.size // self.world_size

    def shard(self, rank: int) -> Range:
        """Rank ``rank``'s slice of this bucket, in buffer space."""
        start = self.range.start + rank * self.shard_size
        return Range(start, start + self.shard_size)


@dataclass(frozen=True)
class ShardPiece:
    """The part of one tensor that one rank owns (at most one piece per tensor and rank,
    since a tensor never straddles two buckets)."""

    name: str
    bucket: int
    param_range: Range  # param space
    buffer_range: Range  # buffer space
    local_range: Range  # local space


def padded_size(numel: int, multiple: int) -> int:
    return -(-numel // multiple) * multiple


class BufferLayout:
    """The index of a flat buffer: name -> slot, plus buckets and every rank's shard.

    Holds no storage: the engines allocate parameter, gradient and shard tensors of the
    sizes this layout gives and take views through it, so one layout serves all stages.
    """

    def __init__(
        self,
        tensors: Sequence[tuple[str, torch.Size]],
        world_size: int,
        bucket_cap_numel: int | None = None,
    ) -> None:
        """``tensors`` in layout order; ``bucket_cap_numel=None`` puts all in one bucket.

        A tensor larger than the cap gets a bucket of its own; a tensor is never split.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.slots: dict[str, ParamSlot] = {}
        self.buckets: list[Bucket] = []
        cap = bucket_cap_numel if bucket_cap_numel is not None else float("inf")

        offset = 0
        bucket_start = 0
        bucket_names: list[str] = []

        def close_bucket() -> None:
            nonlocal offset, bucket_start, bucket_names
            end = bucket_start + padded_size(offset - bucket_start, world_size)
            self.buckets.append(
                Bucket(len(self.buckets), Range(bucket_start, end), end - offset, tuple(bucket_names), world_size)
            )
            offset = bucket_start = end
            bucket_names = []

        for name, shape in tensors:
            numel = torch.Size(shape).numel()
            if bucket_names and offset - bucket_start + numel > cap:
                close_bucket()
            self.slots[name] = ParamSlot(name, torch.Size(shape), Range(offset, offset + numel), len(self.buckets))
            bucket_names.append(name)
            offset += numel
        if bucket_names:
            close_bucket()
        self.numel = offset
        """Total buffer size in elements, padding included."""
        self.shard_numel = self.numel // world_size
        """Size of one rank's shard (identical on every rank)."""

    # ------------------------------------------------------------------ queries

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    @property
    def padding(self) -> int:
        return sum(b.padding for b in self.buckets)

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Tensor ``name`` as a view of the full flat buffer ``flat``, in its own shape."""
        slot = self.slots[name]
        return slot.range.of(flat).view(slot.shape)

    def local_offset(self, bucket: Bucket) -> int:
        """Where ``bucket``'s slice starts in local space."""
        return bucket.range.start // self.world_size

    def shard_of(self, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
        """``bucket``'s slice of a rank's local shard tensor (size ``shard_numel``)."""
        start = self.local_offset(bucket)
        return shard[start : start + bucket.shard_size]

    def pieces(self, rank: int) -> Iterator[ShardPiece]:
        """Every piece of every tensor that ``rank`` owns, in buffer order."""
        for bucket in self.buckets:
            owned = bucket.shard(rank)
            local_start = self.local_offset(bucket)
            for name in bucket.names:
                slot = self.slots[name]
                overlap = slot.range.intersect(owned)
                if overlap is None:
                    continue
                yield ShardPiece(
                    name=name,
                    bucket=bucket.index,
                    param_range=overlap.shift(-slot.range.start),
                    buffer_range=overlap,
                    local_range=overlap.shift(local_start - owned.start),
                )
