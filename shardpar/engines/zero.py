"""Stages 1 and 2: reduce-scatter gradients into owned slices, all-gather parameters after
the step. Both reuse stage 0's buffers, buckets and hooks; they change only where reduced
gradients live and which collective moves them.

[Note: stage 1 accumulation across reductions]
Stage 1 reduce-scatters each bucket *in place*, so after backward the owned slice of the
full gradient buffer holds the averaged gradient while the rest of the buffer holds stale
local gradients -- no extra memory (DESIGN.md's ``8Ψ + 8Ψ/N``). A second backward without
``zero_grad`` (accumulation across reductions, or ``no_sync`` after a reduced backward)
would mix the two, so the next forward first moves the reduced owned slices to a carry
shard and zeroes the buffer; the reduction after that adds the carry back. The carry
(``4Ψ/N``) exists only in that case and is freed by ``zero_grad``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .. import collectives as C
from ..buffer import ShardPiece
from .base import TensorPiece
from .ddp import AllReduceEngine, FlatParams, GradBucket


class OptimizerShardEngine(AllReduceEngine):
    """Stage 1 (ZeRO-1): optimizer state for 1/N of the parameters on each rank."""

    stage = 1

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._gather_handles: list[C.Handle] = []
        self._holds_reduced = False
        self._carry: dict[FlatParams, torch.Tensor] | None = None

    # ------------------------------------------------------------------ where reduced grads live

    def reduced_grad(self, bucket: GradBucket) -> torch.Tensor:
        """This rank's reduced gradient slice of ``bucket`` (1-D, shard_size)."""
        return bucket.spec.shard(self.rank).of(self.grad_data[bucket.flat])

    def piece_grad(self, flat: FlatParams, piece: ShardPiece) -> torch.Tensor:
        return piece.buffer_range.of(self.grad_data[flat])

    def piece_param(self, flat: FlatParams, piece: ShardPiece) -> torch.Tensor:
        """The owned parameter values of ``piece`` (1-D), which the optimizer updates."""
        return piece.buffer_range.of(flat.data)

    # ------------------------------------------------------------------ collectives

    def start_bucket_sync(self, bucket: GradBucket) -> C.Handle:
        data = bucket.spec.range.of(self.grad_data[bucket.flat])
        data.div_(self.world_size)
        return C.reduce_scatter(
            self.reduced_grad(bucket), data, group=self.group, async_op=True, stats=self.comm,
            padding_numel=bucket.spec.padding,
        )

    def finish_bucket_sync(self, bucket: GradBucket) -> None:
        if self._carry is not None:
            self.reduced_grad(bucket).add_(bucket.flat.layout.shard_of(bucket.spec, self._carry[bucket.flat]))
        self._holds_reduced = True

    def pre_forward(self) -> None:
        self.wait_for_params()
        self.broadcast_buffers()
        if self._holds_reduced and torch.is_grad_enabled():
            self._move_reduced_to_carry()

    def _move_reduced_to_carry(self) -> None:
        """See [Note: stage 1 accumulation across reductions]."""
        with torch.no_grad():
            if self._carry is None:
                self._carry = {flat: torch.zeros(flat.layout.shard_numel, dtype=flat.dtype, device=flat.device) for flat in self.flats}
            for bucket in self.buckets:
                bucket.flat.layout.shard_of(bucket.spec, self._carry[bucket.flat]).add_(self.reduced_grad(bucket))
            for grad in self.grad_data.values():
                grad.zero_()
        self._holds_reduced = False

    def zero_grad(self) -> None:
        super().zero_grad()
        self._carry = None
        self._holds_reduced = False

    # ------------------------------------------------------------------ optimizer

    def optimizer_tensors(self, names: Sequence[str]) -> list[TensorPiece]:
        wanted = set(names)
        tensors = {}
        for flat in self.flats:
            for piece in flat.layout.pieces(self.rank):
                if piece.name in wanted:
                    tensor = self.piece_param(flat, piece)
                    tensor.grad = self.piece_grad(flat, piece)
                    tensors[piece.name] = TensorPiece(
                        piece.name, tensor, (piece.param_range.start, piece.param_range.end)
                    )
        # Keep the user's order within the group; names this rank owns nothing of drop out.
        return [tensors[name] for name in names if name in tensors]

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
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
                self._gather_handles.append(
                    C.all_gather(full, owned, group=self.group, async_op=True, stats=self.comm,
                                 padding_numel=bucket.spec.padding)
                )
        self.wait_for_params()

    def wait_for_params(self) -> None:
        for handle in self._gather_handles:
            handle.wait()
        self._gather_handles.clear()

    def memory_stats(self) -> dict[str, int]:
        stats = super().memory_stats()
        if self._carry is not None:
            stats["grads"] += sum(c.numel() * c.element_size() for c in self._carry.values())
        return stats


class GradientShardEngine(OptimizerShardEngine):
    """Stage 2 (ZeRO-2): also keep only the owned gradient slice between backward and step.

    Full-size gradients exist only in per-bucket staging buffers while that bucket is being
    collected or reduced; at most ``max_buckets_in_flight`` reductions are outstanding.
    """

    stage = 2
    max_buckets_in_flight = 2

    def allocate_grads(self) -> None:
        self.grad_shards = {
            flat: torch.zeros(flat.layout.shard_numel, dtype=flat.dtype, device=flat.device) for flat in self.flats
        }  # 1-D, this rank's slice of every bucket, in bucket order (local space)
        self._staging: dict[int, torch.Tensor] = {}  # bucket position -> full-size gradients
        self._free_staging: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.peak_staging_bytes = 0
        for _, param in self.trainable:
            param.grad = None

    def _staging_for(self, bucket: GradBucket) -> torch.Tensor:
        index = bucket.position
        staging = self._staging.get(index)
        if staging is None:
            free = self._free_staging.get((bucket.spec.range.size, bucket.flat.dtype))
            staging = free.pop().zero_() if free else torch.zeros(
                bucket.spec.range.size, dtype=bucket.flat.dtype, device=bucket.flat.device
            )
            self._staging[index] = staging
            self.peak_staging_bytes = max(self.peak_staging_bytes, self._staging_bytes())
        return staging

    def _staging_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self._staging.values())

    def _stage_param_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        slot = bucket.flat.layout.slots[name]
        local = slot.range.shift(-bucket.spec.range.start)  # bucket-relative
        local.of(self._staging_for(bucket)).view(slot.shape).copy_(param.grad)
        param.grad = None

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        self._stage_param_grad(bucket, name, param)

    def accumulate_without_sync(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        """Inside ``no_sync()`` autograd accumulates full gradients in ``param.grad``."""

    def fill_missing(self, bucket: GradBucket) -> None:
        self._staging_for(bucket)  # zeros stand in for gradients that never came
        for name in bucket.missing:
            param = bucket.flat.params[name]
            if param.grad is not None:  # accumulated under no_sync, unused in this backward
                self._stage_param_grad(bucket, name, param)

    def reduced_grad(self, bucket: GradBucket) -> torch.Tensor:
        return bucket.flat.layout.shard_of(bucket.spec, self.grad_shards[bucket.flat])

    def piece_grad(self, flat: FlatParams, piece: ShardPiece) -> torch.Tensor:
        return piece.local_range.of(self.grad_shards[flat])

    def start_bucket_sync(self, bucket: GradBucket) -> C.Handle:
        staging = self._staging_for(bucket)
        staging.div_(self.world_size)
        owned = bucket.spec.shard(self.rank).shift(-bucket.spec.range.start).of(staging)
        return C.reduce_scatter(
            owned, staging, group=self.group, async_op=True, stats=self.comm, padding_numel=bucket.spec.padding
        )

    def finish_bucket_sync(self, bucket: GradBucket) -> None:
        staging = self._staging.pop(bucket.position)
        owned = bucket.spec.shard(self.rank).shift(-bucket.spec.range.start).of(staging)
        self.reduced_grad(bucket).add_(owned)
        self._free_staging.setdefault((staging.numel(), staging.dtype), []).append(staging)

    def pre_forward(self) -> None:
        self.wait_for_params()
        self.broadcast_buffers()

    def zero_grad(self) -> None:
        for shard in self.grad_shards.values():
            shard.zero_()
        for _, param in self.trainable:
            param.grad = None

    def memory_stats(self) -> dict[str, int]:
        return {
            "params": sum(f.data.numel() * f.data.element_size() for f in self.flats),
            "grads": sum(s.numel() * s.element_size() for s in self.grad_shards.values()),
            "workspace": self._staging_bytes()
            + sum(s.numel() * s.element_size() for free in self._free_staging.values() for s in free),
            "peak_staging": self.peak_staging_bytes,
        }
