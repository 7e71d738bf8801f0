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

- :func:`step_collectives` (the only place that reads the engine's parts): the gradient
  buckets (``engine.reducer.buckets``, each ``spec.range.size`` and ``engine.reduce_dtype(space)``),
  the parameter all-gathers (``engine.gatherer.groups`` at stages 1-2, ``.flats`` at stage 3,
  each ``layout.numel`` and ``dtype``; ``engine.config.reshard_after_forward``) and the units
  the last forward kept gathered into backward (``engine.gatherer.last_kept``). A public
  ``engine.collective_schedule()`` returning one record per collective of a step (kind,
  full numel with padding, dtype, process group), the planner's ``estimate_communication``
  built from the same records, would replace all of it: :class:`Collective` is that record.
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
    kept gathered into backward; the bench's models use every unit once). The stand-in for an
    engine method: see [Note: engine internals]."""
    engine = model.engine
    kind = "all_reduce" if model.stage == 0 else "reduce_scatter"
    schedule = [Collective(kind, b.spec.range.size, engine.reduce_dtype(b.space)) for b in engine.reducer.buckets]
    if model.stage == 0:
        return schedule
    flats = engine.gatherer.groups if model.stage < 3 else engine.gatherer.flats
    uses = 2 if model.stage == 3 and engine.config.reshard_after_forward else 1
    gathers = [(flat.layout.numel, flat.dtype) for flat in flats] * uses
    if uses == 2:  # the units kept gathered from forward into backward are gathered once
        for unit in engine.gatherer.last_kept:
            for flat in unit.flats:
                gathers.remove((flat.layout.numel, flat.dtype))
    return schedule + [Collective("all_gather", numel, dtype) for numel, dtype in gathers]


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
