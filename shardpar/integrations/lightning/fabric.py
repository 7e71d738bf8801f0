"""``ShardparFabricStrategy``: shardpar as the strategy of Lightning's ``Fabric``.

What each Fabric call does under it: ``fabric.setup(model, optimizer)`` wraps the model
(``shardpar.wrap``) and rebuilds the optimizer with ``shardpar.optimizer``, moving a
``scheduler=`` onto it (``fabric.setup_module`` then ``fabric.setup_optimizers`` works too);
``fabric.backward`` is ``loss.backward()`` (scaled under '16-mixed');
``fabric.no_backward_sync(model)`` is ``model.no_sync()``; ``fabric.clip_gradients`` is
``model.clip_grad_norm_`` / ``clip_grad_value_``; ``fabric.init_module(empty_init=True)``
builds on the meta device, for ``wrap`` to materialise; ``fabric.save`` / ``fabric.load``
write and read a shardpar checkpoint directory holding one wrapped model, its optimizer and
the rest of the state as JSON ([Note: Lightning state in a shardpar checkpoint] in common.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl, _validate_keys_for_strict_loading
from lightning.fabric.utilities.types import _Stateful
from torch import nn

from ...checkpoint import load_checkpoint
from ...errors import CheckpointError
from ...facade import ShardedModule, sharded_module_of
from ...optim import ShardedOptimizer
from .common import (
    DistributedParts,
    WrapOptions,
    decode_state,
    read_saved_state,
    save_with_state,
    shard_optimizer,
)
from .precision import ShardparFabricPrecision, shardpar_precision


class _NoSync(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: backward passes inside reduce nothing."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> contextlib.AbstractContextManager[Any]:
        if not enabled:
            return contextlib.nullcontext()
        return sharded_module_of(module, "fabric.no_backward_sync").no_sync()


class ShardparFabricStrategy(DistributedParts, ParallelStrategy):
    """Train with shardpar under Lightning's ``Fabric``: ``Fabric(strategy=ShardparFabricStrategy(stage=2))``.

    The arguments are :class:`ShardparStrategy`'s; ``init_fn`` initialises a model built under
    ``fabric.init_module(empty_init=True)``. See the module docstring for what each Fabric call
    does.
    """

    def __init__(
        self,
        stage: int | str = 0,
        *,
        init_fn: Callable[[nn.Module], Any] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        **wrap_options: Any,
    ) -> None:
        self.wrap_options = WrapOptions(stage, init_fn, wrap_options)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self.num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._backward_sync_control = _NoSync()
        self._models: list[ShardedModule] = []
        """What this strategy wrapped, for optimizers set up apart from their model."""

    launcher_class = _SubprocessScriptLauncher

    @property
    def precision(self) -> ShardparFabricPrecision:
        if self._precision is None:
            self._precision = ShardparFabricPrecision()
        return cast(ShardparFabricPrecision, self._precision)  # the setter makes every plugin one

    @precision.setter
    def precision(self, plugin: Any) -> None:
        self._precision = shardpar_precision(plugin, ShardparFabricPrecision)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self.reduce_for_lightning(tensor, group, reduce_op)

    # ------------------------------------------------------------------ model and optimizers

    def module_init_context(self, empty_init: bool | None = None) -> contextlib.AbstractContextManager[Any]:
        """``fabric.init_module(empty_init=True)`` builds on the meta device: ``wrap`` gives the
        values, one unit at a time at stage 3."""
        if not empty_init:
            return super().module_init_context(empty_init)
        stack = contextlib.ExitStack()
        stack.enter_context(torch.device("meta"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: nn.Module) -> None:
        """The wrap places the model (a model built on the meta device has nothing to move)."""

    def setup_module(self, module: nn.Module) -> ShardedModule:
        model = self.wrap_options.wrap(
            module, self.precision.spec, self.root_device, "fabric.init_module(empty_init=True) builds on it"
        )
        self.precision.connect_model(model)
        self._models.append(model)
        return model

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> ShardedOptimizer:
        """An optimizer built over the parameters of a model set up before (``fabric.setup_module``)."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for model in self._models:
            if params <= {id(p) for p in model.parameters()}:
                return shard_optimizer(model, optimizer)
        raise ValueError(
            "fabric.setup_optimizers: the optimizer's parameters are not those of one model set up with "
            "this strategy; set up the model first (fabric.setup_module) and build the optimizer over "
            "its parameters"
        )

    def setup_module_and_optimizers(
        self, module: nn.Module, optimizers: list[torch.optim.Optimizer], scheduler: Any = None
    ) -> tuple[ShardedModule, list[torch.optim.Optimizer], Any]:  # each a ShardedOptimizer
        model = self.setup_module(module)
        schedulers = [] if scheduler is None else [scheduler]
        return model, [shard_optimizer(model, opt, schedulers) for opt in optimizers], scheduler

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: Any,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        self.precision.unscale_gradients(optimizer)
        return sharded_module_of(module, "fabric.clip_gradients").clip_grad_norm_(
            max_norm, norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def clip_gradients_value(self, module: nn.Module, optimizer: Any, clip_val: float) -> None:
        self.precision.unscale_gradients(optimizer)
        sharded_module_of(module, "fabric.clip_gradients").clip_grad_value_(clip_val)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(
        self,
        path: Any,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """``fabric.save(path, {"model": model, "optimizer": opt, ...})``: a shardpar checkpoint
        directory holding the one wrapped model, its optimizer, and the rest as JSON (stateful
        objects by their ``state_dict()``)."""
        if storage_options is not None or filter:
            raise TypeError(
                "ShardparFabricStrategy.save_checkpoint takes neither storage_options nor filter: the "
                "model and optimizer are saved whole, as a shardpar checkpoint"
            )
        model_key, model, optimizer_key, optimizer = _model_and_optimizer(state)

        def rest() -> dict[str, Any]:
            others = {
                key: obj.state_dict() if isinstance(obj, _Stateful) else obj
                for key, obj in state.items()
                if key not in (model_key, optimizer_key)
            }
            return {"model": model_key, "optimizer": optimizer_key, "state": others}

        save_with_state(path, model, optimizer, rest, "ShardparFabricStrategy.save_checkpoint")

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """``fabric.load(path, state)``: the model and optimizer in ``state`` load in place (at
        any world size and stage), stateful objects through ``load_state_dict``, other entries
        are replaced; returns what the checkpoint holds beyond ``state``."""
        if isinstance(state, nn.Module):
            state = {"model": state}
        if not isinstance(state, dict) or not state:
            raise ValueError(
                "ShardparFabricStrategy loads a checkpoint into the objects it holds: pass them, "
                "fabric.load(path, {'model': model, 'optimizer': optimizer, ...})"
            )
        model_key, model, optimizer_key, optimizer = _model_and_optimizer(state)
        saved = read_saved_state(path, model, "ShardparFabricStrategy.load_checkpoint")
        if optimizer is not None and not saved.has_optimizer:
            raise CheckpointError(f"{saved.path} holds no optimizer state, but state['{optimizer_key}'] asks for it")
        saved_state = decode_state(load_checkpoint(saved.path, model, optimizer), saved.path)
        others: dict[str, Any] = saved_state["state"]
        requested = [key for key in state if key not in (model_key, optimizer_key)]
        _validate_keys_for_strict_loading(requested, others.keys(), strict=strict)
        for key in requested:
            if key not in others:
                continue
            value = others.pop(key)
            if isinstance(state[key], _Stateful):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return others


def _model_and_optimizer(state: dict[str, Any]) -> tuple[str, ShardedModule, str | None, ShardedOptimizer | None]:
    """The one wrapped model in ``state`` and its optimizer, if any, with their keys."""
    models = [(key, obj) for key, obj in state.items() if isinstance(obj, nn.Module)]
    optimizers = [(key, obj) for key, obj in state.items() if isinstance(obj, torch.optim.Optimizer)]
    if len(models) != 1 or not isinstance(models[0][1], ShardedModule):
        raise ValueError(
            f"a shardpar checkpoint holds one model set up by ShardparFabricStrategy; the state has "
            f"{len(models)} module(s) ({', '.join(key for key, _ in models) or 'none'}): save each model in its own "
            "checkpoint"
        )
    if len(optimizers) > 1 or any(not isinstance(opt, ShardedOptimizer) for _, opt in optimizers):
        raise ValueError(
            "a shardpar checkpoint holds the one optimizer set up with its model by ShardparFabricStrategy"
        )
    model_key, model = models[0]
    optimizer_key, optimizer = optimizers[0] if optimizers else (None, None)
    # their classes were checked above
    return model_key, cast(ShardedModule, model), optimizer_key, cast("ShardedOptimizer | None", optimizer)
