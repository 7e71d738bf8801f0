"""Choosing a stage: the lowest whose estimated memory fits a per-rank budget
(:func:`choose_stage`), or on many nodes a stage and a shard group size (:func:`choose_plan`).

[Note: choosing a plan]
A plan is a stage and, at stages 1-3, a shard group size G ([Note: sharding groups] in
comm/sharding_groups.py). Which G are worth planning: shard groups inside a node (G dividing
the node size) keep the gathers and reduce-scatters, 2-3Ψ per step, on the node's links, and
send only the all-reduce of each owned shard, 2(Ψ/G)·(R-1)/R, across nodes; when the model
does not fit sharded over one node, whole nodes (G a multiple of the node size, up to G = N,
full sharding) trade cross-node bytes for memory. Other divisors would split shard groups
across nodes without saving memory over the next multiple. G = 1 is left out (on more than
one rank): it shards nothing and moves what stage 0 moves.

Among the plans whose memory estimate fits the budget, the pick sends the fewest bytes on
groups that span nodes (``CommEstimate.sent_across_nodes``: the slow links), then the fewest
bytes in all, then has the lowest stage (fewer collectives, less to go wrong), then the largest
G (less memory per rank for the same traffic). Bytes are the ring model's payload
([Note: communication model] in communication.py); the padding is left out of the comparison,
since it differs between G by a few elements per bucket and would break the ties the closed
forms make exact (stages 0-2 send 2Ψ·b·(N-1)/N at every G when parameters and gradients have
the same dtype). The reason string says what fits, what it sends, and what came next.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from ..sizes import format_both, format_bytes, parse_bytes
from .communication import CommEstimate, estimate_communication
from .memory import MemoryEstimate, estimate_memory
from .shapes import STAGES, ModelOrCount


def choose_stage(model_or_param_count: ModelOrCount, world_size: int, memory_budget: int | str, **kwargs: Any) -> int:
    """The lowest stage whose estimated ``total`` fits ``memory_budget`` bytes per rank.

    ``memory_budget`` is an int of bytes or a string such as ``"24GB"`` (decimal) or
    ``"512MiB"`` (binary); ``kwargs`` go to :func:`estimate_memory`. Lower stages move
    fewer bytes per step, so the lowest that fits is the fastest. Raises ValueError naming
    the budget and the smallest requirement when no stage fits.
    """
    if memory_budget is None:
        raise ValueError("stage='auto' needs memory_budget (bytes per rank, e.g. '24GB')")
    budget = parse_bytes(memory_budget)
    estimates = [estimate_memory(model_or_param_count, world_size, s, **kwargs) for s in STAGES]
    for estimate in estimates:
        if estimate.total <= budget:
            return estimate.stage
    smallest = min(estimates, key=lambda e: e.total)
    raise ValueError(
        f"no stage fits the memory budget of {format_both(budget)} per rank at world size "
        f"{world_size}: the smallest estimate is {format_both(smallest.total)} (stage "
        f"{smallest.stage}); add ranks, raise the budget"
        + (" or use mixed_precision='bf16'" if kwargs.get("mixed_precision") is None else "")
    )


# --------------------------------------------------------------------------- stage and shard group size

_COMM_OPTIONS = ("bucket_cap_mb", "wrap_policy", "min_unit_params", "align_for_bandwidth", "whole_tensors")
"""Options of :func:`estimate_memory` that :func:`estimate_communication` takes too."""


@dataclass(frozen=True)
class StagePlan:
    """What ``stage="auto"`` picks on many nodes: a stage and a shard group size, and why
    (see [Note: choosing a plan])."""

    stage: int
    shard_group_size: int | None
    """G to pass to ``wrap`` (the world size for full sharding); None at stage 0, which shards nothing."""
    reason: str
    memory: MemoryEstimate
    communication: CommEstimate
    bytes_across_nodes: float
    """Payload bytes a rank sends per step on groups that span nodes."""


def shard_group_candidates(world_size: int, node_size: int) -> list[int]:
    """The shard group sizes worth planning for (see [Note: choosing a plan]): divisors G > 1
    of the world size that divide the node size (a shard group inside a node) or are
    multiples of it (whole nodes); [1] on one rank."""
    if world_size == 1:
        return [1]
    return [g for g in range(2, world_size + 1) if world_size % g == 0 and (node_size % g == 0 or g % node_size == 0)]


def choose_plan(
    model_or_param_count: ModelOrCount,
    world_size: int,
    memory_budget: int | str,
    *,
    node_size: int | None = None,
    shard_group_sizes: Iterable[int] | None = None,
    **kwargs: Any,
) -> StagePlan:
    """The stage and shard group size for ``memory_budget`` bytes per rank: among the plans
    whose estimated ``total`` fits, the one that sends the fewest bytes across nodes, then the
    fewest in all, then the lowest stage, then the largest G ([Note: choosing a plan]).

    ``node_size``: ranks per node (None: ``LOCAL_WORLD_SIZE``, else one node of
    ``world_size``). ``shard_group_sizes``: the G to consider at stages 1-3 (None:
    :func:`shard_group_candidates`). ``kwargs`` go to :func:`estimate_memory`
    (``bucket_cap_mb``, ``wrap_policy``, ``min_unit_params`` and ``align_for_bandwidth`` to
    :func:`estimate_communication` too, with the reduce and gather dtypes the memory estimate
    read from ``mixed_precision``; ``reshard_after_forward`` to it alone). Raises ValueError
    naming the budget and the smallest requirement when no plan fits.
    """
    if memory_budget is None:
        raise ValueError("stage='auto' needs memory_budget (bytes per rank, e.g. '24GB')")
    budget = parse_bytes(memory_budget)
    node_size = _node_size(node_size, world_size)
    reshard_after_forward = kwargs.pop("reshard_after_forward", True)
    sizes = (
        sorted(set(shard_group_sizes))
        if shard_group_sizes is not None
        else shard_group_candidates(world_size, node_size)
    )
    plans = [_plan(model_or_param_count, world_size, 0, None, node_size, reshard_after_forward, kwargs)]
    plans += [
        _plan(model_or_param_count, world_size, stage, g, node_size, reshard_after_forward, kwargs)
        for stage in STAGES[1:]
        for g in sizes
    ]
    fitting = [p for p in plans if p.memory.total <= budget]
    if not fitting:
        smallest = min(plans, key=lambda p: p.memory.total)
        what = "stage" if set(sizes) <= {1, world_size} else "plan (stage, shard group size)"  # no hybrid considered
        raise ValueError(
            f"no {what} fits the memory budget of {format_both(budget)} per rank at "
            f"world size {world_size}: the smallest estimate is {format_both(smallest.memory.total)} "
            f"({_describe(smallest, node_size)}); add ranks, raise the budget"
            + (" or use mixed_precision='bf16'" if kwargs.get("mixed_precision") is None else "")
        )
    ranked = sorted(fitting, key=functools.cmp_to_key(_compare))
    best = ranked[0]
    return replace(best, reason=_reason(best, ranked[1:], len(plans), budget, world_size, node_size))


def _node_size(node_size: int | None, world_size: int) -> int:
    if node_size is None:
        node_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be a positive int (ranks per node), got {node_size!r}")
    if world_size > node_size and world_size % node_size:
        raise ValueError(
            f"the world size {world_size} is not a multiple of node_size={node_size}: "
            "every node must run the same number of ranks"
        )
    return min(node_size, world_size)


def _plan(
    model: ModelOrCount,
    world_size: int,
    stage: int,
    shard_size: int | None,
    node_size: int,
    reshard_after_forward: bool,
    kwargs: dict[str, Any],
) -> StagePlan:
    memory = estimate_memory(model, world_size, stage, shard_group_size=shard_size, **kwargs)
    mp = memory.mixed_precision
    comm = estimate_communication(
        model,
        world_size,
        stage,
        reduce_bytes=memory.reduce_bytes,
        gather_bytes=memory.param_bytes if mp else None,
        reshard_after_forward=reshard_after_forward,
        buffer_dtype=mp.buffer_dtype if mp else None,
        shard_group_size=shard_size,
        **{k: v for k, v in kwargs.items() if k in _COMM_OPTIONS},
    )
    return StagePlan(stage, shard_size, "", memory, comm, comm.sent_across_nodes(node_size))


def _compare(a: StagePlan, b: StagePlan) -> int:
    """Fewer bytes across nodes, then fewer in all (payload: padding is a few elements per
    bucket, and would break ties that the closed forms make exact), then the lower stage,
    then the larger G (less memory per rank, no larger traffic)."""
    for x, y in (
        (a.bytes_across_nodes, b.bytes_across_nodes),
        (a.communication.sent_bytes, b.communication.sent_bytes),
    ):
        if not _close(x, y):
            return -1 if x < y else 1
    return (a.stage - b.stage) or ((b.shard_group_size or 0) - (a.shard_group_size or 0))


def _describe(plan: StagePlan, node_size: int) -> str:
    n, g = plan.communication.world_size, plan.shard_group_size
    if plan.stage == 0:
        return "stage 0 (replicated, nothing sharded)"
    assert g is not None  # None only at stage 0
    if g == n:
        return f"stage {plan.stage}, full sharding over {n} ranks"
    where = "within a node" if g <= node_size else f"spanning {g // node_size} nodes"
    return f"stage {plan.stage}, shard groups of {g} ranks ({where}) replicated {n // g} times"


def _reason(
    best: StagePlan, others: list[StagePlan], planned: int, budget: int, world_size: int, node_size: int
) -> str:
    gb = functools.partial(format_bytes, binary=False)
    fits = f"the only one of {planned} plans that fits" if not others else f"{len(others) + 1} of {planned} plans fit"
    text = (
        f"{_describe(best, node_size)}: {gb(best.memory.total)} per rank fits the budget of "
        f"{format_both(budget)}; {fits}; "
    )
    total = best.communication.sent_bytes
    several_nodes = world_size > node_size
    if several_nodes:
        text += f"it sends {gb(best.bytes_across_nodes)} per step across nodes ({gb(total)} in all)"
    else:
        text += f"one node, so no bytes cross nodes; it sends {gb(total)} per step"
    if not others:
        return text
    nxt = others[0]
    if several_nodes and not _close(nxt.bytes_across_nodes, best.bytes_across_nodes):
        return text + (
            f", the fewest across nodes; next: {_describe(nxt, node_size)} sends "
            f"{gb(nxt.bytes_across_nodes)} across nodes"
        )
    if not _close(nxt.communication.sent_bytes, total):
        tied = " as few across nodes but" if several_nodes else ""
        return text + (
            f", the fewest; next: {_describe(nxt, node_size)} sends{tied} {gb(nxt.communication.sent_bytes)} in all"
        )
    if nxt.stage != best.stage:
        return text + f"; {_describe(nxt, node_size)} sends as many bytes at a higher stage"
    return text + f"; {_describe(nxt, node_size)} sends as many bytes with smaller shard groups (more memory per rank)"


def _close(x: float, y: float) -> bool:
    """Equal bytes, but for the rounding of sums the closed forms make exact."""
    return math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-3)
