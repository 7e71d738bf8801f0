"""What every integration does alike, whatever the framework: checking ``shardpar.wrap``'s
options when the integration's object is made, and bringing a torch optimizer that the
framework built over the model's parameters onto ``shardpar.optimizer``, with its LR
schedulers. Imports no framework (``shardpar.integrations.lightning`` and
``shardpar.integrations.transformers`` both use it).
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Iterable
from typing import Any, cast

import torch

from ..config import ShardConfig
from ..facade import ShardedModule
from ..optim import ShardedOptimizer
from ..optim import optimizer as shardpar_optimizer


def check_wrap_options(stage: int | str, options: dict[str, Any], who: str) -> None:
    """Refuse, as ``shardpar.wrap`` would, a misspelt option or a bad value of ``stage`` and
    the options, when ``who`` (the integration's object) is made rather than minutes later
    when it wraps. ``memory_budget`` goes with ``stage="auto"`` only."""
    known = [name for name in ShardConfig.option_names() if name != "stage"] + ["memory_budget"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"{who} got unknown option(s) {', '.join(unknown)}; the options of shardpar.wrap are {', '.join(known)}"
        )
    config_options = {k: v for k, v in options.items() if k != "memory_budget"}
    if stage == "auto":
        if "memory_budget" not in options:
            raise ValueError("stage='auto' needs memory_budget= (bytes per rank, or a string such as '24GB')")
        ShardConfig(stage=0, **config_options)
    elif "memory_budget" in options:
        raise ValueError(f"memory_budget is used with stage='auto' only, got stage={stage!r}")
    else:
        ShardConfig(stage=cast(int, stage), **config_options)  # a wrong stage is ShardConfig's to refuse by name


def shard_optimizer(model: ShardedModule, optimizer: Any, schedulers: Iterable[Any] = ()) -> ShardedOptimizer:
    """The torch optimizer a framework built over the model's parameters (a LightningModule's
    ``configure_optimizers``, a Fabric script, the Hugging Face Trainer's ``create_optimizer``
    or ``optimizers=``), made again by ``shardpar.optimizer`` with its class, param groups and
    options, so that each rank keeps only its share of the state at stages 1-3.
    ``schedulers`` built over it now drive the new one (their ``step`` sets its learning
    rates). The old optimizer must not have stepped: its state would be lost."""
    if isinstance(optimizer, ShardedOptimizer):
        if optimizer.engine is not model.engine:
            raise ValueError("this shardpar optimizer was built over another wrapped model")
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    name = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if optimizer.state:
        raise ValueError(
            f"{name} already holds state (it has stepped); give the integration a fresh optimizer, "
            "it rebuilds it over the wrapped model with shardpar.optimizer"
        )
    groups = [dict(group) for group in optimizer.param_groups]
    sharded = shardpar_optimizer(model, type(optimizer), groups, **_constructor_defaults(optimizer))
    for scheduler in schedulers:
        move_scheduler(scheduler, optimizer, sharded)
    return sharded


def _constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.defaults`` that its constructor takes back (AdamW records
    ``decoupled_weight_decay`` but does not accept it); the groups carry every value anyway."""
    parameters = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return dict(optimizer.defaults)
    return {key: value for key, value in optimizer.defaults.items() if key in parameters}


def move_scheduler(scheduler: Any, old: Any, new: ShardedOptimizer) -> None:
    """Point ``scheduler`` (and those it chains: SequentialLR, ChainedScheduler) at ``new``."""
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        _mark_step_calls(new)
    for inner in getattr(scheduler, "_schedulers", ()):
        move_scheduler(inner, old, new)


def _mark_step_calls(optimizer: ShardedOptimizer) -> None:
    """What torch's LRScheduler does to the optimizer it is built with, done for the one it now
    drives: its ``step`` marks that it ran, which the scheduler's first ``step`` checks (it
    warns otherwise that optimizer.step() was overridden or not called first)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step
    owner = weakref.ref(optimizer)  # no cycle through the instance's own attribute

    @functools.wraps(step)
    def marked_step(*args: Any, **kwargs: Any) -> Any:
        target = cast(ShardedOptimizer, owner())  # called as its own step: it is alive
        target._opt_called = True  # type: ignore[attr-defined]  # torch's LRScheduler flag, not declared on Optimizer
        return step(target, *args, **kwargs)

    marked_step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = marked_step  # type: ignore[method-assign]
