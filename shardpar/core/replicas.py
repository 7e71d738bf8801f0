"""Hybrid sharding's second reduction: a bucket's owned slice summed across the replica group.

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

from typing import Any

import torch

from ..comm import collectives as C
from .layout import Bucket


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
