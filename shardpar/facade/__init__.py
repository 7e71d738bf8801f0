"""The ``nn.Module`` face of a wrapped model: the ``ShardedModule`` users get from
``shardpar.wrap``, the wrapped module's own surface while an engine manages it (state dicts,
loads, moves, plain copies) and methods declared to run like ``forward``. It depends on the
engine; nothing below it depends on it."""

from .forward_methods import register_forward_method
from .sharded_module import ShardedModule, sharded_module_of

__all__ = ["ShardedModule", "register_forward_method", "sharded_module_of"]
