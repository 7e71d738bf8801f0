"""The training half of recipes/train_gpt.py: build the model, optimizer, schedule and data
(resuming if asked), run the optimizer-step loop, print the summary.

train_gpt.py parses the command line without torch and hands the arguments to :func:`main`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

import shardpar
from recipes.common import (
    Checkpoints,
    DistEnv,
    RecipeError,
    all_reduce_mean,
    checkpoint_paths,
    config_errors,
    init_distributed,
    report_and_exit,
    resolve_resume,
    setup_device,
    setup_logging,
    warmup_cosine,
)
from recipes.data import CharDataset, load_dataset
from recipes.gpt import muon_and_adamw_params, param_groups, small_gpt, tiny_gpt

log = logging.getLogger("train_gpt")


def _hf_llama(**kwargs: Any) -> torch.nn.Module:
    # The optional extra (transformers): imported only when asked for.
    from recipes.hf_llama import hf_llama

    return hf_llama(**kwargs)


# train_gpt.MODELS and train_gpt.PRECISIONS name the keys.
FACTORIES = {"tiny": tiny_gpt, "small": small_gpt, "hf-llama": _hf_llama}
MIXED_PRECISION = {"none": None, "bf16": "bf16", "fp16": "fp16"}


@dataclass
class Run:
    """Everything `train` needs, built once."""

    model: shardpar.ShardedModule
    optimizers: dict[str, Any]
    """shardpar's optimizer wrappers, by name, in the order they step (see build_optimizers)."""
    schedules: list[torch.optim.lr_scheduler.LambdaLR]
    """One per optimizer, all the same function of the step."""
    data: CharDataset
    start_step: int


def build_optimizers(args: argparse.Namespace, model: shardpar.ShardedModule) -> dict[str, Any]:
    """The optimizers ``--optimizer`` names, by the name their checkpoints go under.

    ``muon``: ``torch.optim.Muon`` over the blocks' weight matrices and AdamW over the rest,
    two ``shardpar.optimizer`` calls over one model as nanochat trains. Muon's update reads a
    whole matrix, so at stages 1-3 each matrix is owned whole by one rank, which alone holds
    its momentum and runs its Newton-Schulz (docs/user-guide.md, "Which optimizers run at which
    stage"); AdamW's parameters are sliced as usual. Muon's ``match_rms_adamw`` scaling lets
    both take ``--lr`` and ``--weight-decay`` (Moonlight's recipe).
    """
    adamw = {"lr": args.lr, "weight_decay": args.weight_decay, "betas": (0.9, 0.95)}
    if args.optimizer == "adamw":
        return {"adamw": shardpar.optimizer(model, torch.optim.AdamW, param_groups(model), **adamw)}
    matrices, rest = muon_and_adamw_params(model)
    muon = {"lr": args.lr, "weight_decay": args.weight_decay, "adjust_lr_fn": "match_rms_adamw"}
    return {
        "muon": shardpar.optimizer(model, torch.optim.Muon, matrices, **muon),
        "adamw": shardpar.optimizer(model, torch.optim.AdamW, rest, **adamw),
    }


def build(args: argparse.Namespace, env: DistEnv, device: torch.device) -> Run:
    """Model, optimizer, schedule and data, resumed if asked; bad input is a RecipeError."""
    resume = resolve_resume(args.resume, args.ckpt_dir)  # before any work: fail fast
    torch.manual_seed(args.seed)  # identical init everywhere; wrap() also broadcasts rank 0's
    module = FACTORIES[args.model](block_size=args.block_size).to(device)
    log.info(
        "%s model: %.2fM parameters, world size %d",
        args.model,
        sum(p.numel() for p in module.parameters()) / 1e6,
        env.world_size,
    )
    options, context = {}, ""
    if args.stage == "auto":
        options, context = {"memory_budget": args.memory_budget}, f"--memory-budget {args.memory_budget}"
    if args.timeout_s is not None:
        options["timeout_s"] = args.timeout_s
    with config_errors(ValueError, context=context):  # e.g. a budget no stage fits
        model = shardpar.wrap(
            module,
            stage=args.stage,
            bucket_cap_mb=args.bucket_cap_mb,
            mixed_precision=MIXED_PRECISION[args.mixed_precision],
            **options,
        )
    log.info(
        "stage %d%s",
        model.stage,
        f" (--stage auto: the lowest that fits {args.memory_budget} per rank)" if context else "",
    )
    optimizers = build_optimizers(args, model)

    start_step = 0
    if resume is not None:
        with config_errors(shardpar.CheckpointError):  # corrupt, or another model's or optimizer's checkpoint
            for path, opt in zip(checkpoint_paths(resume, optimizers), optimizers.values()):
                extra = shardpar.load_checkpoint(str(path), model, opt)
        start_step = int(extra["step"])
        log.info("resumed from %s at step %d", resume, start_step)
        if start_step >= args.steps:
            log.info("the checkpoint is at or past --steps %d: nothing left to train", args.steps)
    elif args.resume == "latest":
        log.info("no checkpoint in %s yet; starting from scratch", args.ckpt_dir)

    # The schedule is a pure function of the step, so resuming needs no scheduler state: offset
    # it by start_step, and pin the base lr to --lr rather than whatever lr a checkpoint's
    # param_groups carried (LambdaLR would otherwise take the already-decayed lr as its base).
    factor = warmup_cosine(args.warmup, args.steps)
    schedules = []
    for opt in optimizers.values():
        for group in opt.param_groups:
            group["initial_lr"] = args.lr
        schedules.append(torch.optim.lr_scheduler.LambdaLR(opt, lambda s: factor(s + start_step)))
    return Run(model, optimizers, schedules, load_dataset(), start_step)


def evaluate(run: Run, args: argparse.Namespace, env: DistEnv, device: torch.device) -> float:
    """Mean val loss over `--eval-iters` fixed global batches, averaged over ranks."""
    run.model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(args.eval_iters):
            x, y = run.data.get_batch(
                i, args.batch_size, args.block_size, env.rank, env.world_size, args.seed, split="val"
            )
            total += run.model(x.to(device), y.to(device))[1].item()
    run.model.train()
    return all_reduce_mean(total / args.eval_iters, device)


def train(run: Run, args: argparse.Namespace, env: DistEnv, device: torch.device) -> dict[str, float]:
    """The optimizer-step loop; returns the numbers for the summary line."""
    model = run.model
    tokens_per_step = args.batch_size * args.block_size  # global
    first_loss = last_loss = float("nan")
    # Throughput counts only the step itself, not logging reductions, evals or checkpoints.
    train_time = interval_time = 0.0
    interval_steps = 0
    bar = tqdm(
        range(run.start_step, args.steps),
        initial=run.start_step,
        total=args.steps,
        desc="train",
        disable=env.rank != 0,
        dynamic_ncols=True,
    )
    checkpoints = Checkpoints(args.ckpt_dir, args.async_save, args.keep_last, env) if args.save_every else None
    for step in bar:
        t0 = time.perf_counter()
        x, y = run.data.get_batch(step, args.batch_size, args.block_size, env.rank, env.world_size, args.seed)
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
        for opt in run.optimizers.values():
            opt.step()
            opt.zero_grad()
        for schedule in run.schedules:
            schedule.step()
        elapsed = time.perf_counter() - t0
        train_time += elapsed
        interval_time += elapsed
        interval_steps += 1
        done = step + 1

        if done % args.log_every == 0 or done == args.steps or step == run.start_step:
            last_loss = all_reduce_mean(step_loss.item(), device)  # every rank joins the reduction
            if step == run.start_step:
                first_loss = last_loss
            bar.set_postfix(
                {
                    "loss": f"{last_loss:.3f}",
                    "lr": f"{run.schedules[0].get_last_lr()[0]:.2e}",
                    "tok/s": f"{interval_steps * tokens_per_step / interval_time:,.0f}",
                }
            )
            interval_time, interval_steps = 0.0, 0
        # Save before evaluating, so that a failure during the eval loses no training. The last
        # step always saves, so the final parameters are on disk for comparing runs.
        if checkpoints is not None and (done % args.save_every == 0 or done == args.steps):
            checkpoints.save(model, run.optimizers, done, extra={"step": done})
        if args.eval_every and done % args.eval_every == 0 and done != args.steps:
            log.info("step %d: val loss %.4f", done, evaluate(run, args, env, device))
    bar.close()
    steps_run = args.steps - run.start_step
    result = {
        "first_loss": first_loss,
        "train_loss": last_loss,
        "val_loss": evaluate(run, args, env, device),  # while the last checkpoint may still be written
        "tokens_per_s": steps_run * tokens_per_step / train_time if train_time else float("nan"),
    }
    if checkpoints is not None:
        checkpoints.finish()  # the summary line means the last checkpoint is complete
    return result


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
            return " ".join(f"{k}={v / 2**20:.2f}MiB" if isinstance(v, int) else f"{k}={v}" for k, v in s.items())
        return str(s)

    return " | mem " + "; ".join(f"rank{r}: {fmt(s)}" for r, s in enumerate(per_rank))


@record
def main(args: argparse.Namespace, env: DistEnv) -> None:
    """Build and train as recipes/train_gpt.py parsed ``args``; print the summary on rank 0."""
    setup_logging(env)
    try:
        device = setup_device(env, args.device)
    except RecipeError as error:
        report_and_exit(error, env)
    init_distributed(env, device, args.timeout_s)
    try:
        try:
            run = build(args, env, device)
        except RecipeError as error:  # bad input only: bugs keep their traceback
            report_and_exit(error, env)
        start = time.perf_counter()
        with logging_redirect_tqdm():
            result = train(run, args, env, device)
        wall = time.perf_counter() - start
        mem = memory_report(run.model)
        if env.is_main:
            # Six decimals: enough to compare runs (a resumed one, another world size) closely.
            print(
                f"done: {args.steps} steps, world {env.world_size}, stage {run.model.stage} | "
                f"train loss {result['first_loss']:.6f} -> {result['train_loss']:.6f} | "
                f"val loss {result['val_loss']:.6f} | {result['tokens_per_s']:,.0f} tok/s | "
                f"wall {wall:.1f}s{mem}",
                flush=True,
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
