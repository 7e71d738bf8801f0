"""Hybrid sharding's groups (``shardpar/comm/sharding_groups.py``, issue #34): who is in which
shard and replica group for G = 2, 4, 1, ``"node"`` and a 2-D DeviceMesh at world size 4, the
closed-form sums of an all-reduce over each group, and bad choices (G not a divisor, ``"node"``
without LOCAL_WORLD_SIZE, a rank that asks for another G, a wrong mesh) refused on every rank
within seconds with the ranks named, after which the groups still work.

All the checks on 4 ranks share one launch: every error is caught on the ranks and returned,
so the pool survives them (the groups must then still agree, which the last check sees).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardpar.comm.sharding_groups import (
    ShardingGroups,
    consecutive_groups,
    resolve_shard_group_size,
    sharding_groups,
)
from tests.support.harness import environment, run_ranks

WORLD = 4
ERROR_WITHIN_S = 10.0
"""A refused choice is raised on every rank this soon (no rank waits for a collective that
another will not issue)."""


def _membership(groups: ShardingGroups) -> dict[str, Any]:
    """What a rank sees of its groups, and the sum of its rank + 1 over each (None: no group)."""

    def summed(group: Any) -> float | None:
        if group is None:
            return None
        value = torch.tensor([dist.get_rank() + 1.0])
        dist.all_reduce(value, group=group)
        return value.item()

    return {
        "sizes": (groups.world_size, groups.shard_size, groups.replica_size),
        "index": (groups.shard_rank, groups.replica_rank),
        "shard_ranks": groups.shard_ranks,
        "replica_ranks": groups.replica_ranks,
        "shard_sum": summed(groups.shard_group),
        "replica_sum": summed(groups.replica_group),
        "describe": groups.describe(),
    }


def _refused(call: Callable[[], Any]) -> tuple[str, float]:
    """The ValueError ``call`` raises on this rank, and how long it took."""
    start = time.monotonic()
    try:
        call()
    except ValueError as error:
        return str(error), time.monotonic() - start
    return "no error", time.monotonic() - start


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _on_four_ranks() -> dict[str, Any]:
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    two = sharding_groups(2, timeout_s=30)
    out["G=2"] = _membership(two)
    out["G=4"] = _membership(sharding_groups(4))
    out["None"] = _membership(sharding_groups(None))
    out["G=1"] = _membership(sharding_groups(1))
    with environment(LOCAL_WORLD_SIZE="2"):
        node = sharding_groups("node")
        out["node"] = _membership(node)
        out["node reuses the groups"] = node.shard_group is two.shard_group and node.replica_group is two.replica_group
    mesh = _mesh((2, 2), ("replicate", "shard"))  # built on every rank: it creates groups
    out["mesh"] = _membership(sharding_groups(mesh=mesh))

    errors = {
        "G=3": lambda: sharding_groups(3),
        "G=0": lambda: sharding_groups(0),
        "G=2 on ranks 0-1, 4 on 2-3": lambda: sharding_groups(2 if rank < 2 else 4),
        "rank 3 asks for 3": lambda: sharding_groups(3 if rank == 3 else 2),
        "a mesh on ranks 0-1 only": lambda: sharding_groups(mesh=mesh) if rank < 2 else sharding_groups(2),
        "1-D mesh": lambda: sharding_groups(mesh=_mesh((4,), ("shard",))),
        "swapped mesh": lambda: sharding_groups(mesh=_mesh((2, 2), ("shard", "replicate"))),
        "both": lambda: sharding_groups(2, mesh=mesh),
    }
    for name, call in errors.items():
        out[name] = _refused(call)
    with environment(LOCAL_WORLD_SIZE=None):
        out["node without LOCAL_WORLD_SIZE"] = _refused(lambda: sharding_groups("node"))
    with environment(LOCAL_WORLD_SIZE="3"):
        out["node, LOCAL_WORLD_SIZE=3"] = _refused(lambda: sharding_groups("node"))
    with environment(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank % 2)):  # nodes interleaved: not torchrun's order
        out["node, nodes interleaved"] = _refused(lambda: sharding_groups("node"))
    out["after the errors"] = _membership(sharding_groups(2))
    return out


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_ranks(_on_four_ranks, WORLD, timeout=120)


def test_groups_of_two(four: list[dict[str, Any]]) -> None:
    """G = 2: shard groups {0,1}, {2,3}; replica groups {0,2}, {1,3}. Sums of rank + 1: 3 and 7
    within, 4 and 6 across. "node" with LOCAL_WORLD_SIZE=2 and the (2, 2) mesh are the same
    groups, and "node" reuses those G = 2 made."""
    shard_sums, replica_sums = [3.0, 3.0, 7.0, 7.0], [4.0, 6.0, 4.0, 6.0]
    for rank, seen in enumerate(four):
        for case in ("G=2", "node", "mesh", "after the errors"):
            got = seen[case]
            assert got["sizes"] == (4, 2, 2), (rank, case)
            assert got["index"] == (rank % 2, rank // 2), (rank, case)
            assert got["shard_ranks"] == (rank // 2 * 2, rank // 2 * 2 + 1), (rank, case)
            assert got["replica_ranks"] == (rank % 2, rank % 2 + 2), (rank, case)
            assert (got["shard_sum"], got["replica_sum"]) == (shard_sums[rank], replica_sums[rank]), (rank, case)
        assert seen["node reuses the groups"], rank
        assert "hybrid sharding: shard groups of 2 ranks, replicated across 2 groups" in seen["G=2"]["describe"]
        assert "LOCAL_WORLD_SIZE=2" in seen["node"]["describe"]
        assert "('replicate', 'shard')" in seen["mesh"]["describe"]


def test_full_sharding_and_pure_replication(four: list[dict[str, Any]]) -> None:
    """G = N (or None): one shard group of all ranks, no replica group (no collective across
    replicas). G = 1: nothing sharded, every rank a replica of the others."""
    for rank, seen in enumerate(four):
        for case in ("G=4", "None"):
            got = seen[case]
            assert got["sizes"] == (4, 4, 1) and got["index"] == (rank, 0), (rank, case)
            assert got["shard_ranks"] == (0, 1, 2, 3) and got["replica_ranks"] == (rank,)
            assert (got["shard_sum"], got["replica_sum"]) == (10.0, None)
        ones = seen["G=1"]
        assert ones["sizes"] == (4, 1, 4) and ones["index"] == (0, rank)
        assert (ones["shard_sum"], ones["replica_sum"]) == (None, 10.0)
    assert "full sharding over 4 ranks" in four[0]["None"]["describe"]
    assert "no sharding" in four[0]["G=1"]["describe"]


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "G=3",
            "shard_group_size=3 must be a positive divisor of the world size 4 (one of 1, 2, 4) (on ranks 0, 1, 2, 3)",
        ),
        ("G=0", "shard_group_size=0 must be a positive divisor"),
        (
            "G=2 on ranks 0-1, 4 on 2-3",
            "the ranks disagree on the shard group size: G=2 on ranks 0, 1; G=4 on ranks 2, 3",
        ),
        (
            "rank 3 asks for 3",
            "shard_group_size=3 must be a positive divisor of the world size 4 (one of 1, 2, 4) (on ranks 3)",
        ),
        (
            "a mesh on ranks 0-1 only",
            "the ranks disagree on how hybrid sharding is given: a mesh on ranks 0, 1; shard_group_size on ranks 2, 3",
        ),
        ("1-D mesh", "mesh must be a 2-D DeviceMesh with dims (replicate, shard)"),
        ("swapped mesh", "mesh dims are named ('shard', 'replicate')"),
        ("both", "pass shard_group_size or mesh, not both"),
        ("node without LOCAL_WORLD_SIZE", "shard_group_size='node' reads LOCAL_WORLD_SIZE"),
        ("node, LOCAL_WORLD_SIZE=3", "the world size 4 is not a multiple of LOCAL_WORLD_SIZE=3"),
        (
            "node, nodes interleaved",
            "ranks 0..1 form one shard group but run on different nodes (GROUP_RANK 0 on ranks 0, 1 on ranks 1)",
        ),
    ],
)
def test_bad_choices_are_refused_on_every_rank(four: list[dict[str, Any]], case: str, expected: str) -> None:
    for rank, seen in enumerate(four):
        message, seconds = seen[case]
        assert expected in message, (rank, message)
        assert seconds < ERROR_WITHIN_S, (rank, seconds)


def test_one_process_has_one_rank_and_still_checks_the_choice() -> None:
    groups = sharding_groups("node" if "LOCAL_WORLD_SIZE" in os.environ else None)
    assert (groups.world_size, groups.shard_size, groups.replica_size) == (1, 1, 1)
    assert groups.shard_group is None and groups.replica_group is None
    with pytest.raises(ValueError, match="must be None, an int or 'node'"):
        sharding_groups("nodes")


def test_resolve_and_layout_without_a_group() -> None:
    assert resolve_shard_group_size(None, 16) == 16
    assert resolve_shard_group_size(8, 16) == 8
    assert resolve_shard_group_size("node", 16, {"LOCAL_WORLD_SIZE": "8"}) == 8
    with pytest.raises(ValueError, match="must be None, an int or 'node'"):
        resolve_shard_group_size(True, 16)
    with pytest.raises(ValueError, match="not an integer"):
        resolve_shard_group_size("node", 16, {"LOCAL_WORLD_SIZE": "eight"})
    assert consecutive_groups(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])
