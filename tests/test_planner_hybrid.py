"""The planner under hybrid sharding (issue #34): memory divides the sharded state by the shard
group size G, bytes split by group in the closed forms of docs/design.md ("Hybrid sharding"),
and ``choose_plan`` picks the stage and G on the ZeRO paper's 7.5B example for 1, 2 and 8 nodes
of 8 GPUs, with its reason. Closed forms only: no ranks are started.
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest
import torch

import shardpar
from shardpar.comm.comm_stats import Collective, CommStats, tally
from shardpar.planner import (
    choose_plan,
    choose_stage,
    estimate_communication,
    estimate_memory,
    shard_group_candidates,
)
from shardpar.planner.communication import group_spans_nodes

PSI = 7_000_000_000  # divisible by every world size below
GB = 1e9


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sharded_state_divides_by_the_shard_group(stage: int) -> None:
    """On N = 16 ranks in shard groups of G = 8 a rank holds what full sharding over 8 ranks
    holds (layouts padded to a multiple of G too); G = N is full sharding, bit for bit."""
    hybrid = estimate_memory(PSI, 16, stage, shard_group_size=8)
    assert hybrid.as_dict() == estimate_memory(PSI, 8, stage).as_dict()
    assert hybrid.shard_group_size == 8 and hybrid.world_size == 16
    expected = {1: 8 * PSI + 8 * PSI // 8, 2: 4 * PSI + 12 * PSI // 8, 3: 16 * PSI // 8}  # DESIGN.md with N -> G
    assert hybrid.model_state == expected[stage]
    assert estimate_memory(PSI, 16, stage, shard_group_size=16) == estimate_memory(PSI, 16, stage)


def test_stage_0_ignores_the_shard_group_size() -> None:
    assert estimate_memory(PSI, 16, 0, shard_group_size=8).as_dict() == estimate_memory(PSI, 16, 0).as_dict()
    plain, hybrid = estimate_communication(PSI, 16, 0), estimate_communication(PSI, 16, 0, shard_group_size=8)
    assert (hybrid.as_dict(), hybrid.by_group, hybrid.calls) == (plain.as_dict(), plain.by_group, plain.calls)
    assert set(plain.by_group) == {"all_ranks"}


def test_node_reads_local_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert estimate_memory(PSI, 16, 3, shard_group_size="node") == estimate_memory(PSI, 16, 3, shard_group_size=8)
    with pytest.raises(ValueError, match="shard_group_size=3 must be a positive divisor of the world size 16"):
        estimate_communication(PSI, 16, 3, shard_group_size=3)


# --------------------------------------------------------------------------- bytes by group


def _sent(estimate, group: str, op: str) -> float:
    return estimate.by_group[group][op]["sent_bytes"]


@pytest.mark.parametrize("b", [4, 2])
def test_bytes_by_group_are_the_closed_forms(b: int) -> None:
    """N = 16, G = 8, R = 2 (f_G = 7/8, f_R = 1/2). Stages 1-2: reduce-scatter Ψ·b·f_G and
    all-gather Ψ·b·f_G within the shard group, all-reduce of the shard 2(Ψ/G)·b·f_R across
    replicas. Stage 3: 3Ψ·b·f_G within (two gathers and a reduce-scatter per unit), the same
    all-reduce across. The flags go over all ranks. The totals sum the groups."""
    n, g = 16, 8
    f_g, f_r = (g - 1) / g, 1 / 2
    within = {1: 2 * PSI * b * f_g, 2: 2 * PSI * b * f_g, 3: 3 * PSI * b * f_g}
    for stage in (1, 2, 3):
        c = estimate_communication(PSI, n, stage, reduce_bytes=b, shard_group_size=g)
        assert set(c.by_group) == {"shard_group", "replica_group", "all_ranks"}
        assert c.by_group["shard_group"]["total"]["sent_bytes"] == pytest.approx(within[stage], rel=1e-12)
        assert _sent(c, "shard_group", "reduce_scatter") == pytest.approx(PSI * b * f_g, rel=1e-12)
        assert c.by_group["replica_group"]["total"]["sent_bytes"] == pytest.approx(2 * PSI / g * b * f_r, rel=1e-12)
        assert set(c.by_group["replica_group"]) == {"all_reduce", "total"}
        flags = c.by_group["all_ranks"]["used_flags"]["sent_bytes"]
        assert flags == pytest.approx(2 * 4 * (PSI // 1_000_000 + 6) * 15 / 16, rel=1e-12)
        groups_total = sum(group["total"]["sent_bytes"] for group in c.by_group.values())
        assert c.sent_bytes == pytest.approx(groups_total, rel=1e-12)
        assert c.as_dict()["all_reduce"] == pytest.approx(2 * PSI / g * b * f_r, rel=1e-12)
        # One all-reduce across replicas per reduce-scatter: per bucket, or per unit at stage 3.
        scatters = c.by_group["shard_group"]["reduce_scatter"]["calls"]
        assert c.by_group["replica_group"]["all_reduce"]["calls"] == scatters


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_full_sharding_keeps_todays_estimate(stage: int) -> None:
    """G = N: no replica group, and every field as without the option."""
    c = estimate_communication(PSI, 16, stage, reduce_bytes=2, bandwidth_gbps=25, latency_us=10)
    assert (
        estimate_communication(PSI, 16, stage, reduce_bytes=2, bandwidth_gbps=25, latency_us=10, shard_group_size=16)
        == c
    )
    assert set(c.by_group) == {"shard_group", "all_ranks"} and c.shard_group_size == 16


def test_the_tally_is_a_comm_stats_snapshot() -> None:
    """The planner's collectives summed per group have the shape and the values the engines'
    counters give for the same calls."""
    stats = CommStats()
    for _ in range(3):
        stats.record_bytes("reduce_scatter", 1000, 24, 8)
    assert tally([Collective("reduce_scatter", "shard_group", 8, 3000, 72, calls=3)]) == {
        "shard_group": stats.snapshot()
    }


def test_which_groups_span_nodes() -> None:
    # 2 nodes of 8: shard groups of 8 stay in a node, replica groups {r, r+8} do not.
    assert group_spans_nodes(16, 8, 8) == {"shard_group": False, "replica_group": True, "all_ranks": True}
    assert group_spans_nodes(16, 16, 8) == {"shard_group": True, "replica_group": False, "all_ranks": True}
    assert group_spans_nodes(64, 2, 8)["shard_group"] is False
    assert group_spans_nodes(24, 3, 8)["shard_group"] is True  # 3 does not divide 8: ranks 6-8 straddle
    assert not any(group_spans_nodes(8, 2, 8).values())  # one node
    assert shard_group_candidates(64, 8) == [2, 4, 8, 16, 32, 64]
    assert shard_group_candidates(12, 4) == [2, 4, 12]
    assert shard_group_candidates(1, 1) == [1]


# --------------------------------------------------------------------------- the ZeRO paper's example

ZERO_PSI = 7_500_000_000
FP16 = shardpar.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
ZERO = dict(mixed_precision=FP16, optimizer="adam", largest_unit_params=ZERO_PSI // 100)
"""Mixed-precision Adam as the paper has it: fp16 parameters and gradients, fp32 master and
moments (K = 12), units of Ψ/100 at stage 3."""


def test_the_papers_memory_figures() -> None:
    """ZeRO (Rajbhandari et al. 2020), Figure 1: Ψ = 7.5B, K = 12, N_d = 64: 120 GB per GPU
    with DP, 31.4 GB at P_os, 16.6 GB at P_os+g, 1.9 GB at P_os+g+p. shardpar holds what the
    paper counts plus the fp32 gradients its optimizer steps on (the paper converts them a
    partition at a time): 4Ψ at stage 0, 4Ψ/N of them at stage 1 beside the fp16 gradients, at
    stage 2 fp32 instead of fp16 shards (+2Ψ/N); at stage 3 the two agree."""
    psi, n = ZERO_PSI, 64
    paper = {0: (2 + 2 + 12) * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n, 3: 16 * psi / n}
    assert [round(paper[s] / GB, 1) for s in range(4)] == [120.0, 31.4, 16.6, 1.9]
    extra = {0: 4 * psi, 1: 4 * psi / n, 2: 2 * psi / n, 3: 0}
    for stage in range(4):
        e = estimate_memory(psi, n, stage, **ZERO)
        assert e.model_state == pytest.approx(paper[stage] + extra[stage], rel=1e-12), stage


@pytest.mark.parametrize(
    "nodes, budget, stage, shard_group_size, phrases",
    [
        # One node: nothing crosses nodes; 120 GB + the fp32 gradients exceed 80 GB, stage 1 fits
        # sharded over the node, and stages 0-2 send 2Ψ·2·7/8 = 26.25 GB at every G: the lowest
        # stage, then the largest G.
        (
            1,
            "80GB",
            1,
            8,
            [
                "stage 1, full sharding over 8 ranks",
                "45.00 GB per rank",
                "one node",
                "26.25 GB per step",
                "shard groups of 4 ranks (within a node) replicated 2 times sends as "
                "many bytes with smaller shard groups",
            ],
        ),
        # Two nodes, 32 GB: stage 2 in shard groups of a node sends only the shard's all-reduce
        # across nodes, 2(Ψ/8)·2·1/2 = 1.88 GB; stage 3 with G = 8 as little, but more in all.
        (
            2,
            "32GB",
            2,
            8,
            [
                "stage 2, shard groups of 8 ranks (within a node) replicated 2 times",
                "1.88 GB per step across nodes",
                "stage 3, shard groups of 8 ranks (within a node) replicated 2 times sends "
                "as few across nodes but 41.25 GB in all",
            ],
        ),
        # Eight nodes, a budget stage 0 fits (150 GB): its all-reduce sends 2Ψ·2·63/64 = 29.5 GB
        # across nodes; stage 1 in node-sized shard groups 2(Ψ/8)·2·7/8 = 3.28 GB.
        (
            8,
            "200GB",
            1,
            8,
            [
                "stage 1, shard groups of 8 ranks (within a node) replicated 8 times",
                "19 of 19 plans fit",
                "3.28 GB per step across nodes",
            ],
        ),
        # Eight nodes, 16 GB: only stage 3 fits in a node (15 GB + 0.75 GB of units).
        (
            8,
            "16GB",
            3,
            8,
            [
                "stage 3, shard groups of 8 ranks (within a node) replicated 8 times",
                "15.75 GB per rank",
                "the fewest across nodes; next: stage 3, shard groups of 16 ranks (spanning 2 nodes) "
                "replicated 4 times sends 43.59 GB across nodes",
            ],
        ),
        # Eight nodes, 4 GB: only full sharding fits, and all of stage 3 crosses nodes.
        (8, "4GB", 3, 64, ["stage 3, full sharding over 64 ranks", "the only one of 19 plans that fits"]),
    ],
)
def test_the_pick_on_nodes_of_8(nodes: int, budget: str, stage: int, shard_group_size: int, phrases: list[str]) -> None:
    plan = choose_plan(ZERO_PSI, 8 * nodes, budget, node_size=8, **ZERO)
    assert (plan.stage, plan.shard_group_size) == (stage, shard_group_size), plan.reason
    for phrase in phrases:
        assert phrase in plan.reason, plan.reason
    assert plan.memory.total <= shardpar.planner.parse_bytes(budget)
    # What it says it sends across nodes: the replica all-reduce when the shard group is a node.
    if nodes > 1 and shard_group_size == 8:
        shard = plan.communication.by_group["replica_group"]["all_reduce"]["sent_bytes"]
        assert shard == pytest.approx(2 * ZERO_PSI / 8 * 2 * (nodes - 1) / nodes, rel=1e-12)
        assert plan.bytes_across_nodes == pytest.approx(shard + plan.communication.used_flags_bytes, rel=1e-12)


def test_no_plan_fits() -> None:
    with pytest.raises(
        ValueError,
        match=r"no plan \(stage, shard group size\) fits the memory budget of 1.00 GB "
        r".* \(stage 3, full sharding over 64 ranks\)",
    ):
        choose_plan(ZERO_PSI, 64, "1GB", node_size=8, **ZERO)
    with pytest.raises(ValueError, match="not a multiple of node_size=3"):
        choose_plan(ZERO_PSI, 64, "80GB", node_size=3)


def test_one_node_without_mixed_precision_picks_what_choose_stage_picks() -> None:
    """fp32: every stage 0-2 plan sends 2Ψ·4·(N-1)/N, so the lowest stage that fits wins, as
    ``choose_stage`` has it, sharded over the whole node."""
    picks = []
    for n, psi, budget in [(1, 1_500_000_000, "24GiB"), (2, 1_500_000_000, "20GB"), (8, PSI, "80GB"), (8, PSI, "30GB")]:
        plan = choose_plan(psi, n, budget, node_size=n)
        assert plan.stage == choose_stage(psi, n, budget), (n, budget)
        assert plan.shard_group_size == (None if plan.stage == 0 else n)
        picks.append(plan.stage)
    assert picks == [0, 1, 1, 3]
    # Two nodes sharded over both (G = 16 only): stages 0-2 send the same 2Ψ·2·15/16, all of it
    # across nodes, so stage 0 wins the tie.
    fixed = choose_plan(ZERO_PSI, 16, "200GB", node_size=8, shard_group_sizes=[16], **ZERO)
    assert (fixed.stage, fixed.shard_group_size) == (0, None), fixed.reason
    assert "stage 1, full sharding over 16 ranks sends as many bytes at a higher stage" in fixed.reason


def test_the_docs_example_prints_what_it_shows() -> None:
    """docs/planner.md ("Many nodes") pastes what its example prints; keep it true."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "planner.md").read_text()
    section = doc[doc.index("## Many nodes: hybrid sharding") :]
    code, printed = re.search(r"```python\n(.*?)```\n\nprints .*?\n\n```\n(.*?)```", section, re.S).groups()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "docs/planner.md", "exec"), {})
    assert out.getvalue() == printed


# --------------------------------------------------------------------------- whole-tensor ownership


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_owners_are_ranks_of_the_shard_group(stage: int) -> None:
    """Tensors owned whole ([Note: planned ownership] in shardpar/planner/shapes.py) are owned
    within the shard group: on N = 4 in groups of G = 2 a rank holds what it holds on 2 ranks
    with the same tensors owned, and the shard group's collectives are those of 2 ranks."""
    from tests.test_planner import ThreeMatrices

    model = ThreeMatrices()
    names = [name for name, _ in model.named_parameters()]
    hybrid = estimate_memory(model, 4, stage, optimizer="muon", shard_group_size=2, whole_tensors=names)
    assert hybrid.as_dict() == estimate_memory(model, 2, stage, optimizer="muon", whole_tensors=names).as_dict()
    assert hybrid.optimizer_state == 4 * 512  # one rank of the group owns two of the three
    comm = estimate_communication(model, 4, stage, shard_group_size=2, whole_tensors=names)
    alone = estimate_communication(model, 2, stage, whole_tensors=names)
    assert comm.by_group["shard_group"] == alone.by_group["shard_group"]
    assert (
        comm.by_group["shard_group"]
        != estimate_communication(model, 4, stage, shard_group_size=2).by_group["shard_group"]
    )
