"""Train a small character-level GPT with shardpar: parse, build, train.

    python recipes/train_gpt.py                                              # one process
    torchrun --standalone --nproc_per_node 2 recipes/train_gpt.py --stage 2  # two ranks

`--batch-size` is the global batch per optimizer step; each rank gets its own rows of it (see
recipes/data.py), so the loss curve does not depend on the world size or the stage.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script (`python recipes/train_gpt.py`): make the repository root importable
    # so that `recipes` and `shardpar` resolve without installing anything.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import shardpar
from recipes.common import (
    DistEnv, all_reduce_mean, dist_env, init_distributed, setup_device,
    setup_logging, warmup_cosine,
)
from recipes.data import CharDataset, load_dataset
from recipes.gpt import param_groups, small_gpt, tiny_gpt

log = logging.getLogger("train_gpt")


def _hf_llama(**kwargs: Any) -> torch.nn.Module:
    from recipes.hf_llama import hf_llama  # optional extra: imported only when asked for

    return hf_llama(**kwargs)


MODELS = {"tiny": tiny_gpt, "small": small_gpt, "hf-llama": _hf_llama}
PRECISIONS = {"none": None, "bf16": "bf16", "fp16": "fp16"}


def parse_args(argv: list[str] | None, env: DistEnv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--stage", type=int, choices=range(4), default=0, help="ZeRO stage (0 = DDP)")
    p.add_argument("--model", choices=MODELS, default="small")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="global sequences per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0 = off)")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps, then cosine")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--mixed-precision", choices=PRECISIONS, default="none")
    # Small buckets so that even this ~3 MB model spans several of them and reduction
    # overlaps backward; raise it for real models.
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=100, help="steps between val evals (0 = end only)")
    p.add_argument("--eval-iters", type=int, default=10, help="val batches per eval")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0 = never)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="where step-NNNNNNNN checkpoints go")
    p.add_argument("--resume", default=None,
                   help="checkpoint directory, or 'latest' for the newest valid one in --ckpt-dir")
    args = p.parse_args(argv)  # an unknown flag exits 2 with argparse's one-line error

    for name in ("steps", "batch_size", "grad_accum", "block_size", "log_every", "eval_iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.batch_size % (env.world_size * args.grad_accum):
        p.error(f"--batch-size {args.batch_size} must be divisible by world size {env.world_size} "
                f"x --grad-accum {args.grad_accum}")
    if args.save_every and args.ckpt_dir is None:
        p.error("--save-every needs --ckpt-dir")
    if args.resume == "latest" and args.ckpt_dir is None:
        p.error("--resume latest needs --ckpt-dir")
    return args


@dataclass
class Run:
    """Everything `train` needs, built once."""

    model: shardpar.ShardedModule
    opt: Any  # shardpar's optimizer wrapper
    sched: torch.optim.lr_scheduler.LambdaLR
    data: CharDataset
    start_step: int


def build(args: argparse.Namespace, env: DistEnv, device: torch.device) -> Run:
    torch.manual_seed(args.seed)  # identical init everywhere; wrap() also broadcasts rank 0's
    module = MODELS[args.model](block_size=args.block_size).to(device)
    log.info("%s model: %.2fM parameters, world size %d, stage %d",
             args.model, sum(p.numel() for p in module.parameters()) / 1e6, env.world_size, args.stage)
    model = shardpar.wrap(module, stage=args.stage, bucket_cap_mb=args.bucket_cap_mb,
                          mixed_precision=PRECISIONS[args.mixed_precision])
    opt = shardpar.optimizer(model, torch.optim.AdamW, param_groups(model), lr=args.lr,
                             weight_decay=args.weight_decay, betas=(0.9, 0.95))

    start_step = 0
    resume = shardpar.latest_checkpoint(args.ckpt_dir) if args.resume == "latest" else args.resume
    if resume is not None:
        extra = shardpar.load_checkpoint(str(resume), model, opt)
        start_step = int(extra["step"])
        log.info("resumed from %s at step %d", resume, start_step)
    elif args.resume == "latest":
        log.info("no checkpoint in %s yet; starting from scratch", args.ckpt_dir)

    # The schedule is a pure function of the step, so resuming needs no scheduler state: offset
    # it by start_step, and pin the base lr to --lr rather than whatever lr a checkpoint's
    # param_groups carried (LambdaLR would otherwise take the already-decayed lr as its base).
    for group in opt.param_groups:
        group["initial_lr"] = args.lr
    factor = warmup_cosine(args.warmup, args.steps)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor(s + start_step))
    return Run(model, opt, sched, load_dataset(), start_step)


def evaluate(run: Run, args: argparse.Namespace, env: DistEnv, device: torch.device) -> float:
    """Mean val loss over `--eval-iters` fixed global batches, averaged over ranks."""
    run.model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(args.eval_iters):
            x, y = run.data.get_batch(i, args.batch_size, args.block_size, env.rank,
                                      env.world_size, args.seed, split="val")
            total += run.model(x.to(device), y.to(device))[1].item()
    run.model.train()
    return all_reduce_mean(total / args.eval_iters, device)


def train(run: Run, args: argparse.Namespace, env: DistEnv, device: torch.device) -> dict[str, float]:
    """The optimizer-step loop; returns the numbers for the summary line."""
    model, opt = run.model, run.opt
    tokens_per_step = args.batch_size * args.block_size  # global
    first_loss = last_loss = float("nan")
    # Throughput counts only the step itself, not logging reductions, evals or checkpoints.
    train_time = interval_time = 0.0
    interval_steps = 0
    bar = tqdm(range(run.start_step, args.steps), initial=run.start_step, total=args.steps,
               desc="train", disable=env.rank != 0, dynamic_ncols=True)
    for step in bar:
        t0 = time.perf_counter()
        x, y = run.data.get_batch(step, args.batch_size, args.block_size, env.rank,
                                  env.world_size, args.seed)
        step_loss = torch.zeros((), device=device)  # stays on device: no sync per micro-step
        for micro, (mx, my) in enumerate(zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum))):
            # Only the last micro-batch's backward reduces; earlier ones just accumulate.
            last = micro == args.grad_accum - 1
            with contextlib.nullcontext() if last else model.no_sync():
                _, loss = model(mx.to(device), my.to(device))
                (loss / args.grad_accum).backward()
            step_loss += loss.detach() / args.grad_accum
        if args.clip > 0:
            model.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        run.sched.step()
        elapsed = time.perf_counter() - t0
        train_time += elapsed
        interval_time += elapsed
        interval_steps += 1
        done = step + 1

        if done % args.log_every == 0 or done == args.steps or step == run.start_step:
            last_loss = all_reduce_mean(step_loss.item(), device)  # every rank joins the reduction
            if step == run.start_step:
                first_loss = last_loss
            bar.set_postfix({"loss": f"{last_loss:.3f}", "lr": f"{run.sched.get_last_lr()[0]:.2e}",
                             "tok/s": f"{interval_steps * tokens_per_step / interval_time:,.0f}"})
            interval_time, interval_steps = 0.0, 0
        if args.eval_every and done % args.eval_every == 0 and done != args.steps:
            log.info("step %d: val loss %.4f", done, evaluate(run, args, env, device))
        if args.save_every and (done % args.save_every == 0 or done == args.steps):
            path = args.ckpt_dir / f"step-{done:08d}"
            shardpar.save_checkpoint(str(path), model, opt, extra={"step": done})
            log.info("saved %s", path)
    bar.close()
    steps_run = args.steps - run.start_step
    return {"first_loss": first_loss, "train_loss": last_loss,
            "val_loss": evaluate(run, args, env, device),
            "tokens_per_s": steps_run * tokens_per_step / train_time if train_time else float("nan")}


def memory_report(model: shardpar.ShardedModule) -> str:
    """Every rank's `model.memory_stats()` gathered to one string ('' if shardpar lacks it)."""
    if not hasattr(model, "memory_stats"):
        return ""
    stats = model.memory_stats()
    per_rank = [stats]
    if dist.is_initialized():
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, stats)

    def fmt(s: Any) -> str:
        # memory_stats() reports bytes; the recipe's model is small, so show MiB with decimals.
        if isinstance(s, dict):
            return " ".join(f"{k}={v / 2**20:.2f}MiB" if isinstance(v, int) else f"{k}={v}"
                            for k, v in s.items())
        return str(s)

    return " | mem " + "; ".join(f"rank{r}: {fmt(s)}" for r, s in enumerate(per_rank))


@record
def main(argv: list[str] | None = None) -> None:
    env = dist_env()
    setup_logging(env)
    args = parse_args(argv, env)
    if (args.save_every or args.resume) and not hasattr(shardpar, "save_checkpoint"):
        raise SystemExit("error: this shardpar has no save_checkpoint/load_checkpoint yet; "
                         "drop --save-every/--resume")
    device = setup_device(env)
    init_distributed(env, device)
    try:
        run = build(args, env, device)
        start = time.perf_counter()
        with logging_redirect_tqdm():
            result = train(run, args, env, device)
        wall = time.perf_counter() - start
        mem = memory_report(run.model)
        if env.is_main:
            print(f"done: {args.steps} steps, world {env.world_size}, stage {args.stage} | "
                  f"train loss {result['first_loss']:.4f} -> {result['train_loss']:.4f} | "
                  f"val loss {result['val_loss']:.4f} | {result['tokens_per_s']:,.0f} tok/s | "
                  f"wall {wall:.1f}s{mem}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
