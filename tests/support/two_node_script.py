"""Run by tests/test_two_node_launch.py under two torchrun agents (two "nodes" of 2 ranks, c10d
rendezvous on loopback): what torchrun told this rank, a plain all-reduce over all ranks,
``shard_group_size="node"``'s groups and an all-reduce over each, three steps of stage-3
training with ``shard_group_size="node"`` (its final parameters, for the test to compare with
plain torch), and whether the groups are freed with the default group ([Note: no group
outlives destroy_process_group]).
"""

from __future__ import annotations

import gc
import os
import weakref

import torch
import torch.distributed as dist

import shardpar
from shardpar.comm.sharding_groups import sharding_groups
from tests.support.launch import report
from tests.support.parity import global_batch, rank_slice

TRAINING = dict(steps=3, lr=1e-2)
"""Shared with the test's plain-torch reference (tests.support.parity.Recipe fields)."""


def train_node_sharded(recipe) -> dict[str, list[float]]:
    """Stage 3 sharded within each node, replicated across the two: this rank's view of the
    final parameters (AdamW, as the reference; the global batch sliced by rank)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = recipe.model.build()
    model = shardpar.wrap(module, stage=3, shard_group_size="node", min_unit_params=1)
    assert model.engine.shards.shard_size == 2 and model.engine.shards.replica_size == 2
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=recipe.lr)
    for step in range(recipe.steps):
        x, y = global_batch(module, recipe, step)
        module.loss(model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    state = {name: tensor.flatten().tolist() for name, tensor in model.full_state_dict().items()}
    model.engine.close()
    return state


def summed(group: object) -> float:
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value, group=group)
    return value.item()


def main() -> None:
    dist.init_process_group("gloo")
    record = {
        name: os.environ.get(name)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")
    }
    record["world_sum"] = summed(None)
    groups = sharding_groups("node", timeout_s=30)
    record.update(
        shard_ranks=list(groups.shard_ranks),
        replica_ranks=list(groups.replica_ranks),
        shard_sum=summed(groups.shard_group),
        replica_sum=summed(groups.replica_group),
        describe=groups.describe(),
    )
    from tests.support.models import TRANSFORMER
    from tests.support.parity import Recipe

    record["trained"] = train_node_sharded(Recipe(model=TRANSFORMER, groups=False, clip=None, **TRAINING))
    gc.collect()  # the model and its engine, which held the groups
    refs = [weakref.ref(groups.shard_group), weakref.ref(groups.replica_group), weakref.ref(dist.group.WORLD)]
    del groups
    dist.destroy_process_group()
    gc.collect()
    record["alive_after_destroy"] = sum(ref() is not None for ref in refs)
    report(record)


if __name__ == "__main__":
    main()
