"""Train the character-level GPT of recipes/gpt.py with Lightning's Trainer, sharded by shardpar.

    torchrun --standalone --nproc_per_node 2 recipes/lightning_gpt.py --stage 2   # torchrun starts the ranks
    python recipes/lightning_gpt.py --devices 2 --stage 3                          # Lightning starts them

A Lightning script as any other: a LightningModule, a Trainer, ModelCheckpoint and
``ckpt_path=`` to resume. What shardpar changes is marked ``# shardpar``: the strategy, and the
model built in ``configure_model`` (on the meta device under shardpar, so at stage 3 no rank
ever holds the whole model) with the initialisation ``shardpar.wrap`` gives it there.
Data follows recipes/data.py's rule: step s's global batch depends on (seed, s) only and rank r
takes its rows of it, so the loss curve does not depend on the world size or the stage.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `recipes` and `shardpar` without installing

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from recipes.common import warmup_cosine
from recipes.data import load_dataset
from recipes.gpt import GPT, MLP, CausalSelfAttention, param_groups, small_gpt, tiny_gpt
from shardpar.integrations.lightning import ShardparStrategy  # shardpar

MODELS = {"tiny": tiny_gpt, "small": small_gpt}


class Batches(IterableDataset):
    """This rank's rows of the global batch of steps ``first`` .. ``last - 1`` (recipes/data.py's
    rule). A resumed run starts at the step it stopped at: Lightning restores ``global_step``
    before it asks for the data."""

    def __init__(self, args: argparse.Namespace, trainer: L.Trainer, split: str, first: int, last: int) -> None:
        self.args, self.split, self.first, self.last = args, split, first, last
        self.rank, self.world_size = trainer.global_rank, trainer.world_size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        data = load_dataset()
        for step in range(self.first, self.last):
            yield data.get_batch(
                step, self.args.batch_size, self.args.block_size, self.rank, self.world_size, self.args.seed, self.split
            )


class GPTModule(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.model: GPT | None = None
        self.first_loss: float | None = None

    def configure_model(self) -> None:
        if self.model is None:  # shardpar: built on the meta device, materialised by the wrap
            self.model = MODELS[self.args.model](block_size=self.args.block_size)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, loss = self.model(*batch)
        if self.first_loss is None:  # the mean over ranks, as the logged value: the global batch's loss
            self.first_loss = self.trainer.strategy.reduce(loss.detach()).item()
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        _, loss = self.model(*batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(param_groups(self.model, self.args.weight_decay), lr=self.args.lr, betas=(0.9, 0.95))
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(self.args.warmup, self.args.steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            Batches(self.args, self.trainer, "train", self.trainer.global_step, self.args.steps), batch_size=None
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Batches(self.args, self.trainer, "val", 0, self.args.eval_iters), batch_size=None)


def gpt2_init(n_layer: int):  # shardpar
    """GPT._init_weights one module at a time, as ``shardpar.wrap``'s ``init_fn`` (a GPT built
    on the meta device is initialised module by module): normal(0.02) weights, zero biases, and
    the residual projections scaled by 1/sqrt(2 n_layer), set when their parent (visited after
    its children) comes."""
    resid_std = 0.02 / math.sqrt(2 * n_layer)

    def init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, (CausalSelfAttention, MLP)):
            nn.init.normal_(module.proj.weight, mean=0.0, std=resid_std)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    return init


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument(
        "--devices",
        type=int,
        default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        help="processes on this machine (under torchrun: its --nproc_per_node)",
    )
    p.add_argument("--model", choices=MODELS, default="small")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=64, help="global sequences per step")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=6e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--precision", choices=("32-true", "bf16-mixed"), default="32-true")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-iters", type=int, default=10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--ckpt-dir", type=Path, default=None, help="ModelCheckpoint's directory (every --eval-every steps)")
    p.add_argument("--resume", default=None, help="a checkpoint to resume from, or 'last' (the newest in --ckpt-dir)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    checkpoints = (
        [ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.eval_every, save_top_k=-1, save_last=True)]
        if args.ckpt_dir
        else []
    )
    with torch.device("meta"):
        n_layer = MODELS[args.model]().config.n_layer
    trainer = L.Trainer(
        strategy=ShardparStrategy(stage=args.stage, init_fn=gpt2_init(n_layer)),  # shardpar (was: strategy="ddp")
        devices=args.devices,
        precision=args.precision,
        max_steps=args.steps,
        gradient_clip_val=args.clip or None,
        val_check_interval=min(args.eval_every, args.steps),
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=bool(checkpoints),
        callbacks=checkpoints,
    )
    module = GPTModule(args)
    trainer.fit(module, ckpt_path=args.resume)
    metrics = trainer.callback_metrics
    if trainer.is_global_zero:
        print(
            f"done: {trainer.global_step} steps, world {trainer.world_size}, stage {args.stage} | "
            f"train loss {module.first_loss:.6f} -> {metrics['train_loss'].item():.6f} | "
            f"val loss {metrics['val_loss'].item():.6f}"
        )


if __name__ == "__main__":
    main()
