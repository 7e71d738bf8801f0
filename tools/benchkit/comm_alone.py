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
  the reducer's buckets, each gatherer's gathers per step) and ``engine.shards`` (the
  ``ShardingGroups``: which group they run on, and under hybrid sharding the replica group
  that sums each bucket's owned slice, which the schedule does not list; see [Note: hybrid
  sharding alone]).
- ``engine.wait_clock`` (``reset()``, ``seconds``) and its phase names
  ``shardpar.core.wait_clock.PHASES`` (runners.py, measure.py): a public
  ``model.wait_stats()`` / ``reset_wait_stats()`` beside ``comm_stats()`` would replace them.
- ``engine.close()`` (runners.py), to drop a configuration's hooks: a public
  ``ShardedModule.close()`` would replace it.

[Note: hybrid sharding alone]
``engine.collective_schedule()`` lists the collectives by kind and size only, and under
hybrid sharding ([Note: reduction under hybrid sharding] in shardpar/core/averaging.py) the
reduce-scatters and gathers run on the shard group (G ranks, not the world) and each
bucket's reduce-scatter is followed by an all-reduce of the rank's owned slice (bucket/G
elements, in the reduce dtype) across the replica group, which the schedule leaves out. So
the schedule is completed here from ``engine.shards``: every listed collective runs on the
shard group, and each reduction carries its replica all-reduce as ``then``, launched as soon
as its reduce-scatter has been waited for (the engine starts it then too), and counted with
the gradients. Without hybrid sharding the shard group is the engine's whole group and
nothing follows, so full sharding is timed as before. A ``--candidate`` checkout from before
hybrid sharding has no ``engine.shards``: its engine's group is the default one.
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
    group: Any = None  # the process group it runs on (None: the default group)
    size: int = 1  # ranks of that group: a rank's part of the buffer is numel / size
    then: Collective | None = None  # launched once this one is waited for: [Note: hybrid sharding alone]


def step_collectives(model: nn.Module) -> list[Collective]:
    """The gradient collectives of one step (one per bucket, in the reduce dtype: an all-reduce
    at stage 0, a reduce-scatter at stages 1-3, each followed under hybrid sharding by the
    all-reduce of its owned slice across replicas), then its parameter all-gathers: none at
    stage 0, one per bucket at stages 1-2, one per flat group of every unit and use at stage 3
    (twice with ``reshard_after_forward``: forward and backward, except for the units the last
    forward kept gathered into backward; the bench's models use every unit once)."""
    engine = model.engine
    shards = getattr(engine, "shards", None)
    group, size = (shards.shard_group, shards.shard_size) if shards else (None, dist.get_world_size())
    replicas = shards.replica_size if shards else 1
    schedule = []
    for kind, numel, dtype in engine.collective_schedule():
        across = None
        if kind != "all_gather" and replicas > 1:
            across = Collective("all_reduce", numel // size, dtype, shards.replica_group, replicas)
        schedule.append(Collective(kind, numel, dtype, group, size, across))
    return schedule


LAUNCH: dict[str, Callable[[torch.Tensor, torch.Tensor, Any], Any]] = {
    "all_reduce": lambda full, part, group: collectives.all_reduce(full, group=group, async_op=True),
    "reduce_scatter": lambda full, part, group: collectives.reduce_scatter(part, full, group=group, async_op=True),
    "all_gather": lambda full, part, group: collectives.all_gather(full, part, group=group, async_op=True),
}
"""Each kind launched asynchronously with shardpar's own functions, on a full buffer and its
rank's part, on the collective's group."""


def _buffers(c: Collective, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh full buffer for ``c`` and a rank's part of it."""
    full = torch.zeros(c.numel, dtype=c.dtype, device=device)
    return full, full[: c.numel // c.size].clone()


def alone_s(schedule: list[Collective], reps: int, device: torch.device) -> float:
    """Median seconds to launch ``schedule``'s collectives on fresh buffers and wait for them
    all (each one's ``then`` launched as soon as it is waited for), every rank starting
    together (on CUDA, until the GPU has finished them); 0 for none."""
    if not schedule:
        return 0.0
    first = [_buffers(c, device) for c in schedule]
    second = [_buffers(c.then, device) if c.then else None for c in schedule]
    times = []
    for _ in range(reps):
        dist.barrier()
        synchronize(device)
        start = time.perf_counter()
        handles = [LAUNCH[c.kind](*buffers, c.group) for c, buffers in zip(schedule, first)]
        following = []
        for c, handle, buffers in zip(schedule, handles, second):
            handle.wait()
            if c.then is not None:
                following.append(LAUNCH[c.then.kind](*buffers, c.then.group))
        for handle in following:
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
