"""Stages 2-3's gradient strategy: no full gradient buffer; a bucket's gradients are copied
into a staging buffer from a bounded pool, reduce-scattered out of it into this rank's
gradient shard, and the staging buffer goes back to the pool.

[Note: no_sync at stages 2-3]
Inside ``no_sync()`` nothing is reduced, so gradients must be kept in full. They are added,
as each becomes final, into a full-size accumulation buffer per bucketed parameter set in the
*reduce* dtype (as stages 0-1 accumulate in their full buffer), and ``param.grad`` is
released; the synchronising backward stages "accumulated + new" and reduces it, after which
the accumulation buffer is freed. Its bytes are what gradient accumulation costs at these
stages (``memory_stats()["grads"]`` counts them while they exist).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..comm import collectives as C
from .averaging import AcrossReplicas, ReduceDtype, scale
from .layout import Bucket, ShardPiece
from .param_guard import metadata_only
from .rebuild import Relayout
from .reduce_strategies import ShardedAverage, nbytes, zero_pieces
from .reducer import BucketedParams, GradBucket


class StagedReduceScatter(ShardedAverage):
    """Stages 2-3; see [Note: no_sync at stages 2-3]. ``max_in_flight`` reductions may be
    outstanding; launching one more waits for the oldest, and the pool keeps at most
    ``max_in_flight + 1`` released staging buffers."""

    max_in_flight: int | None = 2
    full_grads_on_params = False

    def __init__(
        self,
        spaces: Sequence[BucketedParams],
        reduce_dtype: ReduceDtype,
        world_size: int,
        rank: int,
        group: Any,
        comm: C.CommStats,
        replicas: AcrossReplicas | None = None,
        ranks_summed: int | None = None,
        divide_factor: float | None = None,
    ) -> None:
        self._set_up_sharding(
            spaces, reduce_dtype, world_size, rank, group, comm, replicas, ranks_summed, divide_factor
        )
        self.grad_shards = {
            s: torch.zeros(s.layout.shard_numel, dtype=s.master_dtype, device=s.device) for s in spaces
        }  # 1-D, this rank's slice of every bucket, in bucket order (local space), master dtype
        self._staging: dict[int, StagingBuffer] = {}  # bucket position -> its full-size gradients
        self._free: list[StagingBuffer] = []
        """Released staging buffers, each knowing the layout bucket it last served."""
        self._accumulated: dict[BucketedParams, torch.Tensor] = {}  # no_sync, full size, reduce dtype
        self.peak_staging_bytes = 0
        for space in spaces:
            for param in space.params.values():
                param.grad = None

    # ------------------------------------------------------------------ staging

    def _staging_for(self, bucket: GradBucket) -> StagingBuffer:
        staging = self._staging.get(bucket.position)
        if staging is None:
            dtype, numel = self.reduce_dtype(bucket.space), bucket.spec.range.size
            reusable = [i for i, b in enumerate(self._free) if b.data.dtype == dtype and b.data.numel() == numel]
            reusable.sort(key=lambda i: self._free[i].served is not bucket.spec)  # one that served this bucket first
            if reusable:
                staging = self._free.pop(reusable[0])
            else:
                staging = StagingBuffer(torch.empty(numel, dtype=dtype, device=bucket.space.device))
            # Not zeroed as a whole: every slot is overwritten by its gradient or, if none comes,
            # by fill_missing; only the padding must be zero. It stays zero while the buffer
            # serves the same bucket (the collective sums zeros there), so it is zeroed only
            # when the buffer comes new or from another bucket -- of this layout or of the
            # one before a rebuild, whose gaps differ ([Note: bucket rebuild]).
            if staging.served is not bucket.spec:
                for gap in bucket.spec.gaps:
                    gap.shift(-bucket.spec.range.start).of(staging.data).zero_()
                staging.served = bucket.spec
            self._staging[bucket.position] = staging
            self.peak_staging_bytes = max(self.peak_staging_bytes, nbytes(b.data for b in self._staging.values()))
        return staging

    def _slot(self, bucket: GradBucket, name: str, full: torch.Tensor | None = None) -> torch.Tensor:
        """``name``'s gradient slot in the bucket's staging buffer (or in ``full``, a buffer
        indexed like the whole space)."""
        if full is not None:
            slot = bucket.space.layout.slots[name]
            return slot.shaped(slot.range.of(full))
        return self._staging_for(bucket).slots(bucket)[name]

    def _accumulation(self, space: BucketedParams) -> torch.Tensor:
        if space not in self._accumulated:
            self._accumulated[space] = torch.zeros(
                space.layout.numel, dtype=self.reduce_dtype(space), device=space.device
            )
        return self._accumulated[space]

    # ------------------------------------------------------------------ gradients arriving

    def in_place_views(self) -> dict[str, torch.Tensor]:
        """None are: a staging bucket exists only from its first gradient to its reduction, so each
        gradient is copied into it (accept_grad) rather than accumulated there by autograd."""
        return {}

    def grads_into_buffer(self, buckets: Sequence[GradBucket]) -> None:
        """Nothing to point ``.grad`` at before backward: see :meth:`in_place_views`."""

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        assert param.grad is not None  # called from its post-accumulate-grad hook: the gradient is there
        staging = self._staging.get(bucket.position)
        if staging is None:
            staging = self._staging_for(bucket)
        slot = staging.slots(bucket)[name]
        slot.copy_(param.grad)
        if bucket.space in self._accumulated:
            slot.add_(self._slot(bucket, name, self._accumulated[bucket.space]))
        param.grad = None

    def accept_again(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        """See [Note: a gradient that arrives twice] in reducer.py."""
        assert param.grad is not None  # called from its post-accumulate-grad hook
        self._slot(bucket, name).add_(param.grad)
        param.grad = None

    def accumulate_no_sync(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        assert param.grad is not None  # called from its post-accumulate-grad hook
        self._slot(bucket, name, self._accumulation(bucket.space)).add_(param.grad)
        param.grad = None

    def late_buffer(self, bucket: GradBucket) -> torch.Tensor:
        return torch.zeros(bucket.spec.range.size, dtype=self.reduce_dtype(bucket.space), device=bucket.space.device)

    def finish_late(self, bucket: GradBucket, late: torch.Tensor) -> None:
        shard = bucket.space.layout.shard_of(bucket.spec, self.grad_shards[bucket.space])
        shard.add_(self._reduced_late(bucket, late))

    def fill_missing(self, bucket: GradBucket) -> None:
        accumulated = self._accumulated.get(bucket.space)
        for name in bucket.missing:
            if accumulated is not None:
                self._slot(bucket, name).copy_(self._slot(bucket, name, accumulated))
            else:
                self._slot(bucket, name).zero_()

    # ------------------------------------------------------------------ collectives

    def start(self, bucket: GradBucket) -> C.Handle:
        staging = self._staging_for(bucket).data
        plan = self.averaging_of[bucket.space]
        scale(staging, plan.before)
        return C.reduce_scatter(
            self.owned_in_staging(bucket, staging),
            staging,
            group=self.group,
            async_op=True,
            stats=self.comm,
            padding_numel=bucket.spec.padding,
            op=plan.op,
        )

    def finish(self, bucket: GradBucket) -> None:
        buffer = self._staging.pop(bucket.position)
        owned = self.owned_in_staging(bucket, buffer.data)
        self.sum_replicas(bucket, owned)
        shard = bucket.space.layout.shard_of(bucket.spec, self.grad_shards[bucket.space])
        scale = self.averaging_of[bucket.space].after
        if bucket.reduced:  # accumulating over a reduction since zero_grad
            shard.add_(owned, alpha=scale)
        elif shard.dtype == owned.dtype:
            torch.mul(owned, scale, out=shard)
        else:
            shard.copy_(owned).mul_(scale)
        bucket.reduced = True
        self._free.append(buffer)
        assert self.max_in_flight is not None  # this strategy always bounds the reductions in flight
        if len(self._free) > self.max_in_flight + 1:
            self._free.pop(0)

    def after_sync_backward(self) -> None:
        self._accumulated.clear()

    def clear(self) -> None:
        # Nothing reduced is zeroed: the first reduction of a bucket after zero_grad
        # (`bucket.reduced` False) overwrites its gradient-shard slice.
        self._accumulated.clear()
        with metadata_only():
            for space in self.spaces:
                for param in space.params.values():
                    param.grad = None

    def clear_params(self, names: set[str], set_to_none: bool = True) -> None:
        for space in self.spaces:
            zero_pieces(space, self.rank, names, self.grad_shards[space])
            if space in self._accumulated:
                for name in names & space.params.keys():
                    space.layout.view(self._accumulated[space], name).zero_()

    def release_unused(self, names: set[str]) -> None:
        """The optimizer skips them (see ShardedOptimizer); nothing to release here."""

    def relayout(self, moves: dict[BucketedParams, Relayout]) -> None:
        """See [Note: bucket rebuild]: between backwards only the gradient shards exist (the
        pool's free staging buffers are kept: each served a bucket of the old layout, so its
        padding is zeroed again on first use)."""
        assert not self._staging and not self._accumulated, "rebuilding buckets while gradients are staged"
        for space, move in moves.items():
            self.grad_shards[space] = move.local(self.grad_shards[space])

    # ------------------------------------------------------------------ what the optimizer reads

    def piece_grad(self, space: BucketedParams, piece: ShardPiece) -> torch.Tensor:
        return piece.local_range.of(self.grad_shards[space])

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        return list(self.grad_shards.values()), True

    def grad_bytes(self) -> int:
        return nbytes(list(self.grad_shards.values()) + list(self._accumulated.values()))

    def workspace_bytes(self) -> int:
        return nbytes([b.data for b in self._staging.values()] + [b.data for b in self._free])


class StagingBuffer:
    """One bucket-sized staging buffer of the pool: its tensor (1-D, reduce dtype), the layout
    bucket it last served (whose padding it holds zeroed), and its gradient slots for each
    bucket it served, made once: a gradient hook then copies into a view it looks up ([Note:
    the host's share of a step] in engines/hooks.py)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.served: Bucket | None = None
        self._slots: dict[int, tuple[Bucket, dict[str, torch.Tensor]]] = {}
        """Bucket position -> (the layout bucket, name -> its slot in ``data``); a bucket of
        another layout at that position (after a rebuild) makes them again."""

    def slots(self, bucket: GradBucket) -> dict[str, torch.Tensor]:
        """Each of ``bucket``'s parameters' slot in this buffer, with the parameter's shape and
        strides (see ``GradBucket.slot_in``)."""
        made = self._slots.get(bucket.position)
        if made is None or made[0] is not bucket.spec:
            made = self._slots[bucket.position] = (bucket.spec, {n: bucket.slot_in(self.data, n) for n in bucket.names})
        return made[1]
