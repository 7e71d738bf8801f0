"""Run by tests/test_launch.py under two torchrun agents (two "nodes" of 2 ranks, c10d
rendezvous on loopback): what torchrun told this rank, a plain all-reduce over all ranks,
``shard_group_size="node"``'s groups and an all-reduce over each, and whether the groups are
freed with the default group ([Note: no group outlives destroy_process_group]).
"""

from __future__ import annotations

import gc
import os
import weakref

import torch
import torch.distributed as dist

from shardpar.comm.sharding_groups import sharding_groups
from tests.launch import report


def summed(group: object) -> float:
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value, group=group)
    return value.item()


def main() -> None:
    dist.init_process_group("gloo")
    record = {name: os.environ.get(name) for name in
              ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR")}
    record["world_sum"] = summed(None)
    groups = sharding_groups("node", timeout_s=30)
    record.update(shard_ranks=list(groups.shard_ranks), replica_ranks=list(groups.replica_ranks),
                  shard_sum=summed(groups.shard_group), replica_sum=summed(groups.replica_group),
                  describe=groups.describe())
    refs = [weakref.ref(groups.shard_group), weakref.ref(groups.replica_group), weakref.ref(dist.group.WORLD)]
    del groups
    dist.destroy_process_group()
    gc.collect()
    record["alive_after_destroy"] = sum(ref() is not None for ref in refs)
    report(record)


if __name__ == "__main__":
    main()
