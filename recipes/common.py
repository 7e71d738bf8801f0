"""Helpers shared by the recipes: rank/device discovery, rank-aware logging, lr schedule,
checkpoint discovery. Plain torch only; nothing here depends on shardpar internals."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

__all__ = [
    "DistEnv",
    "dist_env",
    "setup_logging",
    "setup_device",
    "init_distributed",
    "warmup_cosine",
    "all_reduce_mean",
]

# Name of shardpar's checkpoint manifest (API.md, "Checkpoint on disk").


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
        rank=int(os.environ.get("RANK", 0)),
        local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        world_size=int(os.environ.get("WORLD_SIZE", 1)),
    )


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


def setup_device(env: DistEnv) -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is available (and made current), else CPU."""
    if torch.cuda.is_available():
        device = torch.device("cuda", env.local_rank)
        # Must precede any CUDA work so NCCL and allocations land on this rank's GPU.
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def init_distributed(env: DistEnv, device: torch.device) -> None:
    """Create the default process group under torchrun (gloo on CPU, NCCL on CUDA).

    shardpar.wrap would do this itself, but the recipe needs the group earlier for its own
    logging reductions, and binding `device_id` lets NCCL set up eagerly on the right GPU.
    """
    if env.world_size == 1 or dist.is_initialized():
        return
    dist.init_process_group(
        backend=dist.get_default_backend_for_device(device),
        device_id=device if device.type == "cuda" else None,
    )


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
