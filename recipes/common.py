"""Helpers shared by the recipes: one-line errors for bad input, rank/device discovery,
rank-aware logging, lr schedule, checkpoint discovery, saving with keep-last rotation. Plain
torch plus shardpar's public API; nothing here depends on shardpar internals. (The torch-free
part is recipes/cli.py.)"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

import shardpar
from recipes.cli import MANIFEST, ArgumentParser, DistEnv, dist_env, resume_dir_problem
from shardpar.comm import compat

__all__ = [
    "ArgumentParser",
    "Checkpoints",
    "DistEnv",
    "RecipeError",
    "all_reduce_mean",
    "checkpoint_paths",
    "config_errors",
    "dist_env",
    "init_distributed",
    "remove_old_checkpoints",
    "report_and_exit",
    "resolve_resume",
    "setup_device",
    "setup_logging",
    "warmup_cosine",
]

log = logging.getLogger(__name__)


class RecipeError(Exception):
    """Bad input met after parsing (a memory budget no stage fits, a ``--resume`` without a
    checkpoint): the entry point reports it as one ``error:`` line and exits 2.

    Only code wrapped in :func:`config_errors` raises it, so an unexpected exception anywhere
    else (a bug) keeps its traceback.
    """


@contextlib.contextmanager
def config_errors(*kinds: type[BaseException], context: str = "") -> Iterator[None]:
    """Turn ``kinds`` raised inside the block into :class:`RecipeError` (same message, after
    ``context: `` if given, e.g. the flag that caused it).

    Use it around calls whose errors of these kinds mean bad input, such as ``shardpar.wrap``'s
    ``ValueError`` for a budget, or ``shardpar.CheckpointError`` from loading a checkpoint.
    """
    try:
        yield
    except kinds as error:
        raise RecipeError(f"{context}: {error}" if context else str(error)) from error


def report_and_exit(error: RecipeError, env: DistEnv) -> NoReturn:
    """One ``error: ...`` line on stderr, then exit 2.

    Every rank meets the same bad input (shardpar raises its errors on every rank), so rank 0
    prints it plainly and the others log it tagged with their rank, in case theirs differs.
    """
    if env.is_main:
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        log.error("%s", error)
    raise SystemExit(2)


def setup_logging(env: DistEnv) -> None:
    """Tag every record with the rank; ranks other than 0 only report WARNING and above.

    Errors from any rank still reach the user, while progress is printed once.
    """
    logging.basicConfig(
        level=logging.INFO if env.is_main else logging.WARNING,
        format=f"[rank{env.rank}] %(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    # Python warnings (ours, torch's) go through the same records: tagged with the rank, and
    # shown from every rank since WARNING passes on all of them.
    logging.captureWarnings(True)


def setup_device(env: DistEnv, choice: str = "auto") -> torch.device:
    """The device ``--device`` names (recipes/cli.py ``DEVICES``): ``cuda:LOCAL_RANK`` (made
    current) for ``cuda``, and for ``auto`` when CUDA is available; else the CPU.

    A rank without a GPU of its own is a :class:`RecipeError` naming both counts, not a crash
    deep inside NCCL (two ranks on a one-GPU machine: run with ``--device cpu``).
    """
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RecipeError(
            "--device cuda: no CUDA device is visible (torch.cuda.is_available() is False); use --device cpu or auto"
        )
    count = torch.cuda.device_count()
    if env.local_rank >= count:
        raise RecipeError(
            f"--device {choice}: local rank {env.local_rank} needs a GPU of its own but only {count} "
            f"CUDA device(s) are visible; start at most {count} rank(s) per node, or use --device cpu"
        )
    device = torch.device("cuda", env.local_rank)
    # Must precede any CUDA work so NCCL and allocations land on this rank's GPU.
    torch.cuda.set_device(device)
    return device


def init_distributed(env: DistEnv, device: torch.device, timeout_s: float | None = None) -> None:
    """Create the default process group under torchrun (gloo on CPU, NCCL on CUDA).

    shardpar.wrap would do this itself, but the recipe needs the group earlier for its own
    logging reductions, and binding `device_id` lets NCCL set up eagerly on the right GPU.
    Collectives give up after ``timeout_s`` (default shardpar's ``ShardConfig.timeout_s``, as
    the group wrap would make; gloo's own default is 30 minutes of a hung rank).
    """
    if env.world_size == 1 or dist.is_initialized():
        return
    dist.init_process_group(
        backend=compat.default_backend_for_device(device),
        device_id=device if device.type == "cuda" else None,
        timeout=datetime.timedelta(seconds=timeout_s or shardpar.ShardConfig.timeout_s),
    )


def resolve_resume(resume: str | None, ckpt_dir: Path | None) -> Path | None:
    """The checkpoint ``--resume`` names, or None to start from scratch.

    ``latest`` is the newest valid checkpoint in ``ckpt_dir``, or None if there is none yet (an
    empty or missing directory: the first attempt of a restartable run). Any other value is a
    checkpoint directory, or a directory of them (its newest valid one is taken); one that holds
    no checkpoint is a :class:`RecipeError`.
    """
    if resume is None:
        return None
    if resume == "latest":
        if ckpt_dir is None:
            raise RecipeError("--resume latest needs --ckpt-dir")
        return shardpar.latest_checkpoint(ckpt_dir)
    problem = resume_dir_problem(resume)
    if problem is not None:
        raise RecipeError(problem)
    path = Path(resume)
    if (path / MANIFEST).is_file():
        return path  # load_checkpoint checks the rest, and names what is wrong
    newest = shardpar.latest_checkpoint(path)
    if newest is None:
        raise RecipeError(f"--resume {resume}: no valid checkpoint there, only incomplete or damaged ones")
    return newest


STEP_DIR = re.compile(r"step-(\d+)")
"""The checkpoints a recipe writes into ``--ckpt-dir``: ``step-NNNNNNNN``."""


def remove_old_checkpoints(ckpt_dir: Path, keep_last: int, keep: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep_last`` checkpoints ``step-N`` in ``ckpt_dir`` (by N),
    never ``keep`` (the one just saved, whatever its N); return the ones deleted.

    Only complete checkpoints count: a directory without a manifest is not a checkpoint (an
    interrupted save's, or not shardpar's) and is left alone. Each is first renamed to a
    hidden ``.step-N.old-<12 hex>`` -- no longer a checkpoint, at once, for any reader -- then
    deleted, so a crash halfway never leaves a half-deleted checkpoint where ``--resume``
    looks; shardpar's next save sweeps such a leftover (docs/checkpoint-format.md).
    """
    found = sorted(
        (int(match[1]), path)
        for path in ckpt_dir.iterdir()
        if (match := STEP_DIR.fullmatch(path.name)) and (path / MANIFEST).is_file()
    )
    removed = []
    for _, path in found[: max(0, len(found) - keep_last)]:
        if keep is not None and path.absolute() == keep.absolute():
            continue
        hidden = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:12]}")
        os.rename(path, hidden)
        shutil.rmtree(hidden, ignore_errors=True)
        removed.append(path)
    return removed


def checkpoint_paths(checkpoint: Path, optimizers: Mapping[str, Any]) -> list[Path]:
    """Where each optimizer's state is saved with the checkpoint ``DIR/step-N``, in order.

    A shardpar checkpoint holds the model and one optimizer's state. The first optimizer's
    goes into ``DIR/step-N`` itself, the one ``--resume`` finds; each other's into a checkpoint
    of its own, ``DIR/<its name>/step-N`` (``--optimizer muon``: Muon's in ``step-N``, AdamW's
    in ``adamw/step-N``; the model's weights are in both).
    """
    return [checkpoint if i == 0 else checkpoint.parent / name / checkpoint.name for i, name in enumerate(optimizers)]


class Checkpoints:
    """Saves ``step-NNNNNNNN`` checkpoints into ``ckpt_dir`` (one per optimizer:
    :func:`checkpoint_paths`): in the background with ``async_save`` (training goes on while
    one is written; the next save, or :meth:`finish`, waits for it), keeping the newest
    ``keep_last`` (0: all) once each is complete."""

    def __init__(self, ckpt_dir: Path, async_save: bool, keep_last: int, env: DistEnv) -> None:
        self.ckpt_dir, self.async_save, self.keep_last, self.env = ckpt_dir, async_save, keep_last, env
        self._pending: list[Any] = []

    def save(
        self, model: shardpar.ShardedModule, optimizers: Mapping[str, Any], step: int, extra: dict[str, Any]
    ) -> None:
        """Every rank calls it. A synchronous save returns with the checkpoints complete.

        The other optimizers' checkpoints are saved first: ``step-N`` (what ``--resume``
        finds) is complete only once theirs are. shardpar writes one background save of a
        process at a time, so with ``async_save`` each of them waits for the one before.
        """
        self.finish()
        paths = checkpoint_paths(self.ckpt_dir / f"step-{step:08d}", optimizers)
        order = list(zip(paths, optimizers.values()))
        for path, opt in order[1:] + order[:1]:
            self._pending.append(
                shardpar.save_checkpoint(str(path), model, opt, extra=extra, async_save=self.async_save)
            )
        if not self.async_save:
            self.finish()

    def finish(self) -> None:
        """Wait for the saves in progress (an error raised on every rank), then rotate."""
        pending, self._pending = self._pending, []
        for handle in pending:
            handle.wait()
            log.info("saved %s", handle.path)
        if self.keep_last and self.env.is_main:
            for handle in pending:
                for path in remove_old_checkpoints(handle.path.parent, self.keep_last, keep=handle.path):
                    log.info("removed %s (--keep-last %d)", path, self.keep_last)


def warmup_cosine(warmup: int, total: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Multiplier for LambdaLR: linear warmup to 1 over `warmup` steps, cosine to `min_ratio`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def all_reduce_mean(value: float, device: torch.device) -> float:
    """Mean of a Python float over all ranks (identity without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item() / dist.get_world_size()
