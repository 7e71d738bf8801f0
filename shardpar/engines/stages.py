"""The stage table: each stage is a row that picks its parts, not a subclass switching off
its parent's (docs/design.md, "A stage is a row of a table").

| stage | reducer strategy        | gradient storage               | parameter storage   | master copy                      | gatherer                       | backward path        |
|-------|-------------------------|--------------------------------|---------------------|----------------------------------|--------------------------------|----------------------|
| 0     | all-reduce              | full buffer                    | replicated          | full (a copy under mixed prec.)  | none                           | reduce when complete |
| 1     | reduce-scatter in place | full buffer, owned slice read  | replicated          | sharded, with its gatherer       | after step, lazily completed   | reduce when complete |
| 2     | reduce-scatter, staged  | bounded staging -> owned shard | replicated          | sharded, with its gatherer       | after step, lazily completed   | reduce when complete |
| 3     | reduce-scatter, staged  | bounded staging -> owned shard | sharded per unit    | the shards themselves            | per unit, forward and backward | reshard, then reduce |

The storage and strategy builders take :class:`RowInputs`, what the engine set up before its
parts; the gatherer builders take the engine, whose hooks for the gatherer they install, and
the backward-path builders take it for its reducer and gatherer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import watch
from ..comm.sharding_groups import ShardingGroups
from ..config import ShardConfig
from ..core.averaging import AcrossReplicas
from ..core.backward_paths import BackwardPath, ReduceWhenComplete, ReshardThenReduce
from ..core.deferred_init import DeferredInit, InitWalk
from ..core.gather_phases import GatherPhases, NoGatherer, PostStepGatherer
from ..core.gatherer import UnitGatherer
from ..core.inventory import ParamInventory
from ..core.masters import FullMaster, ShardedMaster
from ..core.reduce_strategies import AllReduceStrategy, ReduceScatterInPlace, ReduceStrategy
from ..core.reducer import BucketedParams
from ..core.replicated import ReplicatedStorage
from ..core.sharded import FromInit, FromLiveModule, ShardedStorage
from ..core.staged_reduce_scatter import StagedReduceScatter
from ..core.storage import Storage
from ..core.wait_clock import WaitClock
from .casts import MixedPrecisionCasts

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class RowInputs:
    """What the engine set up before its parts, and the storage and strategy builders of a
    row read: they take these, not the engine."""

    module: nn.Module
    inventory: ParamInventory
    config: ShardConfig
    group: Any
    """The process group of every rank (None: the default group)."""
    world_size: int
    shards: ShardingGroups
    comm: C.CommStats
    shard_comm: C.CommStats
    replica_comm: C.CommStats
    wait_clock: WaitClock
    device: torch.device
    casts: MixedPrecisionCasts
    deferred_init: DeferredInit | None


def broadcast_from_rank0(tensors: Sequence[torch.Tensor], group: Any) -> None:
    """Make ``tensors`` equal rank 0's on every rank (set-up only; not per step)."""
    with torch.no_grad():
        for tensor in tensors:
            C.broadcast(tensor, 0, group=group)


# ---------------------------------------------------------------------- master copies (stages 0-2)


def _full_master(inputs: RowInputs) -> FullMaster:
    return FullMaster()


def _post_step_gatherer(inputs: RowInputs) -> PostStepGatherer:
    """Stages 1-2's gatherer: all-gathers over the shard group after ``step()``. The sharded
    master owns it and gives it its flat groups once they exist (after the broadcast)."""
    shards = inputs.shards
    return PostStepGatherer([], shards.shard_group, inputs.shard_comm, inputs.wait_clock, inputs.device)


def _sharded_master(inputs: RowInputs) -> ShardedMaster:
    return ShardedMaster(inputs.shards.shard_rank, _post_step_gatherer(inputs))


# ---------------------------------------------------------------------- storages


def _replicated(master: Callable[[RowInputs], FullMaster | ShardedMaster]) -> Callable[[RowInputs], ReplicatedStorage]:
    def build(inputs: RowInputs) -> ReplicatedStorage:
        shards = inputs.shards
        storage = ReplicatedStorage(
            inputs.module,
            inputs.inventory,
            inputs.config,
            shards.shard_group,
            shards.shard_size,
            shards.shard_rank,
            master(inputs),
        )
        broadcast_from_rank0(storage.tensors_to_broadcast() + list(inputs.module.buffers()), inputs.group)
        storage.finish_setup()
        return storage

    return build


def _sharded_units(inputs: RowInputs) -> ShardedStorage:
    deferred, shards, module, device = inputs.deferred_init, inputs.shards, inputs.module, inputs.device
    if deferred is None:
        storage = ShardedStorage(
            module,
            inputs.inventory,
            inputs.config,
            shards.shard_group,
            shards.shard_size,
            shards.shard_rank,
            FromLiveModule(inputs.group, device),
        )
        broadcast_from_rank0(list(module.buffers()), inputs.group)
        return storage
    # Born sharded from an initialisation every rank replays alike: nothing to broadcast.
    walk = InitWalk(module, deferred.init_fn, inputs.group, device)
    storage = ShardedStorage(
        module,
        inputs.inventory,
        inputs.config,
        shards.shard_group,
        shards.shard_size,
        shards.shard_rank,
        FromInit(module, walk, device),
    )
    walk.finish(device)
    inputs.casts.cast_buffers(module)  # a buffer the init re-assigned has the init's dtype
    return storage


# ---------------------------------------------------------------------- gatherers


def _no_gatherer(engine: Engine) -> NoGatherer:
    engine.install_use_hooks()  # they record the launch order in the first forward
    return NoGatherer(engine.group, engine.device, engine.comm)


def _masters_gatherer(engine: Engine) -> PostStepGatherer:
    """Stages 1-2: the sharded master's gatherer (made by :func:`_post_step_gatherer`)."""
    engine.install_use_hooks()  # they also complete the lazy gathers of the current buckets
    storage = engine.storage
    assert isinstance(storage, ReplicatedStorage) and isinstance(storage.master, ShardedMaster)  # stages 1-2's row
    return storage.master.gatherer


def _unit_gatherer(engine: Engine) -> UnitGatherer:
    """Stage 3: the per-unit gatherer over a process group of its own (the shard group's
    sibling, retired after a mismatch), driven by hooks on every unit's hook and entry modules."""
    storage, shards, config = engine.storage, engine.shards, engine.config
    assert isinstance(storage, ShardedStorage)  # stage 3's row
    gather_group = C.sibling_group(shards.shard_group, config.timeout_s)
    if gather_group is not None:
        watch.configure(gather_group, config.timeout_s)
    gatherer = UnitGatherer(
        storage.units,
        engine.state,
        config.reshard_after_forward,
        config.units_to_prefetch_in_forward,
        config.units_to_prefetch_in_backward,
        engine.shard_comm,
        gather_group,
        shards.shard_group,  # what the gather group is the sibling of: retired after a mismatch
        shards.shard_rank,
        engine.wait_clock,
    )
    engine.install_unit_hooks(gatherer)
    return gatherer


# ---------------------------------------------------------------------- reducer strategies


def _all_reduce(inputs: RowInputs, spaces: Sequence[BucketedParams]) -> AllReduceStrategy:
    return AllReduceStrategy(
        spaces,
        inputs.casts.reduce_dtype,
        inputs.world_size,
        inputs.group,
        inputs.comm,
        divide_factor=inputs.config.gradient_divide_factor,
    )


def _across_replicas(inputs: RowInputs) -> AcrossReplicas | None:
    shards = inputs.shards
    return AcrossReplicas(shards.replica_group, shards.shard_rank, inputs.replica_comm) if shards.is_hybrid else None


def _reduce_scatter(
    strategy: type[ReduceScatterInPlace] | type[StagedReduceScatter],
) -> Callable[[RowInputs, Sequence[BucketedParams]], ReduceStrategy]:
    """Stages 1-3's strategies: a reduce-scatter over the shard group (then across replicas
    under hybrid sharding) of the sum over every rank."""

    def build(inputs: RowInputs, spaces: Sequence[BucketedParams]) -> ReduceStrategy:
        shards = inputs.shards
        return strategy(
            spaces,
            inputs.casts.reduce_dtype,
            shards.shard_size,
            shards.shard_rank,
            shards.shard_group,
            inputs.shard_comm,
            _across_replicas(inputs),
            ranks_summed=inputs.world_size,
            divide_factor=inputs.config.gradient_divide_factor,
        )

    return build


# ---------------------------------------------------------------------- backward paths


def _reduce_when_complete(engine: Engine) -> ReduceWhenComplete:
    return ReduceWhenComplete(engine.reducer)


def _reshard_then_reduce(engine: Engine) -> ReshardThenReduce:
    gatherer = engine.gatherer
    assert isinstance(gatherer, UnitGatherer)  # stage 3's row built the unit gatherer before its path
    # One rank cannot depart from the others' unit order: nothing to wait for.
    return ReshardThenReduce(engine.reducer, gatherer, gated=engine.world_size > 1)


@dataclass(frozen=True)
class StageRow:
    stage: int
    storage: Callable[[RowInputs], Storage]
    """Builds the parameter storage (stages 0-2 with their master part: full or sharded, the
    latter with its post-step gatherer)."""
    strategy: Callable[[RowInputs, Sequence[BucketedParams]], ReduceStrategy]
    """Builds the reducer's strategy over the storage's bucketed parameter sets."""
    gatherer: Callable[[Engine], GatherPhases]
    """Gives the engine the stage's gatherer and installs the module hooks that drive it."""
    backward_path: Callable[[Engine], BackwardPath]
    """Orders the reducer and the gatherer in backward (core/backward_paths.py)."""


STAGES: dict[int, StageRow] = {
    0: StageRow(0, _replicated(_full_master), _all_reduce, _no_gatherer, _reduce_when_complete),
    1: StageRow(
        1, _replicated(_sharded_master), _reduce_scatter(ReduceScatterInPlace), _masters_gatherer, _reduce_when_complete
    ),
    2: StageRow(
        2, _replicated(_sharded_master), _reduce_scatter(StagedReduceScatter), _masters_gatherer, _reduce_when_complete
    ),
    3: StageRow(3, _sharded_units, _reduce_scatter(StagedReduceScatter), _unit_gatherer, _reshard_then_reduce),
}
