"""How a gradient sum over N ranks becomes DDP's mean: the factors each strategy applies
around its collective.

[Note: averaging]
Every strategy turns the sum over N ranks into DDP's mean, with as few passes as it can
(:func:`averaging` picks the factors, once per parameter space):

- A backend that averages inside the collective (NCCL's ``ReduceOp.AVG``) does it all: no
  pass of ours.
- Otherwise (gloo) stage 0 divides the whole bucket before its all-reduce, and stages 1-3
  divide only the owned 1/N after the reduce-scatter ((N-1)/N of a pass saved).
- An fp16 reduce dtype is split around the sum, on every backend: the bucket is divided by
  the power of two at or above √N before (exact), and by the rest of N after. Dividing by N
  first would flush gradients below N times fp16's smallest subnormal to zero; dividing
  after would let a sum of N large gradients overflow. The split halves the exponent range
  each side gives up (N = 4: ÷2, sum, ÷2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..comm import collectives as C
from .reducer import ParamSpace


ReduceDtype = Callable[[ParamSpace], torch.dtype]


@dataclass(frozen=True)
class Averaging:
    """How one bucket's sum over N ranks becomes the mean; see [Note: averaging]."""

    before: float = 1.0
    """Factor applied to the bucket before the collective (1.0: no pass)."""
    after: float = 1.0
    """Factor applied to the result after it (1.0: no pass)."""
    op: str = "sum"
    """The collective's reduction: ``avg`` where the backend divides by N itself."""


def averaging(dtype: torch.dtype, world_size: int, backend_averages: bool, divide_before: bool) -> Averaging:
    """See [Note: averaging]; ``divide_before``: the result is the whole bucket (all-reduce),
    so dividing before costs no more than after."""
    if world_size == 1:
        return Averaging()
    if dtype == torch.float16:
        before = 2.0 ** math.ceil(math.log2(math.sqrt(world_size)))
        return Averaging(before=1.0 / before, after=before / world_size)
    if backend_averages:
        return Averaging(op="avg")
    return Averaging(before=1.0 / world_size) if divide_before else Averaging(after=1.0 / world_size)


def averaging_per_space(spaces: Sequence[ParamSpace], reduce_dtype: ReduceDtype, world_size: int, group,
                        divide_before: bool) -> dict[ParamSpace, Averaging]:
    """:func:`averaging` of each space, decided once: the backend and dtypes never change."""
    backend = C.backend_averages(group, spaces[0].device if spaces else None)
    return {s: averaging(reduce_dtype(s), world_size, backend, divide_before) for s in spaces}


def scale(tensor: torch.Tensor, factor: float) -> None:
    """Apply one of :class:`Averaging`'s factors in place (1.0: no pass)."""
    if factor != 1.0:
        tensor.mul_(factor)
