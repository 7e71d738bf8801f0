"""shardpar: sharding-aware data-parallel training for PyTorch.

``model = shardpar.wrap(model, stage=0..3)`` trains one model on every rank of a torchrun
job: stage 0 is DDP, stages 1-3 are ZeRO (optimizer state, gradients, parameters sharded).
"""

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_full
from .checkpoint.pretrained import load_pretrained
from .config import MixedPrecision, ShardConfig
from .errors import CheckpointError, RanksOutOfStep, ShardedGradError, UnitOrderMismatch
from .facade import ShardedModule, register_forward_method
from .optim import GradScaler, ShardedOptimizer, optimizer
from .planner import CommEstimate, MemoryEstimate, choose_stage, estimate_communication, estimate_memory
from .version import __version__
from .wrap import wrap

__all__ = [
    "GradScaler",
    "CommEstimate",
    "MemoryEstimate",
    "choose_stage",
    "estimate_communication",
    "estimate_memory",
    "CheckpointError",
    "RanksOutOfStep",
    "ShardedGradError",
    "UnitOrderMismatch",
    "MixedPrecision",
    "ShardConfig",
    "ShardedModule",
    "register_forward_method",
    "ShardedOptimizer",
    "optimizer",
    "wrap",
    "load_pretrained",
    "save_checkpoint",
    "load_checkpoint",
    "save_full",
    "latest_checkpoint",
    "__version__",
]
