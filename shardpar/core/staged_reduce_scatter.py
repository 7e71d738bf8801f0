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

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..comm import collectives as C
from .averaging import AcrossReplicas, ReduceDtype
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
    copies_each_gradient = True

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
        self._in_use: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor]] = {}
        """Bucket position -> its gradient slots in its staging buffer and this rank's slice of
        it (``StagingBuffer.slots`` and ``owned``), looked up by each gradient that arrives and
        by the reduction; as long as the bucket has its buffer (:meth:`_views_in_use`)."""
        self._staging_shapes: dict[int, tuple[Bucket, torch.dtype, int]] = {}
        """Bucket position -> (the layout bucket, its staging buffer's dtype and size)."""
        self._free: list[StagingBuffer] = []
        """Released staging buffers, each knowing the layout bucket it last served."""
        self._grad_shard_views: dict[int, tuple[Bucket, torch.Tensor, torch.Tensor]] = {}
        """Bucket position -> (the layout bucket, the gradient shard, the bucket's slice of it)."""
        self._accumulated: dict[BucketedParams, torch.Tensor] = {}  # no_sync, full size, reduce dtype
        self.peak_staging_bytes = 0
        self._staged_bytes = 0
        """Bytes of the staging buffers in use (``_staging``), kept as they come and go."""
        for space in spaces:
            for param in space.params.values():
                param.grad = None

    # ------------------------------------------------------------------ staging

    def _staging_for(self, bucket: GradBucket) -> StagingBuffer:
        staging = self._staging.get(bucket.position)
        if staging is None:
            shape = self._staging_shapes.get(bucket.position)
            if shape is None or shape[0] is not bucket.spec:
                shape = (bucket.spec, self.reduce_dtype(bucket.space), bucket.spec.range.size)
                self._staging_shapes[bucket.position] = shape
            _, dtype, numel = shape
            reuse = None  # a pooled buffer of this size, one that served this bucket first
            for i, pooled in enumerate(self._free):  # (a loop, not a sort: once per bucket per step)
                if pooled.data.dtype == dtype and pooled.data.numel() == numel:
                    if pooled.served is bucket.spec:
                        reuse = i
                        break
                    reuse = i if reuse is None else reuse
            if reuse is not None:
                staging = self._free.pop(reuse)
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
            self._staged_bytes += staging.nbytes
            self.peak_staging_bytes = max(self.peak_staging_bytes, self._staged_bytes)
        return staging

    def _views_in_use(self, bucket: GradBucket) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """``bucket``'s slots and this rank's slice in its staging buffer (made if need be),
        remembered until its reduction finishes."""
        in_use = self._in_use.get(bucket.position)
        if in_use is None:
            staging = self._staging_for(bucket)
            in_use = self._in_use[bucket.position] = (staging.slots(bucket), staging.owned(bucket, self.rank))
        return in_use

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
        in_use = self._in_use.get(bucket.position)
        if in_use is None:  # the bucket's first gradient of this backward
            in_use = self._views_in_use(bucket)
        slot = in_use[0][name]
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
        in_use = self._in_use.get(bucket.position)  # made by its first gradient
        if in_use is None:  # or else by fill_missing, which made the buffer only
            in_use = self._views_in_use(bucket)
        owned = in_use[1]
        staging = self._staging[bucket.position]
        before = self.averaging_of[bucket.space].before
        if before != 1.0:  # (averaging.scale, without its call: once per bucket per step)
            staging.data.mul_(before)
        return self.reduce_scatter(bucket, owned, staging.data)

    def finish(self, bucket: GradBucket) -> None:
        buffer = self._staging.pop(bucket.position)
        _, owned = self._in_use.pop(bucket.position)  # (start made it)
        self._staged_bytes -= buffer.nbytes
        if self.replicas is not None:
            self.sum_replicas(bucket, owned)
        made = self._grad_shard_views.get(bucket.position)  # its slice of the gradient shard, if made
        grad_shard = self.grad_shards[bucket.space]
        shard = (
            made[2]
            if made is not None and made[0] is bucket.spec and made[1] is grad_shard
            else self._grad_shard_of(bucket)
        )
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
            self._free.remove(_least_shared(self._free))

    def _grad_shard_of(self, bucket: GradBucket) -> torch.Tensor:
        """``bucket``'s slice of this rank's gradient shard, made and remembered in
        ``_grad_shard_views`` (once per layout bucket and gradient shard: a relayout replaces
        both), where :meth:`finish` looks it up."""
        grad_shard = self.grad_shards[bucket.space]
        view = bucket.space.layout.shard_of(bucket.spec, grad_shard)
        self._grad_shard_views[bucket.position] = (bucket.spec, grad_shard, view)
        return view

    def after_sync_backward(self, buckets: Sequence[GradBucket]) -> None:
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


def _least_shared(pool: list[StagingBuffer]) -> StagingBuffer:
    """The buffer to drop from a full pool: the oldest of the size that the fewest pooled
    buffers have. The pool keeps ``max_in_flight + 1`` buffers, what a backward of equal units
    keeps busy (two in flight, one collecting), and a bucket of another size (the head's, the
    last bucket's tail) is one more: dropping the oldest buffer would drop one of the common
    size every step, and its replacement would make its gradient slots again for every bucket
    it serves ([Note: the host's share of a step] in engines/hooks.py); a buffer of a rare
    size is made again for its few buckets."""
    sizes = Counter((buffer.data.dtype, buffer.data.numel()) for buffer in pool)
    return min(pool, key=lambda buffer: sizes[buffer.data.dtype, buffer.data.numel()])  # min: the oldest of ties


class StagingBuffer:
    """One bucket-sized staging buffer of the pool: its tensor (1-D, reduce dtype), the layout
    bucket it last served (whose padding it holds zeroed), and its gradient slots and this
    rank's slice for each bucket it served, made once: a gradient hook then copies into a view
    it looks up ([Note: the host's share of a step] in engines/hooks.py)."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data = data
        self.nbytes = data.numel() * data.element_size()
        self.served: Bucket | None = None
        self._slots: dict[int, tuple[Bucket, dict[str, torch.Tensor]]] = {}
        """Bucket position -> (the layout bucket, name -> its slot in ``data``); a bucket of
        another layout at that position (after a rebuild) makes them again."""
        self._owned: dict[int, tuple[Bucket, torch.Tensor]] = {}
        """Bucket position -> (the layout bucket, this rank's slice of ``data``), as ``_slots``."""

    def slots(self, bucket: GradBucket) -> dict[str, torch.Tensor]:
        """Each of ``bucket``'s parameters' slot in this buffer, with the parameter's shape and
        strides (see ``GradBucket.slot_in``)."""
        made = self._slots.get(bucket.position)
        if made is None or made[0] is not bucket.spec:
            made = self._slots[bucket.position] = (bucket.spec, {n: bucket.slot_in(self.data, n) for n in bucket.names})
        return made[1]

    def owned(self, bucket: GradBucket, rank: int) -> torch.Tensor:
        """``rank``'s slice of ``bucket`` in this buffer (its reduce-scatter's output)."""
        made = self._owned.get(bucket.position)
        if made is None or made[0] is not bucket.spec:
            made = self._owned[bucket.position] = (bucket.spec, bucket.spec.shard_in_bucket(rank).of(self.data))
        return made[1]
