"""Which optimizers a model trains with (``ModelSpec.optimizers``): AdamW over every parameter
(``"adamw"``, every model but nanochat's), or nanochat's pair (``"muon+adamw"``):
``torch.optim.Muon`` over the blocks' matrices and AdamW over the embedding and the head, two
optimizers over one model. Every configuration builds them through :func:`build_optimizers`,
with its own constructor (plain torch, or ``shardpar.optimizer`` bound to the wrapped model), so
all of them train the same model the same way; and :func:`optimizer_state_bytes` is their state
in closed form, the *k·Ψ* of docs/design.md's ZeRO formula."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

ADAMW = "adamw"
MUON_ADAMW = "muon+adamw"
KINDS = (ADAMW, MUON_ADAMW)

ADAMW_ONLY_OPTIONS: dict[str, Any] = {"lr": 1e-3}
"""AdamW's settings when it trains every parameter (torch's defaults but the learning rate)."""
MUON_OPTIONS: dict[str, Any] = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0}
"""nanochat's Muon settings (no weight decay), for ``torch.optim.Muon``."""
ADAMW_OPTIONS: dict[str, Any] = {"lr": 1e-3, "betas": (0.8, 0.95), "eps": 1e-10, "weight_decay": 0.0}
"""nanochat's AdamW settings for the embedding and the head."""

Make = Callable[..., Any]
"""``make(optimizer_class, params, **options)``: one optimizer, as a configuration builds it."""


def muon_and_adamw_params(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """nanochat's split: the model's own (``NanochatGPT.muon_params``/``adamw_params``, also
    through a wrapper that forwards attributes, as ``ShardedModule`` does), or else Muon for
    every matrix and AdamW for the rest."""
    if hasattr(model, "muon_params") and hasattr(model, "adamw_params"):
        return list(model.muon_params()), list(model.adamw_params())
    params = [p for p in model.parameters() if p.requires_grad]
    return [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]


def muon_and_adamw(model: nn.Module, make: Make) -> list[Any]:
    """nanochat's two optimizers over ``model``, with its settings."""
    matrices, rest = muon_and_adamw_params(model)
    return [make(torch.optim.Muon, matrices, **MUON_OPTIONS), make(torch.optim.AdamW, rest, **ADAMW_OPTIONS)]


def build_optimizers(kind: str, model: nn.Module, make: Make) -> list[Any]:
    """The optimizers ``kind`` names over ``model`` (wrapped or not: its parameters are the
    ones handed to ``make``), in the order their steps run."""
    if kind == ADAMW:
        return [make(torch.optim.AdamW, list(model.parameters()), **ADAMW_ONLY_OPTIONS)]
    if kind == MUON_ADAMW:
        return muon_and_adamw(model, make)
    raise ValueError(f"unknown optimizers {kind!r}; expected one of {', '.join(KINDS)}")


def torch_optimizer(optimizer_class: type[torch.optim.Optimizer], params: Any, **options: Any) -> Any:
    """The plain torch constructor, as :func:`build_optimizers`' ``make``."""
    return optimizer_class(params, **options)


def optimizer_state_bytes(kind: str, model: nn.Module) -> int:
    """Bytes of fp32 optimizer state over the whole model: AdamW's two moments (8 bytes an
    element), Muon's momentum (4); the per-parameter step counters (4 bytes a tensor) left
    out, as the ZeRO formula leaves them out."""
    if kind == ADAMW:
        return 8 * sum(p.numel() for p in model.parameters())
    if kind == MUON_ADAMW:
        matrices, rest = muon_and_adamw_params(model)
        return 4 * sum(p.numel() for p in matrices) + 8 * sum(p.numel() for p in rest)
    raise ValueError(f"unknown optimizers {kind!r}; expected one of {', '.join(KINDS)}")
