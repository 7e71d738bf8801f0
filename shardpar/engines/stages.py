"""The stage table: each stage is a row that picks its parts, not a subclass switching off
its parent's (DESIGN.md, "The core").

| stage | reducer strategy        | gradient storage                     | parameter storage          | gatherer                       | backward path          |
|-------|-------------------------|--------------------------------------|----------------------------|--------------------------------|------------------------|
| 0     | all-reduce              | full buffer                          | replicated                 | none                           | reduce when complete   |
| 1     | reduce-scatter in place | full buffer, owned slice read        | replicated, master shard   | after step, lazily completed   | reduce when complete   |
| 2     | reduce-scatter, staged  | bounded staging -> owned shard       | replicated, master shard   | after step, lazily completed   | reduce when complete   |
| 3     | reduce-scatter, staged  | bounded staging -> owned shard       | sharded per unit           | per unit, forward and backward | reshard, then reduce   |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.backward_paths import BackwardPath, ReduceWhenComplete, ReshardThenReduce
from ..core.deferred_init import InitWalk
from ..core.gather_phases import GatherPhases, NoGatherer, PostStepGatherer
from ..core.gatherer import UnitGatherer
from ..core.masters import FullMaster, ShardedMaster
from ..core.reduce_strategies import AllReduceStrategy, ReduceScatterInPlace
from ..core.reducer import ParamSpace
from ..core.replicas import AcrossReplicas
from ..core.replicated import ReplicatedStorage
from ..core.sharded import FromInit, FromLiveModule, ShardedStorage
from ..core.staged_reduce_scatter import StagedReduceScatter

if TYPE_CHECKING:
    from .engine import Engine


def _replicated(master: Callable[[], FullMaster | ShardedMaster]) -> Callable[[Engine], ReplicatedStorage]:
    def build(engine: Engine) -> ReplicatedStorage:
        shards = engine.shards
        storage = ReplicatedStorage(
            engine.module,
            engine.inventory,
            engine.config,
            shards.shard_group,
            engine.shard_comm,
            shards.shard_size,
            shards.shard_rank,
            master(),
        )
        engine.broadcast_from_rank0(storage.tensors_to_broadcast() + list(engine.module.buffers()))
        storage.finish_setup(shards.shard_group, engine.shard_comm, engine.wait_clock)
        return storage

    return build


def _sharded_units(engine: Engine) -> ShardedStorage:
    deferred, shards = engine.deferred_init, engine.shards
    if deferred is None:
        storage = ShardedStorage(
            engine.module,
            engine.inventory,
            engine.config,
            shards.shard_group,
            shards.shard_size,
            shards.shard_rank,
            FromLiveModule(engine.group, engine.device),
        )
        engine.broadcast_from_rank0(list(engine.module.buffers()))
        return storage
    # Born sharded from an initialisation every rank replays alike: nothing to broadcast.
    walk = InitWalk(engine.module, deferred.init_fn, engine.group, engine.device)
    storage = ShardedStorage(
        engine.module,
        engine.inventory,
        engine.config,
        shards.shard_group,
        shards.shard_size,
        shards.shard_rank,
        FromInit(engine.module, walk, engine.device),
    )
    walk.finish(engine.device)
    engine.casts.cast_buffers(engine.module)  # a buffer the init re-assigned has the init's dtype
    return storage


def _no_gatherer(engine: Engine) -> NoGatherer:
    engine.install_use_hooks()  # they record the launch order in the first forward
    return NoGatherer(engine.group, engine.device, engine.comm)


def _post_step_gatherer(engine: Engine) -> PostStepGatherer:
    engine.install_use_hooks()  # they also complete the lazy gathers of the current buckets
    gatherer: PostStepGatherer | None = engine.storage.gatherer  # the sharded master's, over its buckets
    assert gatherer is not None, "stages 1-2 keep a sharded master, which gathers after the step"
    return gatherer


def _unit_gatherer(engine: Engine) -> UnitGatherer:
    return engine.install_unit_gatherer()


def _all_reduce(engine: Engine, spaces: list[ParamSpace]) -> AllReduceStrategy:
    return AllReduceStrategy(
        spaces,
        engine.reduce_dtype,
        engine.world_size,
        engine.group,
        engine.comm,
        divide_factor=engine.config.gradient_divide_factor,
    )


def _across_replicas(engine: Engine) -> AcrossReplicas | None:
    shards = engine.shards
    return AcrossReplicas(shards.replica_group, shards.shard_rank, engine.replica_comm) if shards.is_hybrid else None


def _reduce_scatter_in_place(engine: Engine, spaces: list[ParamSpace]) -> ReduceScatterInPlace:
    shards = engine.shards
    return ReduceScatterInPlace(
        spaces,
        engine.reduce_dtype,
        shards.shard_size,
        shards.shard_rank,
        shards.shard_group,
        engine.shard_comm,
        _across_replicas(engine),
        ranks_summed=engine.world_size,
        divide_factor=engine.config.gradient_divide_factor,
    )


def _staged_reduce_scatter(engine: Engine, spaces: list[ParamSpace]) -> StagedReduceScatter:
    shards = engine.shards
    return StagedReduceScatter(
        spaces,
        engine.reduce_dtype,
        shards.shard_size,
        shards.shard_rank,
        shards.shard_group,
        engine.shard_comm,
        _across_replicas(engine),
        ranks_summed=engine.world_size,
        divide_factor=engine.config.gradient_divide_factor,
    )


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
    storage: Callable[[Engine], Any]
    """Builds the parameter storage (stages 0-2 with their master part: full or sharded)."""
    strategy: Callable[[Engine, list[ParamSpace]], Any]
    """Builds the reducer's strategy over the storage's parameter spaces."""
    gatherer: Callable[[Engine], GatherPhases]
    """Builds the gatherer and installs the module hooks that drive it."""
    backward_path: Callable[[Engine], BackwardPath]
    """Orders the reducer and the gatherer in backward (core/backward_paths.py)."""


STAGES: dict[int, StageRow] = {
    0: StageRow(0, _replicated(FullMaster), _all_reduce, _no_gatherer, _reduce_when_complete),
    1: StageRow(1, _replicated(ShardedMaster), _reduce_scatter_in_place, _post_step_gatherer, _reduce_when_complete),
    2: StageRow(2, _replicated(ShardedMaster), _staged_reduce_scatter, _post_step_gatherer, _reduce_when_complete),
    3: StageRow(3, _sharded_units, _staged_reduce_scatter, _unit_gatherer, _reshard_then_reduce),
}
