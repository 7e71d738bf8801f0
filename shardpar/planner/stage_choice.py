"""Choosing a stage: the lowest whose estimated memory fits a per-rank budget."""

from __future__ import annotations

from typing import Any

from ..sizes import format_both, parse_bytes
from .memory import estimate_memory
from .shapes import STAGES, ModelOrCount


def choose_stage(
    model_or_param_count: ModelOrCount, world_size: int, memory_budget: int | str, **kwargs: Any
) -> int:
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
