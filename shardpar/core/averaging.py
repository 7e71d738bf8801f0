"""How a gradient sum over N ranks becomes DDP's mean, or the sum divided by another factor:
the factors each strategy applies around its collective, and under hybrid sharding the second
reduction, across replicas, that completes the sum over all N ranks.

[Note: averaging]
Every strategy turns the sum over N ranks into the sum divided by a factor F -- N by
default, DDP's mean; whatever ``gradient_divide_factor`` says otherwise (1.0: the plain sum,
as torchtitan reduces after normalising its loss by the global token count) -- with as few
passes as it can (:func:`averaging` picks the factors, once per bucketed parameter set):

- F = 1 needs no pass at all: the collective's sum is the result (world size 1 included).
- A backend that averages inside the collective (NCCL's ``ReduceOp.AVG``) does it all when
  F = N: no pass of ours. For any other F it sums, and the factor is applied as on gloo
  (one pass; NCCL's ``PREMUL_SUM`` could fold it into the collective, not used yet).
- Otherwise (gloo) stage 0 divides the whole bucket by F before its all-reduce, and stages
  1-3 divide only the owned 1/N after the reduce-scatter ((N-1)/N of a pass saved).
- An fp16 reduce dtype is split around the sum, on every backend: the bucket is divided by
  the power of two at or above √F (never above F) before (exact), and by the rest of F
  after. Dividing by F first would flush gradients below F times fp16's smallest subnormal
  to zero; dividing after would let a sum of large gradients overflow. The split halves the
  exponent range each side gives up (F = N = 4: ÷2, sum, ÷2). It is taken around F, not N,
  as FSDP2 does: for F = 1 the sum is the result asked for, so nothing is divided before
  it, and below F = 2 nothing either (F < 1 multiplies, after the sum).

Under hybrid sharding the pair of collectives (reduce-scatter within the shard group, then
all-reduce across replicas) sums over all N ranks, so the same factors, applied around the
pair, divide by exactly F ([Note: reduction under hybrid sharding], below). Every
option changes only the scaling passes: the collectives, their bytes and their counts are
the same for every F (``comm_stats()`` is unchanged).

[Note: reduction under hybrid sharding]
With shard groups of G ranks replicated R = N/G times ([Note: sharding groups] in
comm/sharding_groups.py), a bucket's gradients are reduce-scattered within the shard group
(each rank gets the sum over its G ranks of its slice, Ψ/G of the bucket), then that slice
is all-reduced across the replica group, the R ranks holding the same slice: every rank ends
with the sum over all N ranks of the slice it owns, and the cross-replica links carry Ψ/G
elements per step instead of Ψ. The mean follows [Note: averaging] over N: where the backend
averages (NCCL), both collectives average (over G, then over R); otherwise the factors of N
apply around the pair. A ``gradient_divide_factor`` F other than N always takes the second
way: both collectives sum and F's factors apply around the pair, once, so the result is the
sum over all N ranks divided by exactly F (never F per group). The all-reduce starts once the reduce-scatter is waited for (on CUDA
that wait orders streams and does not block the host). Padding is counted exactly: the gaps
of the bucket that fall in this rank's slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import collectives as C
from .layout import Bucket
from .reducer import BucketedParams

ReduceDtype = Callable[[BucketedParams], torch.dtype]


@dataclass(frozen=True)
class Averaging:
    """How one bucket's sum over N ranks becomes the mean (or the sum divided by another
    factor); see [Note: averaging]."""

    before: float = 1.0
    """Factor applied to the bucket before the collective (1.0: no pass)."""
    after: float = 1.0
    """Factor applied to the result after it (1.0: no pass)."""
    op: str = "sum"
    """The collective's reduction: ``avg`` where the backend divides by N itself and N is
    the factor asked for."""


def averaging(
    dtype: torch.dtype, world_size: int, backend_averages: bool, divide_before: bool, divide_factor: float | None = None
) -> Averaging:
    """See [Note: averaging]; ``divide_before``: the result is the whole bucket (all-reduce),
    so dividing before costs no more than after. ``divide_factor``: what the sum over the
    ``world_size`` ranks is divided by (None: ``world_size``, the mean)."""
    factor = float(world_size) if divide_factor is None else divide_factor
    if factor == 1.0:
        return Averaging()
    if dtype == torch.float16:
        # Never more than F itself (1 < F < 2 would otherwise divide by 2 and multiply after).
        before = 2.0 ** max(0, min(math.ceil(math.log2(math.sqrt(factor))), math.floor(math.log2(factor))))
        return Averaging(before=1.0 / before, after=before / factor)
    if backend_averages and factor == world_size:
        return Averaging(op="avg")
    return Averaging(before=1.0 / factor) if divide_before else Averaging(after=1.0 / factor)


def averaging_per_space(
    spaces: Sequence[BucketedParams],
    reduce_dtype: ReduceDtype,
    world_size: int,
    group: Any,
    divide_before: bool,
    divide_factor: float | None = None,
) -> dict[BucketedParams, Averaging]:
    """:func:`averaging` of each space, decided once: the backend, dtypes and factor never change."""
    backend = C.backend_averages(group, spaces[0].device if spaces else None)
    return {s: averaging(reduce_dtype(s), world_size, backend, divide_before, divide_factor) for s in spaces}


def scale(tensor: torch.Tensor, factor: float) -> None:
    """Apply one of :class:`Averaging`'s factors in place (1.0: no pass)."""
    if factor != 1.0:
        tensor.mul_(factor)


class AcrossReplicas:
    """The replica group's all-reduce of owned slices; see [Note: reduction under hybrid sharding]."""

    def __init__(self, group: Any, shard_rank: int, comm: C.CommStats) -> None:
        self.group = group
        self.shard_rank = shard_rank
        self.comm = comm
        self._padding: dict[int, tuple[Bucket, int]] = {}
        """id(spec) -> (spec, its padding in this rank's slice): counted once per bucket
        layout, not per step (an aligned layout has a gap in front of every tensor)."""

    def padding_in_slice(self, spec: Bucket) -> int:
        """Elements of ``spec``'s padding inside this rank's slice of it."""
        known = self._padding.get(id(spec))
        if known is None or known[0] is not spec:
            owned = spec.shard(self.shard_rank)
            count = sum(part.size for gap in spec.gaps if (part := gap.intersect(owned)) is not None)
            known = self._padding[id(spec)] = (spec, count)
        return known[1]

    def sum_(self, owned: torch.Tensor, spec: Bucket, op: str) -> None:
        """Sum (or average, ``op="avg"``) ``owned`` -- this rank's slice of ``spec`` after its
        reduce-scatter -- over the replica group, in place."""
        C.all_reduce(
            owned, group=self.group, async_op=True, op=op, stats=self.comm, padding_numel=self.padding_in_slice(spec)
        ).wait()
