"""Train a small character-level GPT with shardpar: parse, build, train.

    python recipes/train_gpt.py                                              # one process
    torchrun --standalone --nproc_per_node 2 recipes/train_gpt.py --stage 2  # two ranks
    torchrun ... recipes/train_gpt.py --stage auto --memory-budget 2MB       # planner picks

Bad input (an unknown flag, a memory budget no stage fits, a --resume without a checkpoint) is
answered with one `error: ...` line and exit status 2; flags are checked before torch is
imported, so a typo costs no start-up time. The build and the training loop are in
recipes/trainer.py.

`--batch-size` is the global batch per optimizer step; each rank gets its own rows of it (see
recipes/data.py), so the loss curve does not depend on the world size or the stage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a script (`python recipes/train_gpt.py`): make the repository root importable
    # so that `recipes` and `shardpar` resolve without installing anything.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Nothing imported here imports torch: see main().
from recipes.cli import ArgumentParser, DistEnv, add_device_flag, dist_env, pin_device, resume_dir_problem

MODELS = ("tiny", "small", "hf-llama")
"""--model choices; recipes/trainer.py maps them to factories."""
PRECISIONS = ("none", "bf16", "fp16")
OPTIMIZERS = ("adamw", "muon")
"""--optimizer choices: AdamW over every parameter, or torch.optim.Muon over the blocks' weight
matrices and AdamW over the rest (recipes/trainer.py's build_optimizers)."""


def _stage(text: str) -> int | str:
    if text == "auto":
        return text
    if text in ("0", "1", "2", "3"):
        return int(text)
    raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from 0, 1, 2, 3, auto)")


def parse_args(argv: list[str] | None, env: DistEnv) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--stage",
        type=_stage,
        default=0,
        metavar="{0,1,2,3,auto}",
        help="ZeRO stage 0-3 (0 = DDP), or 'auto': the lowest that fits --memory-budget",
    )
    p.add_argument(
        "--memory-budget", default=None, help="per-rank bytes for --stage auto, e.g. 2MB (decimal) or 512MiB (binary)"
    )
    p.add_argument("--model", choices=MODELS, default="small")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=64, help="global sequences per optimizer step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--block-size", type=int, default=64, help="context length in characters")
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="adamw: AdamW over every parameter; muon: torch.optim.Muon over the blocks' 2-D weight matrices "
        "and AdamW over the embeddings, norms and biases (two optimizers, as nanochat trains), at any --stage",
    )
    p.add_argument("--lr", type=float, default=6e-3, help="peak learning rate (Muon's too, scaled to match AdamW)")
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
    p.add_argument(
        "--async-save",
        action="store_true",
        help="write checkpoints in the background: training goes on after each save's copy to host "
        "memory (shardpar.save_checkpoint(..., async_save=True))",
    )
    p.add_argument(
        "--keep-last",
        type=int,
        default=0,
        metavar="K",
        help="once a checkpoint is complete, delete all but the newest K in --ckpt-dir (0 = keep all)",
    )
    p.add_argument(
        "--resume", default=None, help="checkpoint directory, or 'latest' for the newest valid one in --ckpt-dir"
    )
    p.add_argument(
        "--timeout-s",
        type=float,
        default=None,
        help="seconds a collective waits for a missing rank (default: shardpar's, 300)",
    )
    add_device_flag(p)
    args = p.parse_args(argv)  # an unknown flag exits 2 with one `error:` line

    for name in ("steps", "batch_size", "grad_accum", "block_size", "log_every", "eval_iters"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.batch_size % (env.world_size * args.grad_accum):
        p.error(
            f"--batch-size {args.batch_size} must be divisible by world size {env.world_size} "
            f"x --grad-accum {args.grad_accum}"
        )
    if args.timeout_s is not None and not args.timeout_s > 0:
        p.error("--timeout-s must be positive")
    if args.save_every and args.ckpt_dir is None:
        p.error("--save-every needs --ckpt-dir")
    if args.keep_last < 0:
        p.error("--keep-last must be 0 (keep all) or positive")
    for flag, value in (("--async-save", args.async_save), ("--keep-last", args.keep_last)):
        if value and not args.save_every:
            p.error(f"{flag} needs --save-every")
    if args.resume == "latest" and args.ckpt_dir is None:
        p.error("--resume latest needs --ckpt-dir")
    if (args.stage == "auto") != (args.memory_budget is not None):
        p.error("--stage auto and --memory-budget go together")
    if args.resume not in (None, "latest") and (problem := resume_dir_problem(args.resume)):
        p.exit(2, f"error: {problem}\n")
    return args


def main(argv: list[str] | None = None) -> None:
    env = dist_env()
    args = parse_args(argv, env)
    pin_device(args.device)  # before torch is imported: --device cpu hides the GPUs
    from recipes import trainer  # torch, shardpar, the model: seconds to import

    trainer.main(args, env)


def __getattr__(name: str) -> Any:
    # `train_gpt.build`, `train_gpt.train`, ...: the training half, imported when first used.
    if name in ("Run", "build", "evaluate", "train", "memory_report"):
        from recipes import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if __name__ == "__main__":
    main()
