"""Stages 1 and 2: reduce-scatter gradients into owned slices, all-gather parameters after
the step. Both reuse stage 0's buffers, buckets and hooks; they change only where reduced
gradients live and which collective moves them.

[Note: stage 1 accumulation across reductions]
Stage 1 reduce-scatters each bucket *in place*, so after backward the owned slice of the
full gradient buffer holds the averaged gradient while the rest of the buffer holds stale
local gradients -- no extra memory (DESIGN.md's ``8Ψ + 8Ψ/N``). ``param.grad`` of the
bucket's parameters is then released (it would show that mix; the optimizer reads the
owned slices). A later backward without ``zero_grad`` (accumulation across reductions, or
``no_sync`` after a reduced backward) therefore finds ``param.grad`` None; the first new
gradient of such a bucket moves the bucket's reduced slice to a carry shard and zeroes the
bucket before anything is added, and the next reduction adds the carry back. The carry
(``4Ψ/N``) exists only in that case and is freed by ``zero_grad``. Nothing happens at
forward, so a forward between backward and step (evaluation, logging) changes nothing.

[Note: averaging after the reduce-scatter]
Stage 0 divides the whole bucket by N before its all-reduce. Here only the owned 1/N of the
bucket is needed afterwards, so the division (and at stage 2 the copy into the gradient
shard) is done on that slice after the reduce-scatter: (N-1)/N of a pass over every bucket
saved. The exception is an fp16 reduce dtype, whose sum of N unscaled gradients could
overflow; it is still divided first.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ..comm import collectives as C
from ..core.layout import ShardPiece
from .base import TensorPiece
from .ddp import AllReduceEngine, FlatParams, GradBucket


class OptimizerShardEngine(AllReduceEngine):
    """Stage 1 (ZeRO-1): optimizer state for 1/N of the parameters on each rank."""

    stage = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._gather_handles: list[C.Handle] = []
        self._carry: dict[FlatParams, torch.Tensor] | None = None
        # Mixed precision: keep only this rank's shard of the master (1-D, local space).
        self.master_shards: dict[FlatParams, torch.Tensor] = {}
        for flat in self.flats:
            if flat.master is not None:
                self.master_shards[flat] = torch.cat([b.shard(self.rank).of(flat.master) for b in flat.layout.buckets])
                flat.master = None

    def allocate_grads(self) -> None:
        super().allocate_grads()
        # Reduced gradients in the master dtype exist only where the reduce dtype differs.
        self.master_grads = {}
        self.master_grad_shards = {
            flat: torch.zeros(flat.layout.shard_numel, dtype=flat.master_dtype, device=flat.device)
            for flat, grad in self.grad_data.items()
            if grad.dtype != flat.master_dtype
        }

    # ------------------------------------------------------------------ where reduced grads live

    def reduced_grad(self, bucket: GradBucket) -> torch.Tensor:
        """This rank's reduced gradient slice of ``bucket`` (1-D, shard_size)."""
        return bucket.spec.shard(self.rank).of(self.grad_data[bucket.flat])

    def piece_grad(self, flat: FlatParams, piece: ShardPiece) -> torch.Tensor:
        if flat in self.master_grad_shards:
            return piece.local_range.of(self.master_grad_shards[flat])
        return piece.buffer_range.of(self.grad_data[flat])

    def master_piece(self, flat: FlatParams, piece: ShardPiece) -> torch.Tensor:
        """The owned full-precision values of ``piece`` (1-D), which the optimizer updates."""
        if flat in self.master_shards:
            return piece.local_range.of(self.master_shards[flat])
        return piece.buffer_range.of(flat.data)

    # ------------------------------------------------------------------ collectives

    def divides_before_reduce(self, bucket: GradBucket) -> bool:
        """See [Note: averaging after the reduce-scatter]."""
        return self.grad_dtype(bucket.flat) == torch.float16

    def average_scale(self, bucket: GradBucket) -> float:
        """What the reduced (summed) slice is multiplied by to become the average."""
        return 1.0 if self.divides_before_reduce(bucket) else 1.0 / self.world_size

    def start_bucket_sync(self, bucket: GradBucket) -> C.Handle:
        data = bucket.spec.range.of(self.grad_data[bucket.flat])
        if self.divides_before_reduce(bucket):
            data.div_(self.world_size)
        return C.reduce_scatter(
            self.reduced_grad(bucket), data, group=self.group, async_op=True, stats=self.comm,
            padding_numel=bucket.spec.padding,
        )

    def finish_bucket_sync(self, bucket: GradBucket) -> None:
        flat = bucket.flat
        if not self.divides_before_reduce(bucket):
            self.reduced_grad(bucket).div_(self.world_size)
        if self._carry is not None:
            carried = flat.layout.shard_of(bucket.spec, self._carry[flat])
            self.reduced_grad(bucket).add_(carried)
            carried.zero_()
        if flat in self.master_grad_shards:
            flat.layout.shard_of(bucket.spec, self.master_grad_shards[flat]).copy_(self.reduced_grad(bucket))
        bucket.reduced = True
        for name in bucket.spec.names:  # see [Note: stage 1 accumulation across reductions]
            flat.params[name].grad = None

    def _carry_reduced(self, bucket: GradBucket) -> None:
        """See [Note: stage 1 accumulation across reductions]."""
        if self._carry is None:
            self._carry = {
                flat: torch.zeros(flat.layout.shard_numel, dtype=grad.dtype, device=flat.device)
                for flat, grad in self.grad_data.items()
            }
        bucket.flat.layout.shard_of(bucket.spec, self._carry[bucket.flat]).add_(self.reduced_grad(bucket))
        bucket.spec.range.of(self.grad_data[bucket.flat]).zero_()
        bucket.reduced = False

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        if bucket.reduced:
            self._carry_reduced(bucket)
        super().accept_grad(bucket, name, param)

    def fill_missing(self, bucket: GradBucket) -> None:
        if bucket.reduced:
            self._carry_reduced(bucket)
        super().fill_missing(bucket)

    def pre_forward(self) -> None:
        self.wait_for_params()
        self.broadcast_buffers()

    def clear_grads(self) -> None:
        # The buffers as at stage 0. Nothing reduced is zeroed: every reduction overwrites
        # master_grad_shards, and at stages 2-3 the first reduction of a bucket after this
        # (`bucket.reduced` False) overwrites its gradient-shard slice.
        super().clear_grads()
        for bucket in self.buckets:
            bucket.reduced = False
        self._carry = None

    # ------------------------------------------------------------------ optimizer

    def optimizer_tensors(self, names: Sequence[str]) -> list[TensorPiece]:
        wanted = set(names)
        tensors = {}
        for flat in self.flats:
            for piece in flat.layout.pieces(self.rank):
                if piece.name in wanted:
                    tensor = self.master_piece(flat, piece)
                    tensor.grad = self.piece_grad(flat, piece)
                    tensors[piece.name] = TensorPiece(
                        piece.name, tensor, (piece.param_range.start, piece.param_range.end)
                    )
        # Keep the user's order within the group; names this rank owns nothing of drop out.
        return [tensors[name] for name in names if name in tensors]

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        if self.master_grad_shards:
            return list(self.master_grad_shards.values()), True
        return [self.reduced_grad(bucket) for bucket in self.buckets], True

    def after_optimizer_step(self) -> None:
        """Every rank updated its slices; all-gather them back into the full parameters.

        All buckets are launched before any is waited on, so transfers pipeline; ``step()``
        returns with complete parameters because user code may read them right away (EMA,
        logging, saving)."""
        with torch.no_grad():
            for bucket in self.buckets:
                full = bucket.spec.range.of(bucket.flat.data)
                owned = bucket.spec.shard(self.rank).of(bucket.flat.data)
                if bucket.flat in self.master_shards:  # gathered in the (narrower) compute dtype
                    owned.copy_(bucket.flat.layout.shard_of(bucket.spec, self.master_shards[bucket.flat]))
                self._gather_handles.append(
                    C.all_gather(full, owned, group=self.group, async_op=True, stats=self.comm,
                                 padding_numel=bucket.spec.padding)
                )
        self.wait_for_params()

    def wait_for_params(self) -> None:
        for handle in self._gather_handles:
            handle.wait()
        self._gather_handles.clear()

    def load_pieces(self) -> list[TensorPiece]:
        """Own master pieces (then all-gathered by :meth:`after_load`) and full frozen params."""
        pieces = [
            TensorPiece(p.name, self.master_piece(flat, p), (p.param_range.start, p.param_range.end))
            for flat in self.flats
            for p in flat.layout.pieces(self.rank)
        ]
        return pieces + self.frozen_load_pieces()

    def _bytes(self, tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    def memory_stats(self) -> dict[str, int]:
        grads = list(self.grad_data.values()) + list(self.master_grad_shards.values())
        if self._carry is not None:
            grads += list(self._carry.values())
        return {
            "params": self._bytes([f.data for f in self.flats] + list(self.master_shards.values())) + self.frozen_bytes(),
            "grads": self._bytes(grads),
            "workspace": 0,
        }


class GradientShardEngine(OptimizerShardEngine):
    """Stage 2 (ZeRO-2): also keep only the owned gradient slice between backward and step.

    Full-size gradients exist only in per-bucket staging buffers while that bucket is being
    collected or reduced; at most ``max_buckets_in_flight`` reductions are outstanding.
    """

    stage = 2
    max_buckets_in_flight = 2

    def allocate_grads(self) -> None:
        self.grad_shards = {
            flat: torch.zeros(flat.layout.shard_numel, dtype=flat.master_dtype, device=flat.device)
            for flat in self.flats
        }  # 1-D, this rank's slice of every bucket, in bucket order (local space), master dtype
        self.grad_data = {}
        self.master_grads = {}
        self.master_grad_shards = {}
        self._staging: dict[int, torch.Tensor] = {}  # bucket position -> its full-size gradients
        # Released staging buffers kept for reuse; at most max_buckets_in_flight + 1 of them, so
        # what stays allocated between steps is bounded whatever the bucket sizes.
        self._free_staging: list[torch.Tensor] = []
        self.peak_staging_bytes = 0
        for _, param in self.trainable:
            param.grad = None

    def _staging_for(self, bucket: GradBucket) -> torch.Tensor:
        index = bucket.position
        staging = self._staging.get(index)
        if staging is None:
            dtype, numel = self.grad_dtype(bucket.flat), bucket.spec.range.size
            reusable = [i for i, t in enumerate(self._free_staging) if t.dtype == dtype and t.numel() == numel]
            if reusable:
                staging = self._free_staging.pop(reusable[0])
            else:
                staging = torch.empty(numel, dtype=dtype, device=bucket.flat.device)
            # Not zeroed as a whole: every slot is overwritten by its gradient or, if none
            # comes, zeroed by fill_missing; only the padding tail must be zero.
            staging[numel - bucket.spec.padding :].zero_()
            self._staging[index] = staging
            self.peak_staging_bytes = max(self.peak_staging_bytes, self._staging_bytes())
        return staging

    def _staging_bytes(self) -> int:
        return self._bytes(self._staging.values())

    def _staged_slot(self, bucket: GradBucket, name: str) -> torch.Tensor:
        slot = bucket.flat.layout.slots[name]
        local = slot.range.shift(-bucket.spec.range.start)  # bucket-relative
        return local.of(self._staging_for(bucket)).view(slot.shape)

    def _stage_param_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        self._staged_slot(bucket, name).copy_(param.grad)
        param.grad = None

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        self._stage_param_grad(bucket, name, param)

    def accumulate_without_sync(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        """Inside ``no_sync()`` autograd accumulates full gradients in ``param.grad``."""

    def fill_missing(self, bucket: GradBucket) -> None:
        for name in bucket.missing:
            param = bucket.flat.params[name]
            if param.grad is not None:  # accumulated under no_sync, unused in this backward
                self._stage_param_grad(bucket, name, param)
            else:  # zeros stand in for a gradient that never came
                self._staged_slot(bucket, name).zero_()

    def reduced_grad(self, bucket: GradBucket) -> torch.Tensor:
        return bucket.flat.layout.shard_of(bucket.spec, self.grad_shards[bucket.flat])

    def piece_grad(self, flat: FlatParams, piece: ShardPiece) -> torch.Tensor:
        return piece.local_range.of(self.grad_shards[flat])

    def start_bucket_sync(self, bucket: GradBucket) -> C.Handle:
        staging = self._staging_for(bucket)
        if self.divides_before_reduce(bucket):
            staging.div_(self.world_size)
        owned = bucket.spec.shard(self.rank).shift(-bucket.spec.range.start).of(staging)
        return C.reduce_scatter(
            owned, staging, group=self.group, async_op=True, stats=self.comm, padding_numel=bucket.spec.padding
        )

    def finish_bucket_sync(self, bucket: GradBucket) -> None:
        staging = self._staging.pop(bucket.position)
        owned = bucket.spec.shard(self.rank).shift(-bucket.spec.range.start).of(staging)
        shard, scale = self.reduced_grad(bucket), self.average_scale(bucket)
        if bucket.reduced:  # accumulating over a reduction since zero_grad
            shard.add_(owned, alpha=scale)
        elif shard.dtype == owned.dtype:
            torch.mul(owned, scale, out=shard)
        else:
            shard.copy_(owned).mul_(scale)
        bucket.reduced = True
        self._free_staging.append(staging)
        if len(self._free_staging) > self.max_buckets_in_flight + 1:
            self._free_staging.pop(0)

    def pre_forward(self) -> None:
        self.wait_for_params()
        self.broadcast_buffers()

    def memory_stats(self) -> dict[str, int]:
        return {
            "params": self._bytes([f.data for f in self.flats] + list(self.master_shards.values())) + self.frozen_bytes(),
            # + full gradients accumulated in param.grad under no_sync() (the price of accumulation)
            "grads": self._bytes(self.grad_shards.values())
            + self._bytes(p.grad for _, p in self.trainable if p.grad is not None),
            "workspace": self._staging_bytes() + self._bytes(self._free_staging),
            "peak_staging": self.peak_staging_bytes,
        }
