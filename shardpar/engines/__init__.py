"""One engine per stage; each stage extends the one below (see DESIGN.md, layer 3)."""

from .base import Engine
from .ddp import AllReduceEngine
from .zero import GradientShardEngine, OptimizerShardEngine
from .zero3 import ParameterShardEngine

ENGINES: dict[int, type[Engine]] = {
    0: AllReduceEngine,
    1: OptimizerShardEngine,
    2: GradientShardEngine,
    3: ParameterShardEngine,
}

__all__ = ["ENGINES", "Engine", "AllReduceEngine", "OptimizerShardEngine", "GradientShardEngine", "ParameterShardEngine"]
