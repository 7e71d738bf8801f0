"""What the ranks of ``tests/test_lightning.py`` run: a small LightningModule, its data, and
runs of Lightning's own ``Trainer`` and ``Fabric`` under Lightning's DDP strategy (the oracle)
or shardpar's strategies. Imported on the ranks only: importing Lightning takes seconds, and
the pytest process never needs it.

Data: 32 rows, 4 rows per rank per micro-batch at world size 2 (Lightning's DistributedSampler
deals rows round-robin, so micro-batch k holds global rows 8k..8k+7: the batch of 8 that one
rank takes at world size 1).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from shardpar.integrations.lightning import ShardparFabricStrategy, ShardparStrategy

ROWS, FEATURES, BATCH = 32, 8, 4
UNIT_PARAMS = 200
"""``min_unit_params``: at stage 3 each Linear is a unit of its own (the 33-parameter head too
small: it is gathered with the root), so units are gathered and freed within every step."""


@contextlib.contextmanager
def torchelastic_launched() -> Iterator[None]:
    """What torchrun sets and the harness does not (it clears ``TORCHELASTIC_*`` for its
    ranks): Lightning then takes the processes as started by torchrun and launches none."""
    saved = os.environ.get("TORCHELASTIC_RUN_ID")
    os.environ["TORCHELASTIC_RUN_ID"] = "tests-lightning"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TORCHELASTIC_RUN_ID"]
        else:
            os.environ["TORCHELASTIC_RUN_ID"] = saved


def loader(batch: int = BATCH) -> DataLoader:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(ROWS, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, 1, generator=generator)).tanh() + 0.1 * torch.randn(ROWS, 1, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def optimizer_and_scheduler(module: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with two param groups (no decay on biases) and a per-step decay of the rate."""
    decay = [p for p in module.parameters() if p.ndim >= 2]
    no_decay = [p for p in module.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.02, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)


class Regression(L.LightningModule):
    """``build_in_configure_model``: the layers come from ``configure_model`` (on the meta
    device under shardpar); ``autocast``: the step computes under bf16 autocast itself, what
    ``precision="bf16-mixed"`` should amount to."""

    def __init__(
        self,
        build_in_configure_model: bool = False,
        autocast: bool = False,
        hyperparameter: Any = None,
        two_optimizers: bool = False,
    ) -> None:
        super().__init__()
        self.two_optimizers = two_optimizers
        self.automatic_optimization = not two_optimizers  # Lightning's rule for several optimizers
        if hyperparameter is not None:
            self.save_hyperparameters({"hyperparameter": hyperparameter})
        self.autocast = autocast
        self.net = None if build_in_configure_model else layers()
        self.built_on = None if build_in_configure_model else "cpu"
        self.losses: dict[str, list[float]] = {"train": [], "val": [], "test": []}
        self.compute_dtypes: set[str] = set()

    def configure_model(self) -> None:
        if self.net is None:
            self.net = layers()
            self.built_on = str(self.net[0].weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def _loss(self, batch: Any, stage: str) -> torch.Tensor:
        x, y = batch
        self.compute_dtypes.add(str(self.net[0].weight.dtype))
        # enabled=False would switch off an autocast around the step: no context at all then
        with torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast else contextlib.nullcontext():
            loss = F.mse_loss(self(x), y)
        self.losses[stage].append(loss.item())
        return loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch, "train")
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch, "val"), sync_dist=True)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch, "test"), sync_dist=True)

    def configure_optimizers(self) -> Any:
        if self.two_optimizers:
            return [
                torch.optim.SGD(self.net[0].parameters(), lr=0.1),
                torch.optim.SGD(self.net[2].parameters(), lr=0.1),
            ]
        opt, scheduler = optimizer_and_scheduler(self)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def strategy(name: str, **options: Any) -> Any:
    """``"ddp"`` (Lightning's), or ``"stage<s>"``: ``ShardparStrategy(stage=s, **options)``."""
    if name == "ddp":
        return "ddp"
    return ShardparStrategy(stage=int(name.removeprefix("stage")), min_unit_params=UNIT_PARAMS, **options)


def synchronising_backwards(model: nn.Module) -> int | None:
    """How many backward passes reduced gradients (one all-reduce of the used-parameter flags
    each; passes under ``no_sync`` reduce nothing); None for a model shardpar did not wrap."""
    stats = model.comm_stats() if hasattr(model, "comm_stats") else None
    return None if stats is None else stats.get("used_flags", {}).get("calls", 0)


def full_params(trainer: L.Trainer, module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, on every rank (a collective under shardpar)."""
    model = trainer.strategy.model
    state = model.full_state_dict() if hasattr(model, "full_state_dict") else module.state_dict()
    return {name: tensor.detach().clone() for name, tensor in state.items()}


def fit(
    name: str,
    *,
    devices: int = 2,
    batch: int = BATCH,
    module_options: dict[str, Any] | None = None,
    ckpt_path: str | None = None,
    checkpoint_dir: str | None = None,
    test: bool = True,
    strategy_options: dict[str, Any] | None = None,
    **trainer_options: Any,
) -> dict[str, Any]:
    """``trainer.fit`` (then ``trainer.test``) of ``Regression(**module_options)``, built
    after seeding; what the parent compares."""
    with torchelastic_launched():
        torch.manual_seed(0)
        module = Regression(**(module_options or {}))
        callbacks = []
        if checkpoint_dir is not None:
            callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_top_k=-1, every_n_epochs=1))
        trainer = L.Trainer(
            strategy=strategy(name, **(strategy_options or {})),
            accelerator="cpu",
            devices=devices,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=checkpoint_dir is not None,
            num_sanity_val_steps=0,
            callbacks=callbacks,
            **{"max_epochs": 2, **trainer_options},
        )
        trainer.fit(module, train_dataloaders=loader(batch), val_dataloaders=loader(batch), ckpt_path=ckpt_path)
        syncs = synchronising_backwards(trainer.strategy.model)
        if test:
            trainer.test(module, dataloaders=loader(batch), verbose=False)
        return {
            **module.losses,
            "params": full_params(trainer, module),
            "built_on": module.built_on,
            "compute_dtypes": sorted(module.compute_dtypes),
            "global_step": trainer.global_step,
            "synchronising_backwards": syncs,
            "lr": [group["lr"] for group in trainer.optimizers[0].param_groups],
            "checkpoints": sorted(os.listdir(checkpoint_dir)) if checkpoint_dir is not None else [],
            "precision_state": trainer.precision_plugin.state_dict(),
        }


def test_only(name: str, ckpt_path: str, module_options: dict[str, Any] | None = None) -> list[float]:
    """``trainer.test(ckpt_path=...)`` of a fresh module and Trainer: the weights only."""
    with torchelastic_launched():
        torch.manual_seed(1)  # other values than the checkpoint's, were it not loaded
        module = Regression(**(module_options or {}))
        trainer = L.Trainer(
            strategy=strategy(name),
            accelerator="cpu",
            devices=2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.test(module, dataloaders=loader(), ckpt_path=ckpt_path, verbose=False)
        return module.losses["test"]


# --------------------------------------------------------------------------- Fabric

STEPS, MICRO_BATCHES, CLIP_VALUE = 4, 2, 0.01


def fabric_train(name: str, *, save_to: str | None = None, resume_from: str | None = None) -> dict[str, Any]:
    """A hand-written Fabric loop: ``MICRO_BATCHES`` micro-batches per step (all but the last
    under ``fabric.no_backward_sync``), ``fabric.clip_gradients`` by value, an LR scheduler;
    ``save_to``: ``fabric.save`` after step 2; ``resume_from``: ``fabric.load`` first, then the
    remaining steps."""
    with torchelastic_launched():
        chosen = (
            "ddp"
            if name == "ddp"
            else ShardparFabricStrategy(stage=int(name.removeprefix("stage")), min_unit_params=UNIT_PARAMS)
        )
        fabric = L.Fabric(strategy=chosen, accelerator="cpu", devices=2)
        fabric.launch()
        torch.manual_seed(0)
        module = layers()
        opt, scheduler = optimizer_and_scheduler(module)
        model, opt, scheduler = fabric.setup(module, opt, scheduler=scheduler)
        batches = list(fabric.setup_dataloaders(loader()))
        state = {"model": model, "optimizer": opt, "scheduler": scheduler, "step": 0}
        remainder = fabric.load(resume_from, state) if resume_from is not None else {}
        losses = []
        for step in range(state["step"], STEPS):
            for micro in range(MICRO_BATCHES):
                x, y = batches[(step * MICRO_BATCHES + micro) % len(batches)]
                with fabric.no_backward_sync(model, enabled=micro < MICRO_BATCHES - 1):
                    loss = F.mse_loss(model(x), y)
                    fabric.backward(loss / MICRO_BATCHES)
                losses.append(loss.item())
            fabric.clip_gradients(model, opt, clip_val=CLIP_VALUE)
            opt.step()
            opt.zero_grad()
            scheduler.step()
            state["step"] = step + 1
            if save_to is not None and state["step"] == 2:
                fabric.save(save_to, state)
        params = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
        return {
            "train": losses,
            "params": params,
            "remainder": remainder,
            "lr": scheduler.get_last_lr(),
            "synchronising_backwards": synchronising_backwards(model._forward_module),
        }


# --------------------------------------------------------------------------- refusals


def error_of(run: Any, *args: Any, **kwargs: Any) -> str:
    """``type: message`` of what ``run`` raised (it must raise)."""
    try:
        run(*args, **kwargs)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    raise AssertionError(f"{run.__name__} did not raise")


def refusals(directory: str, pickle_file: str) -> dict[str, Any]:
    """What must be refused, on every rank, and what it leaves behind."""
    unstorable = os.path.join(directory, "unstorable")
    return {
        # A hyperparameter JSON cannot hold: ModelCheckpoint's save fails before writing anything.
        "unstorable": error_of(
            fit,
            "stage2",
            module_options={"hyperparameter": object()},
            max_epochs=1,
            checkpoint_dir=unstorable,
            test=False,
        ),
        "unstorable_left": sorted(os.listdir(unstorable)) if os.path.isdir(unstorable) else [],
        # A Lightning checkpoint file (a pickle) is never unpickled.
        "pickle": error_of(fit, "stage2", ckpt_path=pickle_file, test=False),
        "two_optimizers": error_of(fit, "stage1", module_options={"two_optimizers": True}, test=False),
        "unknown_option": error_of(ShardparStrategy, stage=2, bucket_cap=25),
        "bad_stage": error_of(ShardparFabricStrategy, stage=4),
        "plugin": error_of(fit, "stage0", plugins=[_OwnPrecision()], test=False),
    }


class _OwnPrecision(L.pytorch.plugins.precision.Precision):
    """A precision plugin of the user's own: its behaviour is no ``precision=`` string."""
