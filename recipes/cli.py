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

__all__ = ["MANIFEST", "ArgumentParser", "DistEnv", "dist_env", "resume_dir_problem"]

MANIFEST = "shardpar.json"
"""Name of shardpar's checkpoint manifest (API.md, "Checkpoint on disk")."""


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
    return (f"--resume {resume}: no checkpoint there (no {MANIFEST} in it or in a directory under it); "
            "--resume latest starts fresh when there is none")
