"""Who holds the values the optimizer updates at stages 0-2: the *master copy* part of a
replicated storage (core/replicated.py), the column of the stage table that stage 0 and stages
1-2 differ in.

- :class:`FullMaster` (stage 0): every rank updates every parameter: the parameters themselves,
  or a full-precision copy of the whole buffer under mixed precision, copied into the compute
  buffer after each step.
- :class:`ShardedMaster` (stages 1-2): each rank updates its slice of every bucket (its *master
  shard*: the slice of the buffer itself, or a full-precision copy of it under mixed precision),
  and the updated slices are all-gathered back into every rank's buffer after ``step()`` by its
  :class:`PostStepGatherer`, over its flat groups (one :class:`FlatParamGroup` per bucket).

Each part owns what the step does to the values after the optimizer (the copy at stage 0, the
gather at stages 1-2) and what a reader waits for; the storage asks its part and never which
stage it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..comm import collectives as C
from .flat_param import FlatParamGroup
from .gather_phases import PostStepGatherer
from .pieces import FullValues, TensorPiece
from .wait_clock import WaitClock

if TYPE_CHECKING:
    from .replicated import ReplicatedStorage


class FullMaster:
    """Stage 0 (see the module docstring)."""

    sharded = False
    gatherer: PostStepGatherer | None = None
    """Nothing is gathered: every rank updates every value."""
    groups: list[FlatParamGroup] = []
    """No flat groups: the parameters are views of the buffer, never pending."""

    def finish_setup(self, storage: ReplicatedStorage, group: Any, comm: C.CommStats, wait_clock: WaitClock) -> None:
        """Nothing to shard: every rank keeps every value."""

    def after_relayout(self, storage: ReplicatedStorage) -> None:
        """Nothing tracks the buckets."""

    def before_optimizer_step(self) -> None:
        """Nothing is in flight."""

    def after_optimizer_step(self, storage: ReplicatedStorage) -> None:
        """Under mixed precision the updated full-precision masters become the compute values."""
        for buf in storage.buffers:
            if buf.full_master is not None:
                buf.data.copy_(buf.full_master)

    def wait_for_params(self) -> None:
        """The parameters are always current."""

    def optimizer_pieces(self, storage: ReplicatedStorage, names: Sequence[str], strategy: Any) -> list[TensorPiece]:
        """Whole parameters (their full-precision copies under mixed precision)."""
        pieces = []
        for name in names:
            buf = storage.buffer_of[name]
            param = buf.params[name]
            master_grad = strategy.master_grad(buf, name)
            if buf.full_master is None and master_grad is strategy.views[name]:
                pieces.append(TensorPiece(name, param, (0, param.numel()), None))  # the parameter itself
            else:
                pieces.append(TensorPiece(name, buf.layout.view(buf.values, name), (0, param.numel()), master_grad))
        return pieces

    def load_pieces(self, storage: ReplicatedStorage) -> list[TensorPiece]:
        return [
            TensorPiece(name, buf.layout.slots[name].range.of(buf.values), (0, param.numel()))
            for buf in storage.buffers
            for name, param in buf.params.items()
        ]

    full_values = FullValues.IN_MASTERS
    """Under mixed precision; at full precision the parameters are the masters (see the storage)."""


class ShardedMaster:
    """Stages 1-2 (see the module docstring)."""

    sharded = True

    def __init__(self) -> None:
        self.groups: list[FlatParamGroup] = []
        """One flat group per bucket: what the post-step gather completes."""
        self._gatherer: PostStepGatherer | None = None

    @property
    def gatherer(self) -> PostStepGatherer:
        """The post-step gatherer over :attr:`groups` (made by :meth:`finish_setup`)."""
        assert self._gatherer is not None, "the sharded master is set up after the broadcast from rank 0"
        return self._gatherer

    def finish_setup(self, storage: ReplicatedStorage, group: Any, comm: C.CommStats, wait_clock: WaitClock) -> None:
        """After the broadcast: keep only this rank's master shard, and track the buckets."""
        for buf in storage.buffers:
            buf.shard_master(storage.rank)
        self.groups = [g for buf in storage.buffers for g in buf.bucket_groups(storage.rank)]
        self._gatherer = PostStepGatherer(self.groups, group, comm, wait_clock, storage.buffers[0].device)

    def after_relayout(self, storage: ReplicatedStorage) -> None:
        """New buckets, new flat groups to gather."""
        self.groups = [g for buf in storage.buffers for g in buf.bucket_groups(storage.rank)]
        self.gatherer.track(self.groups)

    def before_optimizer_step(self) -> None:
        """The step overwrites the slices a pending gather sends."""
        self.gatherer.wait_all()

    def after_optimizer_step(self, storage: ReplicatedStorage) -> None:
        """Launch the all-gather of every bucket's updated slices (completed lazily: [Note: lazy
        parameter gather] in replicated.py)."""
        self.gatherer.start_all()

    def wait_for_params(self) -> None:
        self.gatherer.wait_all()

    def optimizer_pieces(self, storage: ReplicatedStorage, names: Sequence[str], strategy: Any) -> list[TensorPiece]:
        """This rank's pieces of the named parameters (names it owns nothing of drop out)."""
        wanted = set(names)
        found = {}
        for buf in storage.buffers:
            for piece in buf.layout.pieces(storage.rank):
                if piece.name in wanted:
                    found[piece.name] = TensorPiece(
                        piece.name,
                        buf.master_piece(piece),
                        (piece.param_range.start, piece.param_range.end),
                        strategy.piece_grad(buf, piece),
                    )
        return [found[name] for name in names if name in found]

    def load_pieces(self, storage: ReplicatedStorage) -> list[TensorPiece]:
        return [
            TensorPiece(p.name, buf.master_piece(p), (p.param_range.start, p.param_range.end))
            for buf in storage.buffers
            for p in buf.layout.pieces(storage.rank)
        ]

    full_values = FullValues.GATHERED
    """The masters are sharded."""
