"""``ShardparTrainer``: the Hugging Face ``Trainer`` (and its subclasses, TRL's ``SFTTrainer``
among them) training with shardpar by one argument.

[Note: the Hugging Face Trainer under shardpar]
The Trainer reaches DDP, FSDP and DeepSpeed through accelerate; under shardpar these are the
places each part of a run goes (the Trainer's own methods, overridden here):

- The wrap: ``_wrap_model`` (every ``train``, ``evaluate`` and ``predict`` asks it for the
  model to run) returns one ``ShardedModule`` around ``self.model``, made the first time.
  Handing the Trainer a model that is not ``self.model`` is what keeps accelerate from putting
  its DDP around it, as for the models the Trainer knows to be wrapped already. ``self.model``
  stays the ``PreTrainedModel``, so the Trainer's signature inspection (which dataset columns
  reach ``forward``), label names, ``save_pretrained`` and the hub keep working on it.
- ``bf16``/``fp16``: accelerate puts its autocast around the model's forward in
  ``prepare_model``, which the Trainer skips for a model it did not wrap; the wrap asks
  accelerate for exactly that autocast on ``self.model`` first (``prepare_model`` in evaluation
  mode: autocast and placement, no DDP), so mixed precision is the DDP Trainer's: float32
  parameters, autocast compute, float32 outputs. ``fp16``'s loss scaling is ``shardpar.GradScaler``
  in the place of accelerate's scaler (an overflow on any rank's shards skips the step on
  every rank). ``shardpar_options={"mixed_precision": "bf16"}`` is shardpar's own (bfloat16
  compute copies) and goes with or without ``bf16=True``.
- The optimizer: the Trainer builds it (``optim=``, ``optimizer_cls_and_kwargs``, or takes
  ``optimizers=``) over ``self.model``'s parameters before it asks for the wrapped model;
  ``create_optimizer`` wraps first, lets the Trainer build its optimizer, and rebuilds it with
  ``shardpar.optimizer`` (same class, param groups and options; a scheduler given in
  ``optimizers=`` moved onto it). A second ``train`` or an ``evaluate`` finds accelerate's
  ``AcceleratedOptimizer`` around it and keeps the shardpar one inside.
- Accumulation: the Trainer's ``accelerator.no_sync(model)`` is ``model.no_sync()``.
- Clipping and the logged ``grad_norm``: ``model.clip_grad_norm_`` (the Trainer would clip
  ``model.parameters()``, whose gradients are shards at stages 2-3), after the scaler
  unscales under fp16; with ``max_grad_norm=0`` the norm is still logged, nothing clipped.
- ``save_model`` (and the model in every ``checkpoint-N/``): the full state dict is gathered
  on every rank (a collective at stages 1-3), then rank 0 writes it with ``save_pretrained``:
  the Hugging Face layout, config included, loadable by ``from_pretrained``.
- Checkpoints at ``save_steps``: the optimizer state is a shardpar checkpoint,
  ``checkpoint-N/shardpar/`` (every rank writes its own shards; loadable at any world size
  and stage), in the place of rank 0's ``torch.save`` of ``optimizer.pt``. The scheduler, the
  scaler, the RNG states and ``trainer_state.json`` are the Trainer's own files.
  ``resume_from_checkpoint`` loads the weights through the Trainer (``model.safetensors``) and
  the optimizer from the shardpar checkpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch import nn
from transformers import Trainer

from ...checkpoint import load_checkpoint, save_checkpoint
from ...checkpoint.format import read_manifest
from ...errors import CheckpointError
from ...facade import ShardedModule
from ...optim import GradScaler, ShardedOptimizer
from ...wrap import wrap
from ..shared import check_wrap_options, shard_optimizer

OPTIMIZER_DIR = "shardpar"
"""The shardpar checkpoint inside ``checkpoint-N/`` that holds the optimizer (and model) state."""


def refuse_sharded_model(model: Any, who: str) -> None:
    """A ``ShardedModule`` given to a Trainer as ``model=``: refused, naming the fix. The
    Trainer reads the model's class (``forward``'s signature picks the dataset columns, the
    label names, whether it is a ``PreTrainedModel`` to ``save_pretrained``) and would drop
    every column, evaluate without a loss and fail to save."""
    if isinstance(model, ShardedModule):
        raise TypeError(
            f"{who} got a model already wrapped by shardpar (a ShardedModule around "
            f"{type(model.module).__name__}): the Trainer inspects the model it is given, and a ShardedModule hides "
            "the PreTrainedModel's forward signature, labels and save_pretrained. Pass the unwrapped model and "
            "shardpar_stage= (ShardparTrainer(model=model, shardpar_stage=2, ...)); it wraps it once itself"
        )


def unwrap_accelerated(optimizer: Any) -> Any:
    """The optimizer inside accelerate's ``AcceleratedOptimizer`` wrappers (itself if none)."""
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


class ShardparTrainer(Trainer):
    """``transformers.Trainer`` training with shardpar: ``ShardparTrainer(model=model, args=args,
    ..., shardpar_stage=2)`` in the place of ``Trainer(...)``, with everything else as it was.

    ``shardpar_stage`` is ``shardpar.wrap``'s ``stage`` (0-3, or ``"auto"`` with
    ``shardpar_options={"memory_budget": ...}``); ``shardpar_options`` are its other options
    (``bucket_cap_mb``, ``mixed_precision``, ``wrap_policy``, ``min_unit_params``, ...), checked
    here. Used as a mixin, it brings the same to another Trainer subclass:
    ``class ShardparSFTTrainer(ShardparTrainer, SFTTrainer): pass``. See [Note: the Hugging Face
    Trainer under shardpar] for where each part of a run goes.
    """

    def __init__(
        self,
        *args: Any,
        shardpar_stage: int | str = 0,
        shardpar_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        who = type(self).__name__
        options = dict(shardpar_options or {})
        check_wrap_options(shardpar_stage, options, who)
        refuse_sharded_model(kwargs.get("model", args[0] if args else None), who)
        self.shardpar_stage = shardpar_stage
        self.shardpar_options = options
        self._sharded: ShardedModule | None = None
        super().__init__(*args, **kwargs)
        for engine, on in (("DeepSpeed", self.is_deepspeed_enabled), ("FSDP", self.is_fsdp_enabled)):
            if on:
                raise ValueError(
                    f"{who} trains with shardpar; the TrainingArguments also ask for {engine} "
                    f"(fsdp=/deepspeed= or accelerate's config): drop that, shardpar_stage= takes its place"
                )
        if self.args.torch_compile:
            raise ValueError(
                f"{who} does not compile the model for you (torch_compile=True): compile its blocks "
                "yourself before the Trainer is made (block.compile()), which shardpar supports"
            )
        if self.model_init is not None:
            raise ValueError(
                f"{who} wraps the model it is given once; model_init= (a new model per train(), for "
                "hyperparameter search) is not supported: pass model="
            )

    # ------------------------------------------------------------------ the wrap

    @property
    def sharded_model(self) -> ShardedModule:
        """The ``ShardedModule`` around ``self.model``, made on first use (on every rank)."""
        if self._sharded is None:
            assert self.model is not None  # the Trainer requires model= (model_init= is refused at __init__)
            refuse_sharded_model(self.model, type(self).__name__)
            if self.accelerator.native_amp:
                # the autocast accelerate gives the models it prepares (see the Note)
                self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
            self._sharded = wrap(self.model, self.shardpar_stage, **self.shardpar_options)
            self._refuse_other_world()
            if self.args.fp16:
                self.accelerator.scaler = GradScaler(self._sharded)
        return self._sharded

    def _refuse_other_world(self) -> None:
        """The Trainer's ranks must be shardpar's: under torchrun on CPUs without ``use_cpu=True``
        accelerate runs every process as a world of its own (each reads the whole dataset and
        writes every file) while ``shardpar.wrap`` joins them into one process group."""
        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if ranks != self.args.world_size:
            raise ValueError(
                f"{type(self).__name__}: the Trainer sees a world size of {self.args.world_size}, shardpar's process "
                f"group has {ranks} ranks; on CPUs under torchrun pass TrainingArguments(use_cpu=True), with which "
                "accelerate takes torchrun's ranks (on GPUs it does by itself)"
            )

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        # A wrapped model is not wrapped again by accelerate (and DDP around a ShardedModule is
        # refused by the ShardedModule itself, in any framework).
        return self.sharded_model

    # ------------------------------------------------------------------ optimizer

    def create_optimizer(self, model: nn.Module | None = None) -> ShardedOptimizer:
        sharded = self.sharded_model
        built = unwrap_accelerated(super().create_optimizer(model))  # an earlier train()'s is accelerate's
        schedulers = [self.lr_scheduler] if self.lr_scheduler is not None else []  # optimizers=(opt, scheduler)
        self.optimizer = shard_optimizer(sharded, built, schedulers)
        return self.optimizer

    @property
    def sharded_optimizer(self) -> ShardedOptimizer:
        """The shardpar optimizer inside accelerate's ``AcceleratedOptimizer`` (``self.optimizer``)."""
        optimizer = unwrap_accelerated(self.optimizer)
        if not isinstance(optimizer, ShardedOptimizer):
            raise RuntimeError(f"{type(self).__name__} has no shardpar optimizer yet (train() builds it)")
        return optimizer

    # ------------------------------------------------------------------ clipping

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        self.accelerator.unscale_gradients()  # fp16: true gradients first, as accelerate's clipping does
        return self.sharded_model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # max_grad_norm=0: the norm is logged all the same, nothing clipped
            self.accelerator.unscale_gradients()
            grad_norm = self.sharded_model.clip_grad_norm_(float("inf"))
        return grad_norm

    # ------------------------------------------------------------------ saving

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """The Trainer's ``_save`` (``save_pretrained`` on rank 0) with the full state dict
        gathered on every rank first: every rank calls it, and at stages 1-3 the gather is a
        collective."""
        if self._sharded is not None and state_dict is None:
            assert self.model is not None  # it was wrapped
            state_dict = self.model.state_dict()
        super()._save(output_dir, state_dict=state_dict)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._sharded is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        save_checkpoint(
            os.path.join(output_dir, OPTIMIZER_DIR),
            self._sharded,
            self.sharded_optimizer,
            extra={"global_step": self.state.global_step},
        )
        assert self.lr_scheduler is not None  # made with the optimizer, before training
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, "scheduler.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or self._sharded is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        path = os.path.join(checkpoint, OPTIMIZER_DIR)
        if not os.path.isdir(path):
            found = (
                "optimizer.pt (a torch.save of a plain optimizer, e.g. of the DDP Trainer)"
                if os.path.isfile(os.path.join(checkpoint, "optimizer.pt"))
                else "no optimizer state"
            )
            raise CheckpointError(
                f"{checkpoint} holds {found}, not the shardpar checkpoint {OPTIMIZER_DIR}/ that ShardparTrainer writes; "
                "resume it with the Trainer that wrote it, or start from its weights (model=from_pretrained(...)) "
                "without resume_from_checkpoint"
            )
        if read_manifest(path).optimizer is None:
            raise CheckpointError(f"{path} is a shardpar checkpoint without optimizer state")
        load_checkpoint(path, self._sharded, self.sharded_optimizer)
        assert self.lr_scheduler is not None  # made with the optimizer, before training
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True))
