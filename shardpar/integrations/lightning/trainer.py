"""``ShardparStrategy``: shardpar as the strategy of Lightning's ``Trainer``.

[Note: the Trainer under shardpar]
Where each part of a Trainer run goes (Lightning calls the strategy's hooks; these are ours):

- ``setup``: the LightningModule itself is wrapped (``shardpar.wrap``), so parameter names,
  state-dict keys and the hooks users write stay Lightning's. ``configure_optimizers`` runs as
  usual and its torch optimizer is rebuilt by ``shardpar.optimizer`` (same class, groups and
  options), its LR schedulers moved onto the new one (``common.shard_optimizer``). A second
  ``fit``/``validate``/``test`` with the same module reuses the wrap: the parameters live in
  shardpar's buffers from then on, as they do in FSDP's.
- Steps: ``training_step``/``validation_step``/``test_step`` are redirected through the
  wrapped model's forward, as Lightning's DDP does, so shardpar's forward hooks (stage 3's
  gathers, mixed precision's input casts, buffer broadcasts) surround the whole step whether it
  calls ``self(x)`` or a submodule. Every rank runs validation and test (at stage 3 every
  forward is collective), as under DDP.
- ``accumulate_grad_batches``: Lightning's ``block_backward_sync`` is ``model.no_sync()``.
- ``gradient_clip_val``: the precision plugin clips with ``model.clip_grad_norm_`` /
  ``clip_grad_value_`` ([Note: Lightning precision in shardpar] in precision.py).
- ``configure_model`` (and ``trainer.init_module()``) runs under ``torch.device("meta")``:
  nothing is allocated until ``wrap`` materialises the model, one unit at a time at stage 3.
- Checkpoints (``ModelCheckpoint``, ``trainer.save_checkpoint``, ``ckpt_path=``): shardpar
  checkpoint directories, written by every rank and loaded at any world size and stage; the
  rest of Lightning's checkpoint rides in the manifest ([Note: Lightning state in a shardpar
  checkpoint] in common.py). Loading happens after ``setup`` (the model must be wrapped to
  take its shards), and loads the model and optimizer in place; Lightning then restores
  loops, callbacks and schedulers from the returned state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, cast

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ...checkpoint import load_checkpoint
from ...facade import ShardedModule
from ...optim import ShardedOptimizer
from .common import DistributedParts, WrapOptions, decode_state, read_saved_state, save_with_state, shard_optimizer
from .precision import ShardparPrecision, shardpar_precision

_MODEL_KEYS = ("state_dict", "optimizer_states")
"""What Lightning's checkpoint dict holds that the checkpoint's tensors hold instead."""


class ShardparStrategy(DistributedParts, ParallelStrategy):
    """Train with shardpar under Lightning's ``Trainer``: ``Trainer(strategy=ShardparStrategy(stage=2))``.

    ``stage`` and ``**wrap_options`` are ``shardpar.wrap``'s (``bucket_cap_mb``,
    ``wrap_policy``, ``mixed_precision``, ``stage="auto"`` with ``memory_budget``, ...).
    ``init_fn`` initialises modules that ``configure_model`` builds (on the meta device) as
    ``shardpar.wrap``'s ``init_fn`` does; without it each submodule's ``reset_parameters()``.
    ``timeout`` is the process group's (default: from shardpar's ``timeout_s``). The Trainer's
    ``precision=`` maps onto shardpar's mixed precision ([Note: Lightning precision in
    shardpar]). See [Note: the Trainer under shardpar] for where each part of a run goes.
    """

    strategy_name = "shardpar"

    def __init__(
        self,
        stage: int | str = 0,
        *,
        init_fn: Callable[[torch.nn.Module], Any] | None = None,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Any = None,
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
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._sharded: ShardedModule | None = None

    launcher_class = _SubprocessScriptLauncher

    @property
    def is_distributed(self) -> bool:
        """Lightning asks custom strategies this to add distributed samplers."""
        return True

    @property
    def precision_plugin(self) -> ShardparPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = ShardparPrecision()
        return cast(ShardparPrecision, self._precision_plugin)  # the setter makes every plugin one

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = shardpar_precision(plugin, ShardparPrecision)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return self.reduce_for_lightning(tensor, group, reduce_op)

    # ------------------------------------------------------------------ model and optimizers

    @contextlib.contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """``configure_model`` and ``trainer.init_module()`` build on the meta device (unless
        ``empty_init=False``): ``wrap`` gives the values, one unit at a time at stage 3."""
        device = self.root_device if empty_init is False else torch.device("meta")
        with device, self.precision_plugin.tensor_init_context():
            yield

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model = self._wrapped(trainer)
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()

    def _wrapped(self, trainer: Any) -> ShardedModule:
        """The LightningModule wrapped, once; a later fit/validate/test of it reuses the wrap."""
        module: torch.nn.Module | None = self.lightning_module  # the sync and the conversion give plain modules
        assert module is not None
        if self._sharded is not None and self._sharded.module is module:
            return self._sharded
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            module = self._layer_sync.apply(module)  # sync_batchnorm=True: before the wrap, kept after
        module = self.precision_plugin.convert_module(module)
        self._sharded = self.wrap_options.wrap(
            module,
            self.precision_plugin.spec,
            self.root_device,
            "ShardparStrategy runs configure_model under torch.device('meta')",
        )
        return self._sharded

    def model_to_device(self) -> None:
        """The wrap places the model (a model built on the meta device has nothing to move)."""

    def setup_optimizers(self, trainer: Any) -> None:
        """``configure_optimizers``' optimizer rebuilt by ``shardpar.optimizer``, its schedulers
        moved onto it. One optimizer: a shardpar checkpoint holds one."""
        assert self.lightning_module is not None and self._sharded is not None
        optimizers, scheduler_configs = _init_optimizers_and_lr_schedulers(self.lightning_module)
        if len(optimizers) > 1:
            raise ValueError(
                f"ShardparStrategy trains with one optimizer, configure_optimizers returned {len(optimizers)}; "
                "put every parameter in one optimizer (param groups can differ in their options)"
            )
        schedulers = [config.scheduler for config in scheduler_configs]
        self.optimizers = [shard_optimizer(self._sharded, opt, schedulers) for opt in optimizers]
        self.lr_scheduler_configs = scheduler_configs

    def _optimizer(self) -> ShardedOptimizer | None:
        return cast(ShardedOptimizer, self.optimizers[0]) if self.optimizers else None  # setup_optimizers' own

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside reduce nothing (``model.no_sync()``)."""
        if self._sharded is None:
            yield
            return
        with self._sharded.no_sync():
            yield

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the shards load into the wrapped model and its optimizer

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint loaded it

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Nothing: the checkpoint's tensors are the model (no rank gathers it)."""
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """Nothing: the checkpoint's tensors hold each rank's optimizer pieces."""
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """Loaded by :meth:`load_checkpoint` already."""

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Loaded by :meth:`load_checkpoint` already."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A shardpar checkpoint directory at rank 0's ``filepath`` (every rank writes its part);
        see [Note: Lightning state in a shardpar checkpoint] in common.py."""
        if storage_options is not None:
            raise TypeError(
                "ShardparStrategy.save_checkpoint takes no storage_options: shardpar writes the "
                "checkpoint itself, not through a CheckpointIO plugin"
            )
        assert self._sharded is not None
        optimizer = self._optimizer() if "optimizer_states" in checkpoint else None  # not weights_only
        save_with_state(
            filepath,
            self._sharded,
            optimizer,
            lambda: {k: v for k, v in checkpoint.items() if k not in _MODEL_KEYS},
            "ShardparStrategy.save_checkpoint",
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load the model (and when fitting, the optimizer) in place, at any world size and
        stage; return the rest of Lightning's checkpoint for Lightning to restore."""
        assert self._sharded is not None and self.lightning_module is not None
        saved = read_saved_state(checkpoint_path, self._sharded, "ShardparStrategy.load_checkpoint")
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizer = self._optimizer() if fitting and saved.has_optimizer else None
        extra = load_checkpoint(saved.path, self._sharded, optimizer)
        return decode_state(extra, saved.path)

    # ------------------------------------------------------------------ the end

    def teardown(self) -> None:
        """As FSDP's: the model stays where it trains (its parameters are views of shardpar's
        buffers; moving them to the CPU as the base strategy does would break them)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
