"""The memory planner and communication model: what one rank holds and sends at each stage.

``estimate_memory`` predicts the bytes of model state per rank (parameters, gradients,
optimizer state, workspace), ``choose_stage`` picks the lowest stage that fits a per-rank
budget, ``choose_plan`` a stage and a shard group size (hybrid sharding) for many nodes, and
``estimate_communication`` predicts the bytes each rank sends per step and, given a
bandwidth and latency, the seconds that takes. All are *models*: closed
forms of what the engines store and move, checked against the engines' own reports in
``tests/test_planner.py``; ``docs/planner.md`` explains how to use them.

By job: ``shapes.py`` (the model as the engines would lay it out), ``memory.py``
([Note: storage model]), ``communication.py`` ([Note: communication model]) and
``stage_choice.py``.
"""

from ..sizes import format_both, format_bytes, parse_bytes, parse_count
from .communication import CommEstimate, estimate_communication
from .memory import OPTIMIZER_STATE_BYTES, MemoryEstimate, estimate_memory
from .stage_choice import StagePlan, choose_plan, choose_stage, shard_group_candidates

__all__ = [
    "CommEstimate",
    "MemoryEstimate",
    "OPTIMIZER_STATE_BYTES",
    "StagePlan",
    "choose_plan",
    "choose_stage",
    "estimate_communication",
    "estimate_memory",
    "format_both",
    "format_bytes",
    "parse_bytes",
    "parse_count",
    "shard_group_candidates",
]
