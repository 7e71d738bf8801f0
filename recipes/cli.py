"""The parts of a recipe's command line that need no torch: argument parsing with one-line
errors, where this process sits in a torchrun job, and a first look at ``--resume``.

Importing torch takes seconds; a recipe parses its arguments with these first, so a typo in a
flag is answered at once (as the tools in tools/ answer).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

__all__ = [
    "DEVICES",
    "MANIFEST",
    "ArgumentParser",
    "DistEnv",
    "add_device_flag",
    "dist_env",
    "pin_device",
    "resume_dir_problem",
]

MANIFEST = "shardpar.json"
"""Name of shardpar's checkpoint manifest (API.md, "Checkpoint on disk")."""


DEVICES = ("auto", "cpu", "cuda")
"""``--device`` choices: ``auto`` is ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage error is one line, ``error: ... (see PROG --help)``, exit 2,
    instead of the usage block followed by the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits, as torchrun describes it (defaults: one plain process)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_env() -> DistEnv:
    """Read RANK / LOCAL_RANK / WORLD_SIZE set by torchrun; a plain `python` run is rank 0 of 1."""
    return DistEnv(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
    )


def resume_dir_problem(resume: str) -> str | None:
    """Why ``--resume DIR`` cannot hold a checkpoint, or None if it may.

    A checkpoint directory has a manifest; a directory of checkpoints (a ``--ckpt-dir``) has
    one in a subdirectory. Whether a manifest is valid is checked later, with shardpar.
    """
    path = Path(resume)
    if not path.is_dir():
        return f"--resume {resume}: no such directory"
    if (path / MANIFEST).is_file() or any((child / MANIFEST).is_file() for child in path.iterdir()):
        return None
    return (
        f"--resume {resume}: no checkpoint there (no {MANIFEST} in it or in a directory under it); "
        "--resume latest starts fresh when there is none"
    )


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """``--device {auto,cpu,cuda}``, the same in every recipe."""
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="auto",
        help="auto (default): cuda:LOCAL_RANK with NCCL when CUDA is available, else CPU with gloo; "
        "cpu: CPU and gloo even on a GPU machine (the GPUs are hidden from the process); "
        "cuda: require a GPU per local rank",
    )


def pin_device(choice: str) -> None:
    """Make ``--device cpu`` hold for everything in this process: hide the GPUs.

    Choosing the CPU device in the recipe is not enough on a GPU machine: a model built on the
    meta device is materialised by shardpar on the current CUDA device when CUDA is available.
    An empty ``CUDA_VISIBLE_DEVICES`` makes CUDA unavailable to the whole process, which is the
    same pin the tests use. It takes effect only if CUDA is not initialised yet, so call this
    right after parsing, before anything touches the GPU.
    """
    if choice == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
