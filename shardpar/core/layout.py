"""Flat buffers: where each tensor lives in one contiguous 1-D tensor, cut into buckets.

[Note: index spaces]
Sharding bugs live where offsets of different spaces get mixed, so every offset here is
a :class:`Range` in one of three named spaces:

- *buffer space*: offsets into the whole flat buffer (identical on every rank);
- *param space*: offsets into one parameter's elements in memory order (``0 .. p.numel()``;
  row-major unless the tensor was wrapped in another memory format: [Note: element order]
  in element_order.py);
- *local space*: offsets into this rank's shard, the concatenation of its slice of every
  bucket in bucket order (``0 .. layout.shard_numel``), which is what ZeRO stores.

A :class:`ShardPiece` ties the three together for the part of one parameter a rank owns.

[Note: layout order]
Tensors are laid out in the order the caller gives, which for gradients is *reverse*
registration order: backward produces the last layers' gradients first, so bucket 0 (the
start of the buffer) completes first and its collective can start earliest. Stages 0-2 lay
the buffer out once more after the first backward, in the order gradients actually became
ready ([Note: bucket rebuild] in rebuild.py).
Every bucket is padded to a multiple of the world size N (of ``bucket_multiple``, itself a
multiple of N), so bucket b splits into N equal slices and slice r belongs to rank r.
Elements of a bucket that belong to no tensor -- the gaps in front of aligned tensors and
the tail -- are its *padding*: zero in every buffer laid out by the layout, and part of no
piece, so the optimizer and checkpoints never see them.

[Note: alignment]
NCCL's kernels, and the GEMMs that read parameters and gradients in place as views of the
buffer, run fastest on aligned addresses and sizes; a collective over a bucket at an odd
offset, or split into per-rank chunks of odd sizes, takes slower, narrower paths.
Megatron-core therefore starts every parameter at a multiple of 64 elements (a 128-byte
boundary for 16-bit and wider dtypes) and pads every bucket to a multiple of lcm(N, 128),
so every bucket starts on a 128-element boundary and still splits into N equal slices.
:func:`alignment_for` makes the same choice when ``align_for_bandwidth`` says so (by
default: when the process group's backend is NCCL; gloo keeps the dense layout).
The cost is memory and bytes sent: up to 63 elements in front of each tensor and up to
lcm(N, 128) - 1 at the end of each bucket, in every buffer (parameters, gradients, master
copies, shards, staging) and in every collective over a bucket, where ``comm_stats()``
counts them as padding. A bucket size that is a multiple of ``param_align`` keeps every
bucket's start aligned, so a bucket laid out alone (a flat parameter group) has the same
offsets as in the whole buffer.

[Note: whole-tensor ownership]
Stages 1-3 hand an elementwise optimizer (AdamW, SGD, ...) this rank's 1-D slices. An optimizer
whose update reads a whole tensor, each tensor on its own (Muon's Newton-Schulz, Adafactor's
factored moments, LARS's trust ratio, Shampoo's preconditioners: ``shardpar.optimizer``'s check
decides, optim/sharded.py), gets each of its tensors whole on one rank, its *owner*, by the
layout alone: such a tensor is placed whole inside its owner's slice of its bucket.

- Which tensors share a bucket window does not change (the cap decides, laid out densely in
  the given order: :meth:`BufferLayout._bucket_members`). Where a window is one bucket (a
  stage-3 unit's flat group), its elementwise tensors come first, back to back from the
  bucket's start (cut across slices as always); the owned ones follow in the room left in the
  slices, each whole in one. Where it may be more (stages 1-2: ``owned_apart``), the owned
  tensors get a bucket of their own behind the others', which stay densely sliced: elementwise
  state 1/N exactly, the owned balanced alone. The slice size is the smallest
  multiple of ``bucket_multiple / N`` for which they fit and the ranks stay balanced: each
  owned tensor, longest first, goes to the rank that updates the fewest elements so far (over
  every layout of the engine, elementwise pieces counted too) among those whose slice has room,
  and the size grows until the heaviest rank updates no more than the larger of what it would
  with unbounded room and the average plus the bucket's largest tensor.
- Owners are chosen once, when an optimizer asks for them (``engine.own_whole``: one
  all-gather per moved bucket, kind ``rebuild``) and kept by every later layout (the bucket
  rebuild keeps them, :class:`BufferLayout`'s ``owners``), so an owned tensor's state never
  crosses ranks again, and a class that groups its tensors (nanochat's Muon, by shape) groups
  the same ones for good.
- Then nothing else changes: a bucket's reduce-scatter delivers each owned tensor's averaged
  gradient whole to its owner, once per optimizer step (after accumulation); only the owner
  holds its state and runs its update (one Newton-Schulz per matrix per step in the job); the
  post-step all-gather (stages 1-2) or the unit gathers (stage 3) bring the updated tensor to
  every rank, as for slices. No collective is added per step; the price is padding (each slice
  padded to the fullest), in every buffer laid out by the layout and in every collective over
  those buckets, where ``comm_stats()`` counts it as padding. Under hybrid sharding the owners
  are ranks of the shard group; at world size 1 every tensor is whole already.
- The owner is handed the tensor in its own shape (:meth:`BufferLayout.optimizer_view`), and so
  is its gradient. Checkpoints address pieces in param space: an owned tensor is one piece
  ``[0, numel)``, and state shaped otherwise than it is stored whole (the manifest's
  ``whole_state``).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from ..comm import collectives as C
from .element_order import ElementOrder


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

    def intersect(self, other: Range) -> Range | None:
        start, end = max(self.start, other.start), min(self.end, other.end)
        return Range(start, end) if start < end else None

    def shift(self, offset: int) -> Range:
        return Range(self.start + offset, self.end + offset)

    def of(self, flat: torch.Tensor) -> torch.Tensor:
        """The 1-D view ``flat[start:end]``."""
        return flat[self.start : self.end]


@dataclass(frozen=True)
class ParamSlot:
    """Where one tensor lives: its ``range`` is in buffer space, holding its elements in the
    ``order`` the tensor keeps them in ([Note: element order])."""

    name: str
    order: ElementOrder
    range: Range
    bucket: int
    in_bucket: Range
    """``range`` indexed from its bucket's start (a buffer laid out like the bucket alone):
    made with the layout, so a gradient's place in a bucket costs no range per step."""

    @property
    def shape(self) -> torch.Size:
        return self.order.shape

    def shaped(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (1-D, this slot's elements) as the tensor: its shape and strides, a view."""
        return self.order.shaped(values)


@dataclass(frozen=True)
class Bucket:
    """A contiguous, padded range of the buffer whose gradients are reduced together."""

    index: int
    range: Range
    """Buffer space, padding included (``range.size % world_size == 0``)."""
    gaps: tuple[Range, ...]
    """Buffer space: the parts of ``range`` that belong to no tensor (in front of aligned
    tensors, and the tail), in buffer order."""
    names: tuple[str, ...]
    world_size: int
    shard_size: int = field(init=False, compare=False)
    """Elements of one rank's slice."""
    _shards: tuple[Range, ...] = field(init=False, repr=False, compare=False)
    _shards_in_bucket: tuple[Range, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Every rank's slice made once: the reducer and the gatherers ask for them every step.
        shard_size = self.range.size // self.world_size
        starts = [self.range.start + rank * shard_size for rank in range(self.world_size)]
        object.__setattr__(self, "shard_size", shard_size)  # a frozen dataclass sets its own fields so
        object.__setattr__(self, "_shards", tuple(Range(start, start + shard_size) for start in starts))
        object.__setattr__(
            self,
            "_shards_in_bucket",
            tuple(Range(start - self.range.start, start - self.range.start + shard_size) for start in starts),
        )

    @property
    def padding(self) -> int:
        """Elements of ``range`` that belong to no tensor (every gap, the tail included)."""
        return sum(gap.size for gap in self.gaps)

    def shard(self, rank: int) -> Range:
        """Rank ``rank``'s slice of this bucket, in buffer space."""
        return self._shards[rank]

    def shard_in_bucket(self, rank: int) -> Range:
        """Rank ``rank``'s slice of this bucket, indexed from the bucket's start (a buffer laid
        out like the bucket alone, such as a staging buffer)."""
        return self._shards_in_bucket[rank]


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


PARAM_ALIGN_FOR_BANDWIDTH = 64
"""Elements every tensor's start is a multiple of, aligned (see [Note: alignment])."""
BUCKET_ALIGN_FOR_BANDWIDTH = 128
"""Aligned, every bucket is a multiple of lcm(N, this) elements (see [Note: alignment])."""


class Alignment(NamedTuple):
    """What :class:`BufferLayout` aligns to; see [Note: alignment]."""

    param_align: int
    bucket_multiple: int


def aligns_for_bandwidth(align_for_bandwidth: bool | None, group: Any) -> bool:
    """``ShardConfig.align_for_bandwidth`` resolved: None means on when ``group`` (None: the
    default group) exists and its backend (for CUDA, where it has one) aligns: NCCL does."""
    if align_for_bandwidth is not None:
        return align_for_bandwidth
    return C.is_initialized() and C.traits(group).aligns


def alignment_for(align_for_bandwidth: bool | None, group: Any, world_size: int) -> Alignment:
    """The alignment of every layout an engine stores parameters or gradients in: the one
    place that decides it, so that every layout of one engine agrees (see [Note: alignment])."""
    if not aligns_for_bandwidth(align_for_bandwidth, group):
        return Alignment(param_align=1, bucket_multiple=world_size)
    return Alignment(PARAM_ALIGN_FOR_BANDWIDTH, math.lcm(world_size, BUCKET_ALIGN_FOR_BANDWIDTH))


class BufferLayout:
    """The index of a flat buffer: name -> slot, plus buckets and every rank's shard.

    Holds no storage: the engines allocate parameter, gradient and shard tensors of the
    sizes this layout gives and take views through it, so one layout serves all stages.
    """

    def __init__(
        self,
        tensors: Sequence[tuple[str, torch.Size | ElementOrder]],
        world_size: int,
        bucket_cap_numel: int | None = None,
        param_align: int = 1,
        bucket_multiple: int | None = None,
        owners: Mapping[str, int] | None = None,
        whole: Collection[str] = (),
        loads: Sequence[int] | None = None,
        owned_apart: bool = False,
    ) -> None:
        """``tensors`` in layout order, each with its shape (row-major) or its element order;
        ``bucket_cap_numel=None`` puts all in one bucket.

        A tensor larger than the cap gets a bucket of its own; a tensor is never split. The cap
        bounds a bucket's tensors and the gaps between them. Every tensor starts at a multiple
        of ``param_align`` (buffer space) and every bucket's size is a multiple of
        ``bucket_multiple`` (None: ``world_size``), which must be a multiple of ``world_size``
        and of ``param_align`` (see [Note: alignment]). The tensors named in ``owners`` are
        each placed whole inside their owner's slice of their bucket, and those named in
        ``whole`` (without an owner yet) inside the slice of the rank that updates the fewest
        elements so far, counting ``loads`` (elements per rank in the engine's other layouts):
        see [Note: whole-tensor ownership]. ``owned_apart``: the whole tensors of a bucket's
        members get a bucket of their own, behind one of the others (a layout of many buckets;
        a flat group's single bucket mixes them).
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        bucket_multiple = world_size if bucket_multiple is None else bucket_multiple
        if param_align < 1:
            raise ValueError(f"param_align must be >= 1, got {param_align}")
        if bucket_multiple < 1 or bucket_multiple % world_size or bucket_multiple % param_align:
            raise ValueError(
                f"bucket_multiple must be a positive multiple of world_size ({world_size}) and of param_align "
                f"({param_align}), so that buckets split into equal slices and start aligned; got {bucket_multiple}"
            )
        self.world_size = world_size
        self.param_align = param_align
        self.bucket_multiple = bucket_multiple
        self.slots: dict[str, ParamSlot] = {}
        self.buckets: list[Bucket] = []
        self.owners: dict[str, int] = {}
        """Tensors laid out whole in one rank's slice, and that rank ([Note: whole-tensor ownership])."""
        orders = {
            name: shape if isinstance(shape, ElementOrder) else ElementOrder(torch.Size(shape))
            for name, shape in tensors
        }
        owners = {name: rank for name, rank in (owners or {}).items() if name in orders}
        whole = set(owners) | {name for name in whole if name in orders}
        running = list(loads) if loads is not None else [0] * world_size
        """Elements each rank updates so far: the other layouts' and this one's buckets so far."""
        offset = 0
        for members in self._bucket_members(list(orders.items()), bucket_cap_numel):
            owned = [(name, order) for name, order in members if name in whole]
            if world_size == 1 or not owned:
                offset = self._place_dense(offset, members, running)
            elif owned_apart and len(owned) < len(members):
                offset = self._place_dense(offset, [item for item in members if item[0] not in whole], running)
                offset = self._place_owned(offset, owned, whole, owners, running)
            else:
                offset = self._place_owned(offset, members, whole, owners, running)
        if world_size == 1:  # one slice: every tensor lies whole in it, as densely laid out
            self.owners = {name: 0 for name in orders if name in whole}
        self.slots = {name: self.slots[name] for name in orders}  # the caller's order, whatever the placement
        self.numel = offset
        """Total buffer size in elements, padding included."""
        self.shard_numel = self.numel // world_size
        """Size of one rank's shard (identical on every rank)."""

    # ------------------------------------------------------------------ placement

    def _bucket_members(
        self, tensors: list[tuple[str, ElementOrder]], bucket_cap_numel: int | None
    ) -> list[list[tuple[str, ElementOrder]]]:
        """Which tensors share a bucket: consecutive ones, as long as they fit the cap laid out
        densely (aligned, in the given order). Decided before anything is placed, so that owning
        tensors whole changes where they lie in their bucket, never which bucket they are in."""
        cap = bucket_cap_numel if bucket_cap_numel is not None else float("inf")
        buckets: list[list[tuple[str, ElementOrder]]] = []
        current: list[tuple[str, ElementOrder]] = []
        offset = bucket_start = 0
        for name, order in tensors:
            start = padded_size(offset, self.param_align)
            if current and start - bucket_start + order.numel > cap:
                buckets.append(current)
                current = []
                offset = bucket_start = start = bucket_start + padded_size(offset - bucket_start, self.bucket_multiple)
            current.append((name, order))
            offset = start + order.numel
        if current:
            buckets.append(current)
        return buckets

    def _add_slot(self, name: str, order: ElementOrder, start: int, bucket_start: int) -> ParamSlot:
        slot = self.slots[name] = ParamSlot(
            name,
            order,
            Range(start, start + order.numel),
            len(self.buckets),
            Range(start - bucket_start, start - bucket_start + order.numel),
        )
        return slot

    def _close_bucket(self, bucket_start: int, end: int, slots: list[ParamSlot]) -> int:
        """The bucket ``[bucket_start, end)`` of the tensors just placed: its names in buffer
        order, its gaps the parts no tensor covers. Returns its end."""
        index = len(self.buckets)
        placed = sorted(slots, key=lambda slot: slot.range.start)
        gaps, position = [], bucket_start
        for slot in placed:
            if slot.range.start > position:
                gaps.append(Range(position, slot.range.start))
            position = slot.range.end
        if end > position:
            gaps.append(Range(position, end))
        self.buckets.append(
            Bucket(index, Range(bucket_start, end), tuple(gaps), tuple(s.name for s in placed), self.world_size)
        )
        return end

    def _place_dense(self, bucket_start: int, members: list[tuple[str, ElementOrder]], loads: list[int]) -> int:
        """Back to back, each tensor aligned, the bucket padded to ``bucket_multiple``."""
        offset, slots = bucket_start, []
        for name, order in members:
            start = padded_size(offset, self.param_align)
            slots.append(self._add_slot(name, order, start, bucket_start))
            offset = start + order.numel
        end = bucket_start + padded_size(offset - bucket_start, self.bucket_multiple)
        self._count_elementwise(bucket_start, offset, (end - bucket_start) // self.world_size, loads)
        return self._close_bucket(bucket_start, end, slots)

    def _count_elementwise(self, bucket_start: int, end: int, slice_size: int, loads: list[int]) -> None:
        """Add to ``loads`` the elements of ``[bucket_start, end)`` in each rank's slice (gaps
        between aligned tensors included: they are few, and the count only balances owners)."""
        for rank in range(self.world_size):
            slice_start = bucket_start + rank * slice_size
            loads[rank] += max(0, min(end, slice_start + slice_size) - slice_start)

    def _place_owned(
        self,
        bucket_start: int,
        members: list[tuple[str, ElementOrder]],
        whole: set[str],
        owners: Mapping[str, int],
        loads: list[int],
    ) -> int:
        """The elementwise tensors back to back from the bucket's start (cut across slices as
        always), then each whole tensor in one rank's slice: the smallest slice size that fits
        them (see [Note: whole-tensor ownership])."""
        offset, slots = bucket_start, []
        for name, order in members:
            if name not in whole:
                start = padded_size(offset, self.param_align)
                slots.append(self._add_slot(name, order, start, bucket_start))
                offset = start + order.numel
        elementwise_end = offset
        world, align = self.world_size, self.param_align
        granule = self.bucket_multiple // world  # a slice size that keeps the bucket a multiple of bucket_multiple
        owned = [(name, order) for name, order in members if name in whole]
        fixed = [(name, order) for name, order in owned if name in owners]
        longest_first = sorted((item for item in owned if item[0] not in owners), key=lambda item: -item[1].numel)
        heaviest_fixed = max(
            (sum(o.numel + align - 1 for n, o in fixed if owners[n] == rank) for rank in range(world)), default=0
        )
        needed = elementwise_end - bucket_start + sum(order.numel + align - 1 for _, order in owned)
        largest = max(order.numel for _, order in owned)
        # Where every tensor fits into any slice, each goes to the least loaded rank: the balance
        # the smaller slice sizes are held to (within one tensor of it, and of the average).
        roomy = padded_size(needed + heaviest_fixed, granule)
        unconstrained = self._pack(bucket_start, elementwise_end, roomy, fixed, longest_first, owners, loads)
        assert unconstrained is not None  # every slice holds all of them
        bound = max(max(unconstrained[1]), sum(unconstrained[1]) / world + largest)
        slice_size = padded_size(max(-(-needed // world), heaviest_fixed, largest), granule)
        while slice_size < roomy:
            placed = self._pack(bucket_start, elementwise_end, slice_size, fixed, longest_first, owners, loads)
            if placed is not None and max(placed[1]) <= bound:
                break
            slice_size = padded_size(slice_size + max(granule, slice_size // 16), granule)
        else:
            slice_size, placed = roomy, unconstrained
        assert placed is not None
        starts, loads[:] = placed
        for name, order in owned:
            start, rank = starts[name]
            slots.append(self._add_slot(name, order, start, bucket_start))
            self.owners[name] = rank
        return self._close_bucket(bucket_start, bucket_start + world * slice_size, slots)

    def _pack(
        self,
        bucket_start: int,
        elementwise_end: int,
        slice_size: int,
        fixed: list[tuple[str, ElementOrder]],
        longest_first: list[tuple[str, ElementOrder]],
        owners: Mapping[str, int],
        loads: list[int],
    ) -> tuple[dict[str, tuple[int, int]], list[int]] | None:
        """Whole tensors into slices of ``slice_size`` behind the elementwise tensors that reach
        into them: those with an owner into its slice, then the others longest first, each into
        the slice of the least loaded rank with room. ``(name -> (start, rank), the loads
        after)``, or None where they do not fit."""
        loads = list(loads)
        self._count_elementwise(bucket_start, elementwise_end, slice_size, loads)
        cursors = [max(bucket_start + rank * slice_size, elementwise_end) for rank in range(self.world_size)]
        starts: dict[str, tuple[int, int]] = {}

        def put(name: str, order: ElementOrder, rank: int) -> bool:
            start = padded_size(cursors[rank], self.param_align)
            if start + order.numel > bucket_start + (rank + 1) * slice_size:
                return False
            starts[name] = (start, rank)
            cursors[rank] = start + order.numel
            loads[rank] += order.numel
            return True

        for name, order in fixed:
            if not put(name, order, owners[name]):
                return None
        for name, order in longest_first:
            ranks = sorted(range(self.world_size), key=lambda r: (loads[r], r))
            if not any(put(name, order, rank) for rank in ranks):
                return None
        return starts, loads

    def rank_loads(self) -> list[int]:
        """Elements of tensors each rank updates in this layout (what ``loads`` counts)."""
        return [sum(piece.param_range.size for piece in self.pieces(rank)) for rank in range(self.world_size)]

    def bucket_alone(self, index: int) -> BufferLayout:
        """Bucket ``index`` as a layout of its own (a flat group's): the same tensors at the same
        offsets from the bucket's start, the same slices and owners."""
        bucket = self.buckets[index]
        alone = object.__new__(BufferLayout)
        alone.world_size, alone.param_align, alone.bucket_multiple = (
            self.world_size,
            self.param_align,
            self.bucket_multiple,
        )
        shift = -bucket.range.start
        alone.slots = {
            name: ParamSlot(
                name, self.slots[name].order, self.slots[name].range.shift(shift), 0, self.slots[name].in_bucket
            )
            for name in bucket.names
        }
        alone.buckets = [
            Bucket(
                0, bucket.range.shift(shift), tuple(g.shift(shift) for g in bucket.gaps), bucket.names, self.world_size
            )
        ]
        alone.owners = {name: self.owners[name] for name in bucket.names if name in self.owners}
        alone.numel = bucket.range.size
        alone.shard_numel = alone.numel // self.world_size
        return alone

    # ------------------------------------------------------------------ queries

    @property
    def names(self) -> list[str]:
        return list(self.slots)

    @property
    def padding(self) -> int:
        """Elements of the buffer that belong to no tensor (every bucket's gaps)."""
        return sum(b.padding for b in self.buckets)

    def view(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        """Tensor ``name`` as a view of the full flat buffer ``flat``, in its own shape and strides."""
        slot = self.slots[name]
        return slot.shaped(slot.range.of(flat))

    def optimizer_view(self, piece: ShardPiece, values: torch.Tensor) -> torch.Tensor:
        """What the optimizer is handed for ``piece`` (``values``: its 1-D elements): an owned
        tensor in its own shape ([Note: whole-tensor ownership]), any other piece 1-D."""
        if piece.name in self.owners:
            return self.slots[piece.name].shaped(values)
        return values

    def orders(self) -> dict[str, ElementOrder]:
        return {name: slot.order for name, slot in self.slots.items()}

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
