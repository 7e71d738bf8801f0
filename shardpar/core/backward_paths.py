"""A gradient's path through a synchronising backward, one class per kind of stage: what
happens when a parameter's gradient arrives, when its bucket completes, and at the end.

[Note: a gradient's path through backward]
stages 0-2 (:class:`ReduceWhenComplete`):
    post-accumulate hook -> the reducer takes the gradient into its bucket -> a complete
    bucket launches its all-reduce or reduce-scatter in the agreed launch order.
stage 3 (:class:`ReshardThenReduce`, what FSDP2's per-group post-backward does):
    post-accumulate hook -> the reducer takes the gradient into its staging bucket -> a
    complete bucket is a group whose gradients are all final, so the gatherer frees the
    group's full parameters at once -> its reduce-scatter launches, once a gather of this
    backward has been checked across ranks ([Note: kept for backward] in gatherer.py: a rank
    that departed from the others' unit order must meet the mismatch before it posts any
    reduction). Buckets that complete before that wait, and launch with the first gradient
    that arrives after a gather was checked (or at the end of backward).
end of backward (both): buckets still collecting -- parameters this rank gave no gradient --
    complete with zeros (stage 3 frees their groups too), every bucket launches, and the
    reducer waits for all of them.

The reducer counts and launches; the gatherer gathers and frees; a path is the one place
that orders the two, so neither calls the other.
"""

from __future__ import annotations

from typing import Protocol, cast

from torch import nn

from .flat_param import FlatParamGroup
from .gatherer import UnitGatherer
from .reducer import GradientReducer


class BackwardPath(Protocol):
    """What the engine's gradient hook and its end-of-backward callback call."""

    def grad_ready(self, name: str, param: nn.Parameter) -> None: ...
    def finish_backward(self) -> None: ...


class ReduceWhenComplete:
    """Stages 0-2: see [Note: a gradient's path through backward]."""

    def __init__(self, reducer: GradientReducer) -> None:
        self.reducer = reducer

    def grad_ready(self, name: str, param: nn.Parameter) -> None:
        if self.reducer.on_grad_ready(name, param) is not None:
            self.reducer.launch_ready()

    def finish_backward(self) -> None:
        self.reducer.complete_missing()
        self.reducer.finish_backward()


class ReshardThenReduce:
    """Stage 3: see [Note: a gradient's path through backward]. ``gated``: reductions wait for
    a checked gather (with more than one rank; one rank cannot depart from the others' order)."""

    def __init__(self, reducer: GradientReducer, gatherer: UnitGatherer, gated: bool) -> None:
        self.reducer = reducer
        self.gatherer = gatherer
        self.gated = gated
        self._waiting = False
        """Some complete bucket has not been offered to the launch since it completed."""

    def grad_ready(self, name: str, param: nn.Parameter) -> None:
        bucket = self.reducer.on_grad_ready(name, param)
        if bucket is not None:
            # At stage 3 every bucketed parameter set is a flat parameter group (a bucket is one).
            self.gatherer.grads_final(cast(FlatParamGroup, bucket.space))
            # Asking completes the gathers in flight if none was checked yet; asking again
            # for every later gradient would wait for each prefetch as soon as it is issued.
            allowed = not self.gated or self.gatherer.may_reduce()
        else:
            allowed = self._waiting and self.gatherer.reductions_allowed()
        if allowed:
            self.reducer.launch_ready()
        waiting = not allowed and (self._waiting or bucket is not None)
        if waiting is not self._waiting:  # arrivals come here while a bucket waits, to offer it the launch
            self.reducer.pause_counting(waiting)
        self._waiting = waiting

    def finish_backward(self) -> None:
        if self.gated:
            self.gatherer.may_reduce()  # its answer does not matter now; what it completes first does
        for bucket in self.reducer.complete_missing():
            self.gatherer.grads_final(cast(FlatParamGroup, bucket.space))
        self._waiting = False
        self.reducer.finish_backward()
