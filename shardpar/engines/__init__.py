"""Engines: one class composed from the parts each stage's row of the table picks."""

from typing import Any

from torch import nn

from ..comm.sharding_groups import ShardingGroups
from ..config import ShardConfig
from ..core.deferred_init import DeferredInit
from .engine import WRAPPED_MARK, Engine, collect_cycles_before_exit
from .stages import STAGES, StageRow


def build_engine(
    module: nn.Module,
    config: ShardConfig,
    group: Any,
    deferred_init: DeferredInit | None = None,
    sharding: ShardingGroups | None = None,
) -> Engine:
    return Engine(module, config, group, STAGES[config.stage], deferred_init, sharding)


__all__ = ["Engine", "STAGES", "StageRow", "WRAPPED_MARK", "build_engine", "collect_cycles_before_exit"]
