"""The sharded optimizer facade and fp16 loss scaling."""

from .grad_scaler import GradScaler
from .sharded import ShardedOptimizer, optimizer

__all__ = ["GradScaler", "ShardedOptimizer", "optimizer"]
