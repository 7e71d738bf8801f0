"""Fine-tune a Hugging Face causal LM from local weights, loaded straight into shardpar's shards.

    python -m recipes.finetune_hf --make-pretrained pretrained        # a tiny local "pretrained" Llama
    torchrun --standalone --nproc_per_node 2 -m recipes.finetune_hf \\
        --pretrained pretrained --out finetuned --stage 3 --export     # two ranks, ZeRO-3

`--pretrained DIR` is a Hugging Face model directory (`config.json` plus `model.safetensors`, or
shards and `model.safetensors.index.json`); nothing is downloaded. The model is built from the
config under `torch.device("meta")`, `shardpar.wrap` materialises it unit by unit (at stage 3 a
rank only ever holds its shards plus the unit being built), and `shardpar.load_pretrained`
reads only the bytes each rank keeps: the full model never exists on one rank. It then trains on
recipes/data.py's character corpus (ids are the characters, so the model's vocabulary must cover
recipes.data.VOCAB) and saves a shardpar checkpoint to `OUT/step-NNNNNNNN`, plus, with
`--export`, the whole model in the Hugging Face layout to `OUT/hf`.

Rank 0 prints what the load matched, the loss every `--log-every` steps (step 0 is the
pretrained model's loss on the first batch, before any update) and one summary line. A
checkpoint the model cannot fully load from (missing keys, without `--allow-missing`), or bad
files, are answered with one `error: ...` line and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script (`python recipes/finetune_hf.py`): make the repository root importable.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.elastic.multiprocessing.errors import record

import shardpar
from recipes.cli import ArgumentParser, DistEnv, add_device_flag, dist_env, pin_device
from recipes.common import (
    RecipeError,
    all_reduce_mean,
    config_errors,
    init_distributed,
    report_and_exit,
    setup_device,
    setup_logging,
    warmup_cosine,
)
from recipes.data import VOCAB_SIZE, CharDataset, load_dataset
from recipes.gpt import param_groups

try:
    import transformers
except ImportError as error:  # optional extra
    raise ImportError('recipes/finetune_hf.py needs Hugging Face transformers: pip install -e ".[hf]"') from error

log = logging.getLogger("finetune_hf")

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
"""One of these next to config.json makes a directory a Hugging Face model."""


# --------------------------------------------------------------------------- the pretrained model


def tiny_llama_config() -> transformers.LlamaConfig:
    """A Llama of ~0.1M parameters over the recipe's 96 characters, LM head tied to the embedding."""
    return transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        use_cache=False,
    )


def write_tiny_pretrained(directory: str | Path, seed: int = 0, steps: int = 10) -> Path:
    """Write a small "pretrained" model where a download would put one: ``config.json`` and
    ``model.safetensors`` from ``save_pretrained``.

    The model is built from :func:`tiny_llama_config` on CPU and trained for ``steps`` steps in
    this process (plain torch, a second or two) on batches drawn with ``seed``. So its weights
    are unlike any fresh initialisation (its loss is already below uniform's ln 96 = 4.56), and a
    fine-tune whose first loss equals this model's has loaded them; yet it is far from converged,
    so a few fine-tuning steps visibly lower the loss. (The recipe's ``--seed`` defaults to 1337,
    so the fine-tune's batches are new to it.)
    """
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    data = load_dataset()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(steps):
        x, y = data.get_batch(step, 16, 64, rank=0, world_size=1, seed=seed)
        causal_lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(directory)
    return Path(directory)


# --------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None, env: DistEnv) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    todo = p.add_mutually_exclusive_group(required=True)
    todo.add_argument("--pretrained", type=Path, metavar="DIR", help="Hugging Face model directory to fine-tune")
    todo.add_argument(
        "--make-pretrained",
        type=Path,
        metavar="DIR",
        help="write a tiny pretrained Llama to DIR and exit (one process)",
    )
    p.add_argument("--out", type=Path, help="where step-NNNNNNNN checkpoints (and hf/ with --export) go")
    p.add_argument("--stage", type=int, choices=(0, 1, 2, 3), default=3, help="ZeRO stage (0 = DDP)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=16, help="global sequences per optimizer step")
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0, help="global grad-norm clip (0 = off)")
    p.add_argument("--warmup", type=int, default=2, help="linear warmup steps, then cosine")
    p.add_argument("--seed", type=int, default=1337, help="batches, and the init of what the checkpoint lacks")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0 = the last only)")
    p.add_argument("--export", action="store_true", help="also write the model in the Hugging Face layout to OUT/hf")
    p.add_argument(
        "--allow-missing",
        action="store_true",
        help="train even if the checkpoint lacks some of the model's tensors (they keep their init)",
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="seconds a collective waits for a missing rank (default: shardpar's, 300)",
    )
    add_device_flag(p)
    args = p.parse_args(argv)  # an unknown flag exits 2 with one `error:` line

    if args.make_pretrained is not None:
        if env.world_size != 1:
            p.error("--make-pretrained runs in one process: python -m recipes.finetune_hf --make-pretrained DIR")
        return args
    if args.out is None:
        p.error("--pretrained needs --out")
    for name in ("steps", "batch_size", "block_size", "log_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.batch_size % env.world_size:
        p.error(f"--batch-size {args.batch_size} must be divisible by world size {env.world_size}")
    if args.timeout_s is not None and not args.timeout_s > 0:
        p.error("--timeout-s must be positive")
    if not (args.pretrained / "config.json").is_file():
        p.exit(2, f"error: --pretrained {args.pretrained}: no config.json there\n")
    if not any((args.pretrained / name).is_file() for name in WEIGHT_FILES):
        p.exit(2, f"error: --pretrained {args.pretrained}: no {' or '.join(WEIGHT_FILES)} there\n")
    return args


# --------------------------------------------------------------------------- build, train


def causal_lm_loss(lm: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy. ``targets`` are already the next characters
    (recipes/data.py), so they are not passed as ``labels=``, which transformers would shift again."""
    logits = lm(input_ids=idx, use_cache=False).logits  # (batch, time, vocab)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def block_classes(module: nn.Module) -> list[type[nn.Module]]:
    """The model's transformer blocks (``_no_split_modules``, e.g. LlamaDecoderLayer): one
    stage-3 unit each, so a rank gathers one block's parameters at a time."""
    names = set(getattr(module, "_no_split_modules", None) or ())
    return sorted({type(m) for m in module.modules() if type(m).__name__ in names}, key=lambda c: c.__name__)


def build(args: argparse.Namespace, env: DistEnv) -> tuple[shardpar.ShardedModule, shardpar.ShardedOptimizer]:
    """The wrapped model holding the pretrained weights, and its optimizer; bad input is a RecipeError."""
    where = f"--pretrained {args.pretrained}"
    with config_errors(OSError, ValueError, context=where):  # unreadable config, unknown model type
        config = transformers.AutoConfig.from_pretrained(args.pretrained)
    if getattr(config, "vocab_size", 0) < VOCAB_SIZE:
        raise RecipeError(
            f"{where}: vocab_size {getattr(config, 'vocab_size', None)} does not cover the "
            f"recipe's {VOCAB_SIZE} characters"
        )
    with torch.device("meta"):  # no memory: shapes only
        module = transformers.AutoModelForCausalLM.from_config(config)
    torch.manual_seed(args.seed)  # the init of anything the checkpoint lacks
    options = {} if args.timeout_s is None else {"timeout_s": args.timeout_s}
    model = shardpar.wrap(
        module, stage=args.stage, init_fn=module._init_weights, wrap_policy=block_classes(module), **options
    )
    with config_errors(shardpar.CheckpointError, context=where):  # damaged files, wrong shapes
        # strict=False: unexpected keys are reported, as transformers does; missing ones fail below.
        result = shardpar.load_pretrained(model, args.pretrained, strict=False)
    log.info(
        "%s from %s: %.2fM parameters, stage %d, world size %d",
        type(module).__name__,
        args.pretrained,
        sum(p.numel() for p in model.parameters()) / 1e6,
        model.stage,
        env.world_size,
    )
    if env.is_main:
        print(
            f"loaded {args.pretrained}: missing keys {result.missing_keys}, unexpected keys {result.unexpected_keys}",
            flush=True,
        )
    if result.missing_keys and not args.allow_missing:
        raise RecipeError(
            f"{where} lacks {len(result.missing_keys)} of the model's tensors "
            f"({', '.join(result.missing_keys[:5])}{', ...' if len(result.missing_keys) > 5 else ''}); "
            "pass --allow-missing to train them from their initialisation"
        )
    opt = shardpar.optimizer(
        model, torch.optim.AdamW, param_groups(model), lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.95)
    )
    return model, opt


def save(model: shardpar.ShardedModule, opt: shardpar.ShardedOptimizer, out: Path, step: int) -> Path:
    path = out / f"step-{step:08d}"  # the names shardpar.latest_checkpoint looks for
    shardpar.save_checkpoint(str(path), model, opt, extra={"step": step})
    log.info("saved %s", path)
    return path


def finetune(
    model: shardpar.ShardedModule,
    opt: shardpar.ShardedOptimizer,
    data: CharDataset,
    args: argparse.Namespace,
    env: DistEnv,
    device: torch.device,
) -> tuple[float, float]:
    """The optimizer-step loop; returns the (rank-averaged) loss of the first and last step."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    first = last = math.nan
    for step in range(args.steps):
        # This rank's rows of the step's global batch: the same data at any world size.
        x, y = data.get_batch(step, args.batch_size, args.block_size, env.rank, env.world_size, args.seed)
        loss = causal_lm_loss(model, x.to(device), y.to(device))
        loss.backward()
        if args.clip > 0:
            model.clip_grad_norm_(args.clip)
        opt.step()
        opt.zero_grad()
        lr = sched.get_last_lr()[0]  # the lr this step used
        sched.step()
        done = step + 1
        if step == 0 or done % args.log_every == 0 or done == args.steps:
            last = all_reduce_mean(loss.item(), device)  # every rank joins the reduction
            first = last if step == 0 else first
            if env.is_main:
                print(f"step {step}: loss {last:.6f} lr {lr:.2e}", flush=True)
        if args.save_every and done % args.save_every == 0 and done != args.steps:
            save(model, opt, args.out, done)
    return first, last


@record
def main(argv: list[str] | None = None) -> None:
    env = dist_env()
    args = parse_args(argv, env)
    pin_device(args.device)  # nothing has touched CUDA yet: --device cpu hides the GPUs
    if args.make_pretrained is not None:
        print(f"wrote {write_tiny_pretrained(args.make_pretrained)}", flush=True)
        return
    setup_logging(env)
    data = load_dataset()
    try:
        device = setup_device(env, args.device)
    except RecipeError as error:
        report_and_exit(error, env)
    init_distributed(env, device, args.timeout_s)
    try:
        try:
            model, opt = build(args, env)
        except RecipeError as error:  # bad input only: bugs keep their traceback
            report_and_exit(error, env)
        start = time.perf_counter()
        first, last = finetune(model, opt, data, args, env, device)
        wall = time.perf_counter() - start
        save(model, opt, args.out, args.steps)
        if args.export:
            shardpar.save_full(str(args.out / "hf"), model)  # every rank sends, rank 0 writes
            log.info("exported %s", args.out / "hf")
        if env.is_main:
            print(
                f"done: {args.steps} steps, world {env.world_size}, stage {model.stage} | "
                f"train loss {first:.6f} -> {last:.6f} | wall {wall:.1f}s",
                flush=True,
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
