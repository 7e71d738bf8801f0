"""shardpar as a Lightning strategy: ``L.Trainer(strategy=ShardparStrategy(stage=2))`` and
``L.Fabric(strategy=ShardparFabricStrategy(stage=2))`` (docs/integrations.md).

Needs the ``lightning`` package (``pip install shardpar[lightning]``); tested with Lightning
2.6. The standalone ``pytorch_lightning`` package is another set of classes and is not
supported. ``import shardpar`` never imports this module.
"""

try:
    import lightning  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shardpar.integrations.lightning needs the lightning package: pip install 'shardpar[lightning]'"
    ) from error

from .fabric import ShardparFabricStrategy
from .precision import ShardparFabricPrecision, ShardparPrecision
from .trainer import ShardparStrategy

__all__ = ["ShardparStrategy", "ShardparFabricStrategy", "ShardparPrecision", "ShardparFabricPrecision"]
