"""Who holds the values the optimizer updates at stages 0-2: the *master copy* part of a
replicated storage (core/replicated.py), the column of the stage table that stage 0 and stages
1-2 differ in. Each part owns its tensors; the storage's :class:`ParamBuffer` holds only the
compute buffer and its layout.

- :class:`FullMaster` (stage 0): every rank updates every parameter: the parameters themselves
  (the compute buffer), or under mixed precision a full-precision copy of each buffer (its
  :attr:`~FullMaster.copies`), copied into the compute buffer after each step.
- :class:`ShardedMaster` (stages 1-2): each rank updates its slice of every bucket (its *master
  shard*: the slice of the compute buffer itself, or under mixed precision a full-precision copy
  of it, its :attr:`~ShardedMaster.shards`), and the updated slices are all-gathered back into
  every rank's buffer after ``step()`` by its :class:`PostStepGatherer`, over its flat groups
  (one :class:`FlatParamGroup` per bucket).

Each part owns what the step does to the values after the optimizer (the copy at stage 0, the
gather at stages 1-2) and what a reader waits for; the storage asks its part and never which
stage it is. Whether there is a full-precision copy at all (mixed precision) is the part's own
business: a buffer without one has no entry in its map.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .flat_param import FlatParamGroup
from .gather_phases import PostStepGatherer
from .layout import ShardPiece
from .pieces import FullValues, TensorPiece
from .rebuild import Relayout
from .reduce_strategies import PieceGradients, WholeGradients

if TYPE_CHECKING:
    from .reduce_strategies import ReduceStrategy
    from .replicated import ParamBuffer


def full_precision_copy(buf: ParamBuffer) -> torch.Tensor | None:
    """``buf``'s values in their own (master) dtype, laid out like the buffer (1-D, padded),
    where the buffer computes in a narrower one (mixed precision); None where it does not.
    Read from the parameters before they become views of the compute buffer."""
    if buf.compute_dtype == buf.master_dtype:
        return None
    full = torch.zeros(buf.layout.numel, dtype=buf.master_dtype, device=buf.device)
    with torch.no_grad():
        for name, param in buf.params.items():
            buf.layout.view(full, name).copy_(param.data)
    return full


class FullMaster:
    """Stage 0 (see the module docstring)."""

    sharded = False
    groups: list[FlatParamGroup] = []
    """No flat groups: the parameters are views of the buffer, never pending."""
    full_values = FullValues.IN_MASTERS
    """Under mixed precision; at full precision the parameters are the masters (see the storage)."""

    def __init__(self) -> None:
        self.copies: dict[ParamBuffer, torch.Tensor] = {}
        """Under mixed precision, each buffer's full-precision values (1-D, the buffer's layout):
        what the optimizer updates and checkpoints hold."""

    def keep_values(self, buf: ParamBuffer) -> None:
        """At wrap, before ``buf``'s parameters become views of its compute buffer."""
        full = full_precision_copy(buf)
        if full is not None:
            self.copies[buf] = full

    def values(self, buf: ParamBuffer) -> torch.Tensor:
        """``buf``'s full-precision values (1-D, buffer space): its copy, else the compute buffer."""
        return self.copies.get(buf, buf.data)

    def tensors_to_broadcast(self) -> list[torch.Tensor]:
        return list(self.copies.values())

    def finish_setup(self, buffers: Sequence[ParamBuffer]) -> None:
        """Nothing to shard: every rank keeps every value."""

    def relayout(self, buffers: Sequence[ParamBuffer], moves: Mapping[ParamBuffer, Relayout]) -> None:
        """The copies follow their buffers to the new layouts ([Note: bucket rebuild])."""
        with torch.no_grad():
            for buf, move in moves.items():
                if buf in self.copies:
                    self.copies[buf] = move.full(self.copies[buf])

    def before_optimizer_step(self, names: frozenset[str] | None) -> None:
        """Nothing is in flight."""

    def after_optimizer_step(self, buffers: Sequence[ParamBuffer], names: frozenset[str] | None) -> None:
        """Under mixed precision the updated full-precision copies become the compute values."""
        for buf, full in self.copies.items():
            buf.data.copy_(full)

    def wait_for_params(self) -> None:
        """The parameters are always current."""

    def optimizer_pieces(
        self, buffers: Sequence[ParamBuffer], names: Sequence[str], strategy: ReduceStrategy
    ) -> list[TensorPiece]:
        """Whole parameters (views of their full-precision values), with their reduced gradients."""
        assert isinstance(strategy, WholeGradients), "stage 0's row pairs the full master with whole gradients"
        buffer_of = {name: buf for buf in buffers for name in buf.params}
        pieces = []
        for name in names:
            buf = buffer_of[name]
            param = buf.params[name]
            pieces.append(
                TensorPiece(
                    name, buf.layout.view(self.values(buf), name), (0, param.numel()), strategy.master_grad(buf, name)
                )
            )
        return pieces

    def piece_values(self, buf: ParamBuffer, piece: ShardPiece) -> torch.Tensor:
        """This rank's full-precision values of ``piece`` (1-D view)."""
        return piece.buffer_range.of(self.values(buf))

    def load_pieces(self, buffers: Sequence[ParamBuffer]) -> list[TensorPiece]:
        return [
            TensorPiece(name, buf.layout.slots[name].range.of(self.values(buf)), (0, param.numel()))
            for buf in buffers
            for name, param in buf.params.items()
        ]

    def tensors(self) -> list[torch.Tensor]:
        """What it holds beside the compute buffers (memory accounting)."""
        return list(self.copies.values())


def bucket_groups(buf: ParamBuffer, shard_of: torch.Tensor | None, rank: int) -> list[FlatParamGroup]:
    """One flat parameter group per bucket of ``buf``, views of its compute buffer, each
    with this rank's master slice as its shard: of ``shard_of`` (local space) where there is a
    full-precision shard, else of the compute buffer itself."""
    groups = []
    for bucket in buf.layout.buckets:
        named = [(name, buf.params[name]) for name in bucket.names]
        sub = buf.layout.bucket_alone(bucket.index)
        if shard_of is not None:
            shard = buf.layout.shard_of(bucket, shard_of)
        else:
            shard = bucket.shard(rank).of(buf.data)
        group = FlatParamGroup(
            f"{buf.compute_dtype} bucket {bucket.index}",
            "",
            named,
            sub,
            bucket.range.of(buf.data),
            shard,
            rank,
            frees_storage=False,
            trainable=True,
        )
        groups.append(group)
    return groups


class ShardedMaster:
    """Stages 1-2 (see the module docstring). ``gatherer`` is made by the stage's row
    (engines/stages.py) and tracks this part's flat groups from :meth:`finish_setup` on."""

    sharded = True
    full_values = FullValues.GATHERED
    """The masters are sharded."""

    def __init__(self, rank: int, gatherer: PostStepGatherer) -> None:
        self.rank = rank
        self.gatherer = gatherer
        """All-gathers the updated slices after ``step()`` (completed lazily: [Note: lazy
        parameter gather] in replicated.py)."""
        self.full: dict[ParamBuffer, torch.Tensor] = {}
        """Under mixed precision, from wrap until :meth:`finish_setup`: each buffer's whole
        full-precision copy (broadcast from rank 0, then cut to this rank's slices)."""
        self.shards: dict[ParamBuffer, torch.Tensor] = {}
        """Under mixed precision, after :meth:`finish_setup`: each buffer's master shard, this
        rank's slice of every bucket at full precision (1-D, local space)."""
        self.groups: list[FlatParamGroup] = []
        """One flat group per bucket: what the post-step gather completes."""

    def keep_values(self, buf: ParamBuffer) -> None:
        """At wrap, before ``buf``'s parameters become views of its compute buffer."""
        full = full_precision_copy(buf)
        if full is not None:
            self.full[buf] = full

    def tensors_to_broadcast(self) -> list[torch.Tensor]:
        return list(self.full.values())

    def finish_setup(self, buffers: Sequence[ParamBuffer]) -> None:
        """After the broadcast: keep only this rank's master shard, and track the buckets."""
        for buf, full in self.full.items():
            self.shards[buf] = torch.cat([b.shard(self.rank).of(full) for b in buf.layout.buckets])
        self.full = {}
        self._track(buffers)

    def _track(self, buffers: Sequence[ParamBuffer]) -> None:
        self.groups = [g for buf in buffers for g in bucket_groups(buf, self.shards.get(buf), self.rank)]
        self.gatherer.track(self.groups)

    def relayout(self, buffers: Sequence[ParamBuffer], moves: Mapping[ParamBuffer, Relayout]) -> None:
        """The shards follow their buffers to the new layouts ([Note: bucket rebuild]), and
        the new buckets get new flat groups to gather."""
        with torch.no_grad():
            for buf, move in moves.items():
                if buf in self.shards:
                    self.shards[buf] = move.local(self.shards[buf])
        self._track(buffers)

    def before_optimizer_step(self, names: frozenset[str] | None) -> None:
        """The step overwrites the slices a pending gather of their buckets sends."""
        self.gatherer.wait(self._updating(names))

    def after_optimizer_step(self, buffers: Sequence[ParamBuffer], names: frozenset[str] | None) -> None:
        """Launch the all-gather of the updated slices of every bucket holding a parameter of
        ``names`` (completed lazily: [Note: lazy parameter gather] in replicated.py). Two
        optimizers over parts of the model (Muon's matrices, AdamW's rest) each gather their
        own buckets, once: a bucket holding parameters of both is gathered after each."""
        self.gatherer.start(self._updating(names))

    def _updating(self, names: frozenset[str] | None) -> list[FlatParamGroup]:
        """The flat groups (buckets) holding a parameter of ``names`` (None: all); the same on
        every rank, as the gathers are collective."""
        if names is None:
            return self.groups
        return [group for group in self.groups if not names.isdisjoint(group.params)]

    def wait_for_params(self) -> None:
        self.gatherer.wait_all()

    def piece_values(self, buf: ParamBuffer, piece: ShardPiece) -> torch.Tensor:
        """This rank's full-precision values of ``piece`` (1-D view)."""
        shard = self.shards.get(buf)
        if shard is not None:
            return piece.local_range.of(shard)
        return piece.buffer_range.of(buf.data)

    def optimizer_pieces(
        self, buffers: Sequence[ParamBuffer], names: Sequence[str], strategy: ReduceStrategy
    ) -> list[TensorPiece]:
        """This rank's pieces of the named parameters (names it owns nothing of drop out)."""
        assert isinstance(strategy, PieceGradients), "stages 1-2's rows pair the sharded master with sharded gradients"
        wanted = set(names)
        found = {}
        for buf in buffers:
            for piece in buf.layout.pieces(self.rank):
                if piece.name in wanted:
                    found[piece.name] = TensorPiece(
                        piece.name,
                        buf.layout.optimizer_view(piece, self.piece_values(buf, piece)),
                        (piece.param_range.start, piece.param_range.end),
                        buf.layout.optimizer_view(piece, strategy.piece_grad(buf, piece)),
                    )
        return [found[name] for name in names if name in found]

    def load_pieces(self, buffers: Sequence[ParamBuffer]) -> list[TensorPiece]:
        return [
            TensorPiece(p.name, self.piece_values(buf, p), (p.param_range.start, p.param_range.end))
            for buf in buffers
            for p in buf.layout.pieces(self.rank)
        ]

    def tensors(self) -> list[torch.Tensor]:
        """What it holds beside the compute buffers (memory accounting)."""
        return list(self.full.values()) + list(self.shards.values())
