"""shardpar under the Hugging Face ``Trainer``: ``ShardparTrainer(model=..., args=...,
shardpar_stage=2)`` where the script had ``Trainer(...)`` (docs/integrations.md), and the
same for any Trainer subclass by mixing it in first (``class ShardparSFTTrainer(ShardparTrainer,
SFTTrainer)``, TRL's SFTTrainer).

Needs ``transformers`` and ``accelerate`` (``pip install shardpar[transformers]``); tested with
transformers 5.24, accelerate 1.15 and trl 1.16. ``import shardpar`` never imports this module.
"""

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "shardpar.integrations.transformers needs transformers and accelerate: pip install 'shardpar[transformers]'"
    ) from error

from .trainer import OPTIMIZER_DIR, ShardparTrainer, refuse_sharded_model

__all__ = ["OPTIMIZER_DIR", "ShardparTrainer", "refuse_sharded_model"]
