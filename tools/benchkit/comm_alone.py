"""Communication alone: the collectives one training step issues, timed with nothing else
running (see [Note: what is measured] in __init__.py), against which the engine's exposed
waits say how much overlap hid.

[Note: engine internals]
The bench reads shardpar through its public surfaces (``wrap``, ``optimizer``,
``memory_stats()``, ``comm_stats()``, ``reset_comm_stats()``, ``stage``,
``estimate_communication``, ``ShardConfig.option_names()``) and two modules of its own layers
that are functions, not state (``shardpar.comm.collectives`` for the collectives alone,
``shardpar.comm.compat.fully_shard`` for the FSDP2 peer), except for these, which API.md does
not name yet:

- :func:`step_collectives` reads ``engine.collective_schedule()`` (the engine's parts answer it:
  the reducer's buckets, each gatherer's gathers per step).
- ``engine.wait_clock`` (``reset()``, ``seconds``) and its phase names
  ``shardpar.core.wait_clock.PHASES`` (runners.py, measure.py): a public
  ``model.wait_stats()`` / ``reset_wait_stats()`` beside ``comm_stats()`` would replace them.
- ``engine.close()`` (runners.py), to drop a configuration's hooks: a public
  ``ShardedModule.close()`` would replace it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardpar.comm import collectives

from .measure import synchronize
from .runners import Runner


@dataclass(frozen=True)
class Collective:
    """One collective a training step issues."""

    kind: str  # "all_reduce", "reduce_scatter" or "all_gather"
    numel: int  # of the full (unsharded) buffer, padding included
    dtype: torch.dtype


def step_collectives(model: nn.Module) -> list[Collective]:
    """The gradient collectives of one step (one per bucket, in the reduce dtype: an all-reduce
    at stage 0, a reduce-scatter at stages 1-3), then its parameter all-gathers: none at stage
    0, one per bucket at stages 1-2, one per flat group of every unit and use at stage 3 (twice
    with ``reshard_after_forward``: forward and backward, except for the units the last forward
    kept gathered into backward; the bench's models use every unit once)."""
    return [Collective(kind, numel, dtype) for kind, numel, dtype in model.engine.collective_schedule()]


LAUNCH: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
    "all_reduce": lambda full, part: collectives.all_reduce(full, async_op=True),
    "reduce_scatter": lambda full, part: collectives.reduce_scatter(part, full, async_op=True),
    "all_gather": lambda full, part: collectives.all_gather(full, part, async_op=True),
}
"""Each kind launched asynchronously with shardpar's own functions, on a full buffer and its
rank's part."""


def alone_s(schedule: list[Collective], reps: int, device: torch.device) -> float:
    """Median seconds to launch ``schedule``'s collectives on fresh buffers and wait for them
    all, every rank starting together (on CUDA, until the GPU has finished them); 0 for none."""
    if not schedule:
        return 0.0
    world = dist.get_world_size()
    fulls = [torch.zeros(c.numel, dtype=c.dtype, device=device) for c in schedule]
    parts = [full[: full.numel() // world].clone() for full in fulls]
    times = []
    for _ in range(reps):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        for handle in [LAUNCH[c.kind](full, part) for c, full, part in zip(schedule, fulls, parts)]:
            handle.wait()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def collectives_alone_s(runner: Runner, reps: int) -> tuple[float | None, float | None]:
    """Seconds a shardpar configuration's gradient collectives, and its parameter all-gathers,
    take with nothing else running; None for the peers and at world size 1."""
    if runner.stage is None or dist.get_world_size() == 1:
        return None, None
    schedule = step_collectives(runner.model)
    grads = [c for c in schedule if c.kind != "all_gather"]
    gathers = [c for c in schedule if c.kind == "all_gather"]
    return alone_s(grads, reps, runner.device), alone_s(gathers, reps, runner.device)
