"""Hybrid sharding (``shard_group_size``): shard within groups of G ranks, replicate across
the N/G groups ([Note: sharding groups] in comm/sharding_groups.py, [Note: reduction under
hybrid sharding] in core/averaging.py). At world size 4 with G = 2: parity with plain torch
on the whole batch under the patterns real scripts use, the bytes per group against the
planner's closed forms, checkpoints that hold each shard once and load at any (N, G, stage),
and bad choices named on every rank."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardpar
from shardpar.comm import collectives as C
from shardpar.planner import estimate_communication
from tests.support.harness import RankFailure, environment, run_ranks
from tests.support.models import KITCHEN_BRANCHES, TRANSFORMER, spec
from tests.support.parity import Recipe, assert_ranks_identical, assert_states_close, cap_mb, check_parity, sharded

CAP = ("bucket_cap_mb", cap_mb(2000))
UNITS = ("min_unit_params", 1)
HYBRID = (("shard_group_size", 2), CAP, UNITS)
FULL = (CAP, UNITS)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_parity_with_plain_torch(stage: int) -> None:
    recipe = Recipe(model=TRANSFORMER, steps=3)
    results = sharded(recipe, stage, 4, HYBRID)
    check_parity(results, recipe, 4, f"stage {stage}, G=2 of 4")
    assert set(results[0].extra["comm"]["by_group"]) == {"shard_group", "replica_group", "all_ranks"}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_checkpointing_a_block_twice_unused_blocks_and_no_sync(stage: int) -> None:
    """Reentrant activation checkpointing, a block that never runs (its parameters get no
    gradient on any rank) and two micro-batches accumulated under ``no_sync``."""
    recipe = Recipe(model=spec("shuffled", checkpoint=True, skip=(1,)), steps=3, micro_batches=2)
    check_parity(sharded(recipe, stage, 4, HYBRID), recipe, 4, f"stage {stage}")


@pytest.mark.parametrize("stage", [2, 3])
def test_rank_dependent_branches(stage: int) -> None:
    """Each rank takes its own branch (stage 3: both in one unit, as stage 3 requires)."""
    recipe = Recipe(model=KITCHEN_BRANCHES, steps=3, chunked_reference=True)
    check_parity(sharded(recipe, stage, 4, (("shard_group_size", 2), CAP)), recipe, 4, f"stage {stage}")


@pytest.mark.parametrize(
    "options",
    [
        (("forward_prefetch_units", 2), ("backward_prefetch_units", 0)),
        (("reshard_after_forward", False), ("prefetch_units", 0)),
    ],
    ids=["prefetch 2/0", "no reshard, no prefetch"],
)
def test_stage_3_prefetch_and_resharding(options: tuple) -> None:
    recipe = Recipe(model=TRANSFORMER, steps=2)
    check_parity(sharded(recipe, 3, 4, HYBRID + options), recipe, 4, str(options))


@pytest.mark.parametrize("stage", [2, 3])
def test_mixed_precision_matches_full_sharding(stage: int) -> None:
    """bf16 compute, fp32 reduction: hybrid sums the same gradients as full sharding in
    another grouping (G, then R), so the two agree to fp32 rounding."""
    recipe = Recipe(model=TRANSFORMER, steps=3)
    mp = (("mixed_precision", "bf16"),)
    hybrid, full = sharded(recipe, stage, 4, HYBRID + mp), sharded(recipe, stage, 4, FULL + mp)
    assert_ranks_identical(hybrid, f"stage {stage}")
    assert_states_close(hybrid[0].state, full[0].state, what=f"stage {stage}, hybrid vs full, bf16")


def test_stage_0_ignores_the_option() -> None:
    recipe = Recipe(model=TRANSFORMER, steps=2)
    hybrid, plain = sharded(recipe, 0, 4, HYBRID), sharded(recipe, 0, 4, FULL)
    assert "by_group" not in hybrid[0].extra["comm"]
    assert hybrid[0].extra["comm"] == plain[0].extra["comm"]
    check_parity(hybrid, recipe, 4, "stage 0")


def test_a_meta_built_hugging_face_model_is_born_sharded_per_shard_group() -> None:
    """A Llama built from a config on the meta device, wrapped with G = 2 of 4: every rank's
    values equal one process's ``model.apply(model._init_weights)``, bit for bit, at stages 1-3."""
    from tests.test_born_sharded import _meta_wraps, _reference

    expected = _reference("llama")
    for rank, states in enumerate(
        run_ranks(_meta_wraps, 4, "llama", (1, 2, 3), (("shard_group_size", 2),), timeout=180)
    ):
        for stage, state in zip((1, 2, 3), states):
            differ = [k for k, v in expected.items() if not torch.equal(state[k], v)]
            assert state.keys() == expected.keys() and not differ, f"stage {stage}, rank {rank}: {differ}"


# --------------------------------------------------------------------------- bytes per group


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bytes_per_group_equal_the_closed_forms(stage: int) -> None:
    """Per step: the reduce-scatters and gathers within the shard group, to the byte on every
    rank; the all-reduce across replicas, Ψ/G per rank on average over the shard group (each
    rank's slice holds its own share of the padding, the payload mean is exact)."""
    recipe = Recipe(model=TRANSFORMER, steps=3)
    results = sharded(recipe, stage, 4, HYBRID)
    estimate = estimate_communication(
        TRANSFORMER.build(), 4, stage, shard_group_size=2, bucket_cap_mb=cap_mb(2000), min_unit_params=1
    )
    expected = estimate.by_group
    steps = recipe.steps
    for rank, result in enumerate(results):
        measured = result.extra["comm"]["by_group"]
        for op in ("reduce_scatter", "all_gather"):
            assert measured["shard_group"][op]["sent_bytes"] == pytest.approx(
                steps * expected["shard_group"][op]["sent_bytes"], rel=1e-12
            ), (rank, op)
        assert set(measured["replica_group"]) - {"control", "total"} == {"all_reduce"}, rank
    replica = [r.extra["comm"]["by_group"]["replica_group"]["all_reduce"] for r in results]
    for shard_group in ([0, 1], [2, 3]):
        mean = sum(replica[r]["sent_bytes"] for r in shard_group) / 2
        assert mean == pytest.approx(steps * expected["replica_group"]["all_reduce"]["sent_bytes"], rel=1e-12)
        calls = {replica[r]["calls"] for r in shard_group}
        assert calls == {steps * expected["replica_group"]["all_reduce"]["calls"]}
    # Ψ/G per rank across replicas, against Ψ·(N-1)/N·2 of a full all-reduce: the point of it.
    psi_bytes = sum(p.numel() for p in TRANSFORMER.build().parameters()) * 4
    assert expected["replica_group"]["all_reduce"]["sent_bytes"] == pytest.approx(2 * (psi_bytes / 2) * (1 / 2))


# --------------------------------------------------------------------------- checkpoints


def _train_and_save(path: str, stage: int, options: tuple) -> dict[str, torch.Tensor]:
    module = TRANSFORMER.build()
    model = shardpar.wrap(module, stage=stage, **dict(options))
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    generator = torch.Generator().manual_seed(7 + C.get_rank())
    for _ in range(2):
        x, y = module.example(4, generator)
        module.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    shardpar.save_checkpoint(path, model, opt, extra={"step": 2})
    state = model.full_state_dict()
    model.engine.close()
    return state


def _load(path: str, stage: int, options: tuple) -> dict[str, torch.Tensor]:
    module = TRANSFORMER.build()
    model = shardpar.wrap(module, stage=stage, **dict(options))
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    shardpar.load_checkpoint(path, model, opt)
    state = model.full_state_dict()
    model.engine.close()
    return state


def _stored_elements(file: Path) -> int:
    """Elements a checkpoint file holds (from its safetensors header; all fp32 here)."""
    with open(file, "rb") as handle:
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    return sum(
        (entry["data_offsets"][1] - entry["data_offsets"][0]) // 4
        for key, entry in header.items()
        if key != "__metadata__"
    )


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_holds_each_shard_once_and_loads_at_any_layout(tmp_path: Path, stage: int) -> None:
    path = tmp_path / "ckpt"
    saved = run_ranks(_train_and_save, 4, str(path), stage, HYBRID, timeout=180)[0]
    numel = sum(p.numel() for p in TRANSFORMER.build().parameters())
    stored = [_stored_elements(path / f"rank-{r:05d}-of-00004.safetensors") for r in range(4)]
    # Once, not once per replica group: the second shard group's files are empty, and the
    # first's hold every parameter and AdamW's two moments of it exactly once.
    assert stored[2:] == [0, 0] and sum(stored) == 3 * numel, stored
    for world_size, load_stage, options in [(4, 2, HYBRID), (2, 3, FULL), (1, 0, ())]:
        loaded = run_ranks(_load, world_size, str(path), load_stage, options, timeout=180)
        for state in loaded:
            assert_states_close(
                state,
                saved,
                tol=0.0,
                what=f"saved at N=4 G=2 stage {stage}, loaded at N={world_size} stage {load_stage} {options}",
            )
    verified = subprocess.run(
        [sys.executable, "tools/inspect_ckpt.py", str(path), "--verify"], capture_output=True, text=True, timeout=120
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_a_checkpoint_of_full_sharding_loads_under_hybrid(tmp_path: Path) -> None:
    path = tmp_path / "full"
    saved = run_ranks(_train_and_save, 2, str(path), 2, FULL, timeout=180)[0]
    for state in run_ranks(_load, 4, str(path), 3, HYBRID, timeout=180):
        assert_states_close(state, saved, tol=0.0, what="saved at N=2 full, loaded at N=4 G=2 stage 3")


# --------------------------------------------------------------------------- bad choices


def _wrap_with(choices: tuple, stage: int) -> str:
    """Wrap with ``choices[rank]`` as this rank's shard_group_size; the error, if any."""
    try:
        shardpar.wrap(TRANSFORMER.build(), stage=stage, shard_group_size=choices[C.get_rank()], **dict(FULL))
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "case, stage, expected",
    [
        ("three", 2, "positive divisor of the world size 4"),
        ("one", 1, "shards nothing at stage 1"),
        ("by rank", 3, "differ between ranks"),
    ],
)
def test_a_bad_shard_group_size_is_named_on_every_rank(case: str, stage: int, expected: str) -> None:
    choices = {"three": (3,) * 4, "one": (1,) * 4, "by rank": (2, 2, 4, 4)}[case]
    messages = run_ranks(_wrap_with, 4, choices, stage, timeout=60)
    assert all(expected in message for message in messages), messages


# --------------------------------------------------------------------------- the planner's pick


def _auto_on_two_nodes(budget: str) -> tuple[int, int, str]:
    """wrap(stage='auto') as if on two nodes of two ranks (torchrun's environment)."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("shardpar")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        with environment(LOCAL_WORLD_SIZE="2", GROUP_RANK=str(C.get_rank() // 2)):
            model = shardpar.wrap(TRANSFORMER.build(), stage="auto", memory_budget=budget, **dict(FULL))
        picked = model.engine.stage, model.engine.shards.shard_size, " ".join(records)
        model.engine.close()
        return picked
    finally:
        logger.removeHandler(handler)


def test_auto_picks_the_shard_group_that_keeps_bytes_inside_nodes() -> None:
    """Two nodes of two: stage 0 all-reduces 2Ψ·3/4 across nodes, full sharding sends every
    collective across them, shard groups of 2 only the owned shards' all-reduce (Ψ/2): with
    room for every plan, stage 1 with G = 2 (the lowest stage sending that little)."""
    for stage, shard_size, reason in run_ranks(_auto_on_two_nodes, 4, "1GB", timeout=60):
        assert (stage, shard_size) == (1, 2), reason
        assert "across nodes" in reason, reason


# --------------------------------------------------------------------------- ranks out of step


def _extra_micro_batch_on_rank_3(stage: int) -> None:
    model = shardpar.wrap(TRANSFORMER.build(), stage=stage, timeout_s=5.0, **dict(HYBRID))
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    module = model.module
    generator = torch.Generator().manual_seed(C.get_rank())
    for step in range(3):
        try:
            for _ in range(2 if step == 1 and C.get_rank() == 3 else 1):
                with model.no_sync():
                    x, y = module.example(2, generator)
                    module.loss(model(x), y).backward()
            x, y = module.example(2, generator)
            module.loss(model(x), y).backward()
        except shardpar.RanksOutOfStep as error:
            raise AssertionError(f"RanksOutOfStep at step {step}: {error}") from error
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize(
    "stage, expected",
    [
        (2, "rank 3: 2 synchronising backward passes, 5 backward passes"),
        (3, "RanksOutOfStep at step 1"),
    ],
)
def test_a_rank_out_of_step_is_named_on_every_rank(stage: int, expected: str) -> None:
    """A rank of the second shard group runs one backward more. Stage 2: the step counters
    ride on the used-parameter flags, an all-reduce over all ranks, so every rank of both
    shard groups and both replica groups names it at the next synchronising backward. Stage
    3: its extra backward gathers units the others do not, a mismatch its own shard group
    sees at the gathers; every rank raises, the others after ``timeout_s`` with what each was
    waiting in (the post-mortem of [Note: ranks out of step])."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_extra_micro_batch_on_rank_3, 4, stage, timeout=60)
    for rank in range(4):
        text = failure.value.failures.get(rank, "")
        assert "RanksOutOfStep at step 1" in text and expected in text, (rank, text[-2000:])
