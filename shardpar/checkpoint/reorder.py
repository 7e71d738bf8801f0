"""Pieces of tensors kept in another element order than row-major, to and from checkpoints.

[Note: reordered pieces]
A rank's pieces count a parameter's elements in memory order ([Note: element order] in
core/element_order.py), while a checkpoint, a Hugging Face file and a state dict hold the
tensor row-major. For most tensors the two orders are the same and nothing here runs. For the
others (a ``channels_last`` conv weight) ranges translate in whole *blocks* (one output channel
of the weight): a range of whole blocks is the same range in both orders, its elements
permuted within each block.

- Writing: each rank writes, row-major, the blocks that *begin* inside its piece
  ``[a, b)``: the range ``[ceil(a), ceil(b))`` in blocks. So every block is written once, by the
  rank holding its first element, and the items on disk stay row-major ranges that any reader
  (a load at another world size, ``tools/consolidate.py``) takes as it takes any other. The
  part of a block that lies in the next ranks' pieces reaches its writer first:
  :func:`to_row_major` plans every transfer from all ranks' piece ranges (known to every rank
  after one all-gather of metadata, which the save's first agreement carries) and runs them
  as point-to-point sends in one global order, so no rank waits for one that waits for it.
  At most one partial block per piece crosses ranks, the rest is permuted locally, and only
  when the writer asks for it (one piece at a time).
- Reading: a rank reads, row-major, the whole blocks around its piece (at most a block more
  on each side), permutes them and keeps its range: no communication. The reads go through
  one reused staging buffer per dtype, chunk by chunk (:class:`ReorderedReads`).
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import collectives as C
from ..core.element_order import ElementOrder
from ..errors import CheckpointError
from .host_bytes import CHUNK_BYTES

Ref = tuple[str, ...]
"""What a piece is of: ``("model", name)`` or ``("state", name, key)``; ``ref[1]`` names the
parameter whose element order it has."""


@dataclass(frozen=True)
class MemoryPiece:
    """Elements ``[start, end)`` (memory order) of ``ref``, held by this rank in ``tensor`` (1-D)."""

    ref: Ref
    start: int
    end: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class RowMajorPiece:
    """Elements ``[start, end)`` (row-major) of ``ref``; ``values()`` makes them (1-D)."""

    ref: Ref
    start: int
    end: int
    dtype: torch.dtype
    values: Callable[[], torch.Tensor]


def row_major_range(order: ElementOrder, start: int, end: int) -> tuple[int, int]:
    """The row-major range written for a piece ``[start, end)`` in memory order: the whole
    blocks that begin inside it (empty when none does)."""
    block = order.block
    return -(-start // block) * block, -(-end // block) * block


@dataclass(frozen=True)
class _Transfer:
    ref: Ref
    sender: int
    receiver: int
    start: int  # memory order
    end: int


def _plan(held: Sequence[Sequence[tuple[Ref, int, int]]], orders: Mapping[str, ElementOrder]) -> list[_Transfer]:
    """Every transfer of every rank, in the one order all ranks run them in; a CheckpointError
    (the same on every rank) where some block would be written with elements no rank holds."""
    by_ref: dict[Ref, list[tuple[int, int, int]]] = defaultdict(list)
    for rank, rank_ranges in enumerate(held):
        for ref, start, end in rank_ranges:
            if start < end:
                by_ref[ref].append((start, end, rank))
    transfers = []
    for ref in sorted(by_ref):
        order = orders[ref[1]]
        ranges = sorted(by_ref[ref])  # disjoint: each element is held once
        starts = [start for start, _, _ in ranges]
        arriving: dict[int, list[tuple[int, int]]] = defaultdict(list)  # index of a writer's range -> what it gets
        for start, end, rank in ranges:
            first, next_block = order.block_span(start, start + 1)  # the block ``start`` lies in
            cut = min(end, next_block)
            if start == first:
                continue  # it begins on a block boundary: all of it is written here
            writer = bisect.bisect_right(starts, first) - 1  # the range holding the block's first element
            if writer < 0 or ranges[writer][1] <= first:
                raise CheckpointError(
                    f"cannot save {'/'.join(ref)} row-major: no rank holds its element {first} "
                    "(memory order), where a block begins"
                )
            transfers.append(_Transfer(ref, rank, ranges[writer][2], start, cut))
            arriving[writer].append((start, cut))
        for index, (start, end, _) in enumerate(ranges):  # each writer's last block must arrive whole
            first, last = row_major_range(order, start, end)
            if first >= last:
                continue  # it writes nothing: it lies inside a block another range begins
            covered = end
            for a, b in arriving[index]:  # in order: the ranges are sorted
                if a != covered:
                    break
                covered = b
            if covered < last:
                missing = min([a for a, _ in arriving[index] if a > covered] + [last])
                raise CheckpointError(
                    f"cannot save {'/'.join(ref)} row-major: no rank holds its elements "
                    f"[{covered}, {missing}) (memory order)"
                )
    return transfers


def to_row_major(
    pieces: Sequence[MemoryPiece],
    held: Sequence[Sequence[tuple[Ref, int, int]]],
    orders: Mapping[str, ElementOrder],
    rank: int,
    group: Any,
) -> list[RowMajorPiece]:
    """This rank's ``pieces`` (of reordered tensors) as the row-major pieces it writes (see
    [Note: reordered pieces]). ``held[r]`` lists rank r's ``(ref, start, end)`` of such pieces;
    every rank calls this with the same ``held`` (a collective: it runs the transfers)."""
    tails: dict[tuple[Ref, int], torch.Tensor] = {}  # a piece's (ref, start) -> the rest of its last block
    for piece in pieces:
        first, last = row_major_range(orders[piece.ref[1]], piece.start, piece.end)
        if first < last and last > piece.end:  # it writes blocks, the last of which goes on past it
            tails[piece.ref, piece.start] = torch.empty(
                last - piece.end, dtype=piece.tensor.dtype, device=piece.tensor.device
            )

    def arriving(transfer: _Transfer) -> torch.Tensor:
        """Where a transfer to this rank lands: in the tail of the piece whose last block it completes."""
        for piece in pieces:
            if (
                piece.ref == transfer.ref
                and (piece.ref, piece.start) in tails
                and piece.end <= transfer.start < piece.end + tails[piece.ref, piece.start].numel()
            ):
                return tails[piece.ref, piece.start][transfer.start - piece.end : transfer.end - piece.end]
        raise AssertionError(f"no piece of {transfer.ref} on rank {rank} ends before {transfer.start}")

    with torch.no_grad():
        for transfer in _plan(held, orders):
            if transfer.sender == rank:
                source = next(p for p in pieces if p.ref == transfer.ref and p.start == transfer.start)
                sent = source.tensor[: transfer.end - transfer.start]
                if transfer.receiver == rank:  # a rank holding two pieces of one tensor
                    arriving(transfer).copy_(sent)
                else:
                    C.send(sent.contiguous(), transfer.receiver, group=group)
            elif transfer.receiver == rank:
                C.recv(arriving(transfer), transfer.sender, group=group)
    out = []
    for piece in pieces:
        order = orders[piece.ref[1]]
        first, last = row_major_range(order, piece.start, piece.end)
        if first >= last:
            continue  # all of it went to the writers of the blocks it lies in
        own = piece.tensor[first - piece.start :]
        tail = tails.get((piece.ref, piece.start))

        def values(
            order: ElementOrder = order, own: torch.Tensor = own, tail: torch.Tensor | None = tail
        ) -> torch.Tensor:
            return order.to_row_major(own if tail is None else torch.cat([own, tail]))

        out.append(RowMajorPiece(piece.ref, first, last, piece.tensor.dtype, values))
    return out


class ReorderedReads:
    """Row-major reads into pieces of reordered tensors (see [Note: reordered pieces]): each
    piece's whole blocks are read in chunks of about :data:`CHUNK_BYTES` into a staging buffer
    shared by all chunks of one dtype and device, permuted, and the piece's part copied into
    place. ``plan(start, end, dest)`` plans the reads of a row-major range into ``dest`` (as a
    checkpoint or Hugging Face reader does); :meth:`run` executes them one chunk after another."""

    def __init__(self) -> None:
        self._chunks: list[tuple[list[Any], Callable[[], None]]] = []
        self._staging: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def reads_for(
        self,
        order: ElementOrder,
        start: int,
        end: int,
        dest: torch.Tensor,
        plan: Callable[[int, int, torch.Tensor], list[Any]],
    ) -> list[Any]:
        """The reads that fill ``dest`` (1-D) with elements ``[start, end)`` in param space of a
        tensor of ``order`` stored row-major: ``plan``'s own where the order is row-major;
        otherwise none, and the range is read here (by :meth:`run`)."""
        if not order.reorders:
            return plan(start, end, dest)
        self.add(order, start, end, dest, plan)
        return []

    def add(
        self,
        order: ElementOrder,
        start: int,
        end: int,
        dest: torch.Tensor,
        plan: Callable[[int, int, torch.Tensor], list[Any]],
    ) -> None:
        """Fill ``dest`` (1-D) with elements ``[start, end)`` (memory order) of a tensor of ``order``."""
        first, last = order.block_span(start, end)
        block = order.block
        step = max(1, CHUNK_BYTES // dest.element_size() // block) * block
        for chunk_start in range(first, last, step):
            chunk_end = min(last, chunk_start + step)
            staging = self._staging_for(dest, chunk_end - chunk_start)
            low, high = max(start, chunk_start), min(end, chunk_end)

            def finish(
                staging: torch.Tensor = staging, low: int = low, high: int = high, chunk_start: int = chunk_start
            ) -> None:
                permuted = order.to_memory_order(staging)
                dest[low - start : high - start].copy_(permuted[low - chunk_start : high - chunk_start])

            self._chunks.append((plan(chunk_start, chunk_end, staging), finish))

    def _staging_for(self, dest: torch.Tensor, numel: int) -> torch.Tensor:
        key = (dest.dtype, dest.device)
        buffer = self._staging.get(key)
        if buffer is None or buffer.numel() < numel:  # chunks planned before keep the smaller one
            buffer = self._staging[key] = torch.empty(numel, dtype=dest.dtype, device=dest.device)
        return buffer[:numel]

    @property
    def reads(self) -> list[Any]:
        """Every planned read (to check the files before any is run)."""
        return [read for reads, _ in self._chunks for read in reads]

    def run(self, run_reads: Callable[[list[Any]], None]) -> None:
        with torch.no_grad():
            for reads, finish in self._chunks:
                run_reads(reads)
                finish()
