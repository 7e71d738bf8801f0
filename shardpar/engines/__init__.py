"""Engines: one class composed from the parts each stage's row of the table picks."""

from .engine import WRAPPED_MARK, Engine
from .lifetime import collect_cycles_before_exit
from .stages import STAGES, StageRow


def build_engine(module, config, group, deferred_init=None, sharding=None) -> Engine:
    return Engine(module, config, group, STAGES[config.stage], deferred_init, sharding)


__all__ = ["Engine", "STAGES", "StageRow", "WRAPPED_MARK", "build_engine", "collect_cycles_before_exit"]
