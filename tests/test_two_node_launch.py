"""Two torchrun agents as two "nodes" on loopback (tests/support/launch.py, issue #34): torchrun's
c10d rendezvous numbers the ranks node by node, ``shard_group_size="node"`` puts each
node's ranks in one shard group and pairs them across nodes in replica groups, and stage 3
trained that way ends where plain torch on the whole batch does."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.support.launch import run_nodes
from tests.support.models import TRANSFORMER
from tests.support.parity import Recipe, assert_states_close, reference
from tests.support.two_node_script import TRAINING

SCRIPT = Path(__file__).resolve().parent / "support" / "two_node_script.py"


def test_two_agents_make_two_nodes_of_two() -> None:
    run = run_nodes(SCRIPT, nodes=2, nproc_per_node=2, timeout=120)
    assert run.ok and sorted(run.ranks) == [0, 1, 2, 3], run.output()
    for rank, seen in run.ranks.items():
        node = rank // 2
        assert (seen["WORLD_SIZE"], seen["LOCAL_WORLD_SIZE"], seen["RANK"]) == ("4", "2", str(rank)), seen
        assert seen["LOCAL_RANK"] == str(rank % 2) and seen["MASTER_ADDR"] == "127.0.0.1", seen
        assert seen["world_sum"] == 10.0  # 1 + 2 + 3 + 4
        assert seen["shard_ranks"] == [2 * node, 2 * node + 1], seen
        assert seen["replica_ranks"] == [rank % 2, rank % 2 + 2], seen
        assert seen["shard_sum"] == [3.0, 7.0][node] and seen["replica_sum"] == [4.0, 6.0][rank % 2], seen
        assert seen["alive_after_destroy"] == 0, seen
    expected = reference(Recipe(model=TRANSFORMER, groups=False, clip=None, **TRAINING)).state
    for rank, seen in run.ranks.items():
        trained = {name: torch.tensor(values).view(expected[name].shape) for name, values in seen["trained"].items()}
        assert_states_close(trained, expected, what=f"rank {rank}, stage 3 sharded per node")
    # Each agent is one node: its two ranks share a GROUP_RANK, and the agents have 0 and 1.
    assert {run.ranks[r]["GROUP_RANK"] for r in (0, 1)} != {run.ranks[r]["GROUP_RANK"] for r in (2, 3)}
    assert sorted(run.ranks[r]["GROUP_RANK"] for r in range(4)) == ["0", "0", "1", "1"]
