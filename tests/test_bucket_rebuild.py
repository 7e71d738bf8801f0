"""Bucket rebuild (issue 16): at stages 0-2 the buckets are laid out again, once, from the
order gradients became ready in the first synchronising backward ([Note: bucket rebuild] in
shardpar/core/rebuild.py).

The model, ``ShuffledBlocks``, runs its blocks in another order than it registers them and
uses two parameters registered on itself at the very end of forward; every tensor has 36
elements and a bucket holds two (``CAP``). In the layout made at wrap (reverse registration
order) buckets straddle blocks that run at different times, and the bucket holding the
model's own parameters, whose gradients are ready first, is predicted to complete last by the
first-forward launch order: on main it is launched only at the end of backward. Checked here:

- after the first backward the buckets hold exactly the closed form: the recorded ready
  order, cut into pairs (unused parameters last); on every later backward each bucket's
  gradients arrive back to back and its collective is launched right after the last of them
  (``reducer.timeline``);
- stages 0, 1, 2, world sizes 2 and 3, SGD with momentum and AdamW: losses and parameters of
  every step match plain torch on the global batch (fp32, 1e-5 relative); under mixed
  precision (bf16 compute; fp16 compute with fp16 reduction) every step equals, bit for bit,
  the same run with ``rebuild_buckets=False`` (world size 2 and the deterministic reduce-
  scatters of world size 3; gloo's all-reduce at world size 3 sums in an order that depends
  on where an element sits in the bucket, so stage 0 there is compared to 1e-6);
- ``memory_stats()`` is the same just before and just after the rebuild and equal to a run
  without it; ``comm_stats()`` of every step equals the run without it, except the one-off
  kind ``rebuild`` on the first step, which equals its closed form, and the object gather of
  the new order (kind ``control``);
- a rebuild after loading a checkpoint before the first step (optimizer state present)
  trains exactly like a run without rebuild; checkpoints cross between runs with and without
  rebuild and between world sizes;
- gradient accumulation under ``no_sync`` before the first synchronising backward, a block
  never run (its parameters go last), reentrant activation checkpointing (same collectives
  per step as without it), stage 3 (nothing rebuilt), and an optimizer left behind.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks
from tests.support.models import spec
from tests.support.parity import Recipe, build_optimizer, cap_mb, global_batch, rank_slice, rel_error, run

NUMEL = 36  # elements of every tensor of ShuffledBlocks
CAP = (("bucket_cap_mb", cap_mb(2 * NUMEL)),)  # two tensors per bucket
MODEL = spec("shuffled")
STEPS = 4
TOLERANCE = 1e-5
RECIPES = {
    "sgd-momentum": Recipe(
        MODEL, steps=STEPS, optimizer="SGD", lr=0.1, optimizer_options=(("momentum", 0.9),), groups=False, clip=None
    ),
    "adamw": Recipe(MODEL, steps=STEPS, clip=0.5),  # two param groups, lr/2 on the second
}
FP16_REDUCE = shardpar.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)
POLICIES = {"fp32": None, "bf16": "bf16", "fp16-reduce": FP16_REDUCE}


# --------------------------------------------------------------------------- rank side


def _expected_buckets(ready: list[str], unused: list[str]) -> list[list[str]]:
    """The closed form: every tensor has NUMEL elements and a bucket holds two, so the buckets
    are the ready order, then the parameters that got no gradient, cut into pairs."""
    order = ready + unused
    return [order[i : i + 2] for i in range(0, len(order), 2)]


def _back_to_back(timeline: list[tuple[str, Any]], buckets: list[list[str]], unused: set[str]) -> str | None:
    """None if every bucket's gradients arrived one after the other and its collective was
    launched right after the last of them (a bucket of unused parameters, with none);
    otherwise what went wrong."""
    pending: list[str] = []
    launched = []
    for kind, what in timeline:
        if kind == "grad":
            pending.append(what)
            continue
        expected = sorted(set(buckets[what]) - unused)
        if sorted(pending) != expected:
            return f"bucket {what} {buckets[what]} launched after gradients {pending}: {timeline}"
        pending = []
        launched.append(what)
    if pending or sorted(launched) != list(range(len(buckets))):
        return f"gradients {pending} never launched, or buckets launched {launched}: {timeline}"
    return None


def train(
    recipe: Recipe,
    stage: int,
    options: tuple = (),
    load: str | None = None,
    save: str | None = None,
    first_step: int = 0,
) -> dict[str, Any]:
    """Train ``recipe`` on this rank (steps ``first_step`` on, optionally after loading the
    checkpoint ``load``); record what the tests check, per step."""
    rank, world_size = C.get_rank(), C.get_world_size()
    module = recipe.model.build()
    model = shardpar.wrap(module, stage=stage, **dict(CAP + tuple(options)))
    opt, _ = build_optimizer(recipe, model, lambda cls, params, **kw: shardpar.optimizer(model, cls, params, **kw))
    engine = model.engine
    out: dict[str, Any] = {
        "at_wrap": [list(b.names) for b in engine.reducer.buckets],
        "timelines": [],
        "losses": [],
        "states": [],
        "comm": [],
        "memory": [],
        "buckets": [],
        "launch_order": [],
        "unused": [],
    }
    rebuild = engine._rebuild_buckets

    def around_rebuild() -> None:
        out["memory_before_rebuild"] = model.memory_stats()
        rebuild()
        out["memory_after_rebuild"] = model.memory_stats()

    engine._rebuild_buckets = around_rebuild
    if load is not None:
        shardpar.load_checkpoint(load, model, opt)
    for step in range(first_step, first_step + recipe.steps):
        engine.reducer.timeline = []
        model.reset_comm_stats()
        micro = recipe.micro_batches
        losses = []
        for index in range(micro):
            x, y = global_batch(module, recipe, step, index)
            with contextlib.nullcontext() if index == micro - 1 else model.no_sync():
                loss = module.loss(model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)) / micro
                loss.backward()
            losses.append(float(loss.detach()))
        out["unused"].append(sorted(engine.reducer.unused))
        out["buckets"].append([list(b.names) for b in engine.reducer.buckets])
        out["launch_order"].append(list(engine.reducer.launch_order.order))
        out["timelines"].append(list(engine.reducer.timeline))
        engine.reducer.timeline = None
        if recipe.clip is not None:
            model.clip_grad_norm_(recipe.clip)
        opt.step()
        opt.zero_grad()
        out["comm"].append({op: stats for op, stats in model.comm_stats().items() if op != "total"})
        out["memory"].append(model.memory_stats())
        out["losses"].append(sum(losses))
        out["states"].append(model.full_state_dict())
    out["layout_generation"] = engine.layout_generation
    if save is not None:
        shardpar.save_checkpoint(save, model, opt)
    engine.close()
    return out


def train_many(jobs: tuple) -> list[dict[str, Any]]:
    return [train(*job) for job in jobs]


def reference(recipe: Recipe, first_step: int = 0) -> dict[str, Any]:
    """Plain torch on the global batch: per step the loss and the parameters."""
    model = recipe.model.build()
    opt, _ = build_optimizer(recipe, model, lambda cls, params, **kw: cls(params, **kw))
    out: dict[str, Any] = {"losses": [], "states": []}
    for step in range(first_step + recipe.steps):
        losses = []
        for index in range(recipe.micro_batches):
            x, y = global_batch(model, recipe, step, index)
            loss = model.loss(model(x), y) / recipe.micro_batches
            loss.backward()
            losses.append(float(loss.detach()))
        if recipe.clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)
        opt.step()
        opt.zero_grad()
        out["losses"].append(sum(losses))
        out["states"].append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return {key: values[first_step:] for key, values in out.items()}


# --------------------------------------------------------------------------- runs


def _jobs() -> tuple:
    return tuple(
        (recipe, stage, (("mixed_precision", policy), ("rebuild_buckets", rebuild)))
        for recipe in RECIPES.values()
        for stage in (0, 1, 2)
        for policy in POLICIES.values()
        for rebuild in (True, False)
    )


@functools.cache
def runs(world_size: int) -> dict[tuple, list[dict[str, Any]]]:
    """``(optimizer, stage, policy, rebuild) -> per-rank records``; one harness call."""
    jobs = _jobs()
    per_rank = run_ranks(train_many, world_size, jobs, timeout=600)
    keys = [
        (opt, stage, policy, rebuild)
        for opt in RECIPES
        for stage in (0, 1, 2)
        for policy in POLICIES
        for rebuild in (True, False)
    ]
    return {key: [per_rank[r][i] for r in range(world_size)] for i, key in enumerate(keys)}


CASES = [(opt, stage, policy, n) for n in (2, 3) for stage in (0, 1, 2) for policy in POLICIES for opt in RECIPES]
CASE_IDS = [f"{opt}-stage{stage}-{policy}-N{n}" for opt, stage, policy, n in CASES]


def _ready_order(timeline: list[tuple[str, Any]]) -> list[str]:
    return [what for kind, what in timeline if kind == "grad"]


# --------------------------------------------------------------------------- membership and launches


@pytest.mark.parametrize("optimizer, stage, policy, world_size", CASES, ids=CASE_IDS)
def test_buckets_follow_the_first_backwards_ready_order(
    optimizer: str, stage: int, policy: str, world_size: int
) -> None:
    records = runs(world_size)[(optimizer, stage, policy, True)]
    first = records[0]
    ready = _ready_order(first["timelines"][0])  # rank 0's record is the one every rank adopts
    expected = _expected_buckets(ready, [])
    assert first["at_wrap"] != expected, "the wrap-time layout already is the rebuilt one: nothing is tested"
    for rank, record in enumerate(records):
        assert record["layout_generation"] == 1
        for step in range(STEPS):
            assert record["buckets"][step] == expected, f"rank {rank}, step {step}"
            # One dtype: the buckets launch in layout order, which is the order they complete.
            assert record["launch_order"][step] == list(range(len(expected)))
        # The first backward reduced in the wrap-time buckets; every later one in the rebuilt.
        for step in range(1, STEPS):
            problem = _back_to_back(record["timelines"][step], expected, set())
            assert problem is None, f"rank {rank}, step {step}: {problem}"


@pytest.mark.parametrize("world_size", [2, 3])
def test_without_rebuild_the_model_launches_a_bucket_late(world_size: int) -> None:
    """The control: with ``rebuild_buckets=False`` (main's behaviour) the wrap-time buckets
    stay, and the bucket of the model's own parameters, ready first, is launched last."""
    for record in runs(world_size)[("adamw", 0, "fp32", False)]:
        assert record["layout_generation"] == 0
        buckets = record["at_wrap"]
        for step in range(STEPS):
            assert record["buckets"][step] == buckets
            assert _back_to_back(record["timelines"][step], buckets, set()) is not None
            last_launch = [what for kind, what in record["timelines"][step] if kind == "launch"][-1]
            assert set(buckets[last_launch]) == {"mix", "head"}
            assert _ready_order(record["timelines"][step])[:2] == ["head", "mix"]


# --------------------------------------------------------------------------- results


def _assert_same_steps(got: dict[str, Any], want: dict[str, Any], tolerance: float, what: str) -> None:
    for step, (a, b) in enumerate(zip(got["states"], want["states"])):
        assert list(a) == list(b), what
        for name, tensor in b.items():
            if tolerance == 0:
                assert torch.equal(a[name], tensor), f"{what}, step {step}: '{name}' differs"
            else:
                err = rel_error(a[name], tensor)
                assert err <= tolerance, f"{what}, step {step}: '{name}' differs by {err:.3g} relative"


@pytest.mark.parametrize("optimizer, stage, policy, world_size", CASES, ids=CASE_IDS)
def test_training_matches_plain_torch_and_the_run_without_rebuild(
    optimizer: str, stage: int, policy: str, world_size: int
) -> None:
    records = runs(world_size)[(optimizer, stage, policy, True)]
    without = runs(world_size)[(optimizer, stage, policy, False)]
    for rank, record in enumerate(records):
        for step in range(STEPS):
            for name, tensor in records[0]["states"][step].items():
                assert torch.equal(record["states"][step][name], tensor), f"rank {rank} differs from rank 0"
    if policy == "fp32":
        expected = reference(RECIPES[optimizer])
        losses = [sum(r["losses"][step] for r in records) / world_size for step in range(STEPS)]
        for step, (a, b) in enumerate(zip(losses, expected["losses"])):
            assert abs(a - b) <= TOLERANCE * abs(b), f"step {step}: loss {a} vs plain torch {b}"
        _assert_same_steps(records[0], expected, TOLERANCE, "vs plain torch")
    # Reductions sum each element over ranks alone, whatever bucket it is in; only gloo's
    # all-reduce at N = 3 (stage 0) adds in an order that depends on the element's place, and
    # clipping sums squares over each rank's owned pieces, which the layout decides. Then one
    # rounding differs: an fp32 ulp, or with fp16 reduction an fp16 ulp of a gradient (2^-11),
    # which AdamW, normalising every update, turns into up to lr·2^-11 per step (measured:
    # 1.2e-4 relative after 4 steps; a lost rank or a wrong scale shows at 1e-2 and more).
    exact = (world_size == 2 or stage > 0) and RECIPES[optimizer].clip is None
    tolerance = 0.0 if exact else 1e-3 if policy == "fp16-reduce" else 1e-6
    _assert_same_steps(records[0], without[0], tolerance, f"vs rebuild_buckets=False ({policy})")


# --------------------------------------------------------------------------- memory and traffic


def _moved_tensors(stage: int, policy: str) -> int:
    """Sharded tensors the rebuild moves across ranks before any step (no optimizer state):
    the reduced gradients (stage 2's fp32 shards; stage 1's owned slices, or their fp32 copy
    when they are fp16) and, under mixed precision, the fp32 master shards."""
    if stage == 0:
        return 0
    return 1 + (policy != "fp32")


@pytest.mark.parametrize("optimizer, stage, policy, world_size", CASES, ids=CASE_IDS)
def test_memory_and_traffic_are_those_of_the_run_without_rebuild(
    optimizer: str, stage: int, policy: str, world_size: int
) -> None:
    records = runs(world_size)[(optimizer, stage, policy, True)]
    without = runs(world_size)[(optimizer, stage, policy, False)]
    psi = 14 * NUMEL
    f = (world_size - 1) / world_size
    for record, plain in zip(records, without):
        assert record["memory_before_rebuild"] == record["memory_after_rebuild"]
        for step, (stats, plain_stats) in enumerate(zip(record["memory"], plain["memory"])):
            stats, plain_stats = dict(stats), dict(plain_stats)
            # Stage 2's peak staging is what the rebuild is for: never higher than without it.
            assert stats.pop("peak_staging", 0) <= plain_stats.pop("peak_staging", 0)
            assert stats == plain_stats, f"step {step}"
        for step, (ops, plain_ops) in enumerate(zip(record["comm"], plain["comm"])):
            ops, plain_ops = dict(ops), dict(plain_ops)
            one_off = ops.pop("rebuild", None)
            if step == 0:  # the agreement on the new order: one object all-gather (two calls) more, and at
                # stages 1-2 one more as the optimizer follows ([Note: optimizers follow the layout])
                control, plain_control = ops.pop("control"), plain_ops.pop("control")
                assert control["calls"] == plain_control["calls"] + 2 + 2 * (stage > 0), (control, plain_control)
            assert ops == plain_ops, f"step {step}"
            moved = _moved_tensors(stage, policy) if step == 0 else 0
            if not moved:
                assert one_off is None, f"step {step}"
                continue
            assert one_off["calls"] == moved * len(record["at_wrap"])  # one all-gather per old bucket
            assert one_off["payload_bytes"] == moved * psi * 4
            assert one_off["sent_bytes"] == pytest.approx(moved * psi * 4 * f, rel=1e-12)
            assert one_off["padding_bytes"] == 0  # 72-element buckets: no padding at N = 2, 3


# --------------------------------------------------------------------------- checkpoints


def _save_then_load_with_and_without_rebuild(path: str, stage: int, policy: Any) -> tuple[dict, dict]:
    mp = (("mixed_precision", policy),)
    recipe = RECIPES["adamw"].with_(clip=None)
    train(recipe.with_(steps=2), stage, mp + (("rebuild_buckets", False),), save=path)
    on = train(recipe.with_(steps=3), stage, mp, load=path, first_step=2)
    off = train(recipe.with_(steps=3), stage, mp + (("rebuild_buckets", False),), load=path, first_step=2)
    return on, off


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_rebuild_after_loading_a_checkpoint_trains_like_no_rebuild(tmp_path: Path, stage: int, policy: str) -> None:
    """A checkpoint saved after 2 steps, loaded before the first step of a fresh run: the
    rebuild at that run's first backward moves the loaded optimizer state (and master
    shards) to the new pieces. The run continues bit for bit like one that never rebuilds."""
    path = str(tmp_path / "ckpt")
    for on, off in run_ranks(_save_then_load_with_and_without_rebuild, 2, path, stage, POLICIES[policy], timeout=300):
        assert on["layout_generation"] == 1 and off["layout_generation"] == 0
        assert on["losses"] == off["losses"]
        _assert_same_steps(on, off, 0.0, "rebuilt after loading vs not rebuilt")


def test_checkpoints_cross_between_rebuilt_and_plain_layouts_and_world_sizes(tmp_path: Path) -> None:
    """Saved after the rebuild (stage 2, N = 2) and loaded without it (stage 1, N = 3), and
    the other way round: both continue plain torch's training (1e-5)."""
    recipe = RECIPES["adamw"]
    expected = reference(recipe.with_(steps=2), first_step=2)
    for (save_n, save_stage, save_rebuild), (load_n, load_stage, load_rebuild) in [
        ((2, 2, True), (3, 1, False)),
        ((3, 1, False), (2, 2, True)),
    ]:
        path = str(tmp_path / f"from-{save_n}")
        saved = run_ranks(
            train, save_n, recipe.with_(steps=2), save_stage, (("rebuild_buckets", save_rebuild),), save=path
        )
        assert saved[0]["layout_generation"] == int(save_rebuild)
        loaded = run_ranks(
            train,
            load_n,
            recipe.with_(steps=2),
            load_stage,
            (("rebuild_buckets", load_rebuild),),
            load=path,
            first_step=2,
        )
        assert loaded[0]["layout_generation"] == int(load_rebuild)
        _assert_same_steps(loaded[0], expected, TOLERANCE, f"saved at N={save_n}, loaded at N={load_n}")


# --------------------------------------------------------------------------- training patterns


def _one(world_size: int, recipe: Recipe, stage: int, options: tuple = ()) -> list[dict[str, Any]]:
    return run(train, world_size, recipe, stage, options, timeout=300)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_no_sync_micro_batches_before_the_first_synchronising_backward(stage: int) -> None:
    """Three micro-batches, the first two under ``no_sync``: only the synchronising backward
    is recorded, and the training is plain torch's on the concatenated batch."""
    recipe = RECIPES["adamw"].with_(micro_batches=3, steps=3)
    records = _one(2, recipe, stage)
    ready = _ready_order(records[0]["timelines"][0])
    assert sorted(ready) == sorted(n for bucket in records[0]["at_wrap"] for n in bucket)
    for record in records:
        assert record["buckets"][0] == _expected_buckets(ready, [])
        assert _back_to_back(record["timelines"][1], record["buckets"][1], set()) is None
    _assert_same_steps(records[0], reference(recipe), TOLERANCE, f"stage {stage} with no_sync")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_no_rank_uses_go_last(stage: int) -> None:
    """Block 3 never runs: its three tensors get no gradient, so they go last, in the order
    of the wrap-time layout; plain torch leaves them untouched and so does shardpar."""
    recipe = RECIPES["adamw"].with_(model=spec("shuffled", skip=(3,)), steps=3)
    records = _one(2, recipe, stage)
    unused = ["blocks.3.b.weight", "blocks.3.a.weight", "blocks.3.gate"]  # reverse registration order
    assert [n for bucket in records[0]["at_wrap"] for n in bucket if n.startswith("blocks.3.")] == unused
    ready = _ready_order(records[0]["timelines"][0])
    expected = _expected_buckets(ready, unused)
    for record in records:
        assert record["unused"] == [sorted(unused)] * recipe.steps
        assert record["buckets"][0] == expected
        assert _back_to_back(record["timelines"][1], expected, set(unused)) is None
    _assert_same_steps(records[0], reference(recipe), TOLERANCE, f"stage {stage}, unused block")


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_reentrant_activation_checkpointing_changes_no_collective(stage: int) -> None:
    recipe = RECIPES["adamw"].with_(steps=3)
    plain = _one(2, recipe, stage)
    checkpointed = _one(2, recipe.with_(model=spec("shuffled", checkpoint=True)), stage)
    for a, b in zip(checkpointed, plain):
        assert a["buckets"] == b["buckets"]
        assert a["comm"] == b["comm"]
        assert a["layout_generation"] == 1
        _assert_same_steps(a, b, TOLERANCE, f"stage {stage}, checkpointed")


def test_stage_3_keeps_its_units() -> None:
    module = spec("shuffled").build()
    model = shardpar.wrap(module, stage=3, min_unit_params=1)
    assert model.engine.reducer.ready_order is None
    x, y = module.example(4, torch.Generator().manual_seed(0))
    before = [list(b.names) for b in model.engine.reducer.buckets]
    module.loss(model(x), y).backward()
    assert model.engine.layout_generation == 0
    assert [list(b.names) for b in model.engine.reducer.buckets] == before


def _late_follower(stage: int) -> dict[bool, dict[str, torch.Tensor]]:
    """Two AdamW optimizers over the two halves of the model, both built before the rebuild;
    the second steps only from the third step on (a discriminator's warm-up), so it follows
    the new layout two steps after the rebuild ([Note: optimizers follow the layout])."""
    out = {}
    for rebuild in (True, False):
        module = spec("shuffled").build()
        model = shardpar.wrap(module, stage=stage, rebuild_buckets=rebuild, **dict(CAP))
        params = [p for _, p in module.named_parameters()]
        first = shardpar.optimizer(model, torch.optim.AdamW, params[: len(params) // 2], lr=1e-2)
        second = shardpar.optimizer(model, torch.optim.AdamW, params[len(params) // 2 :], lr=1e-2)
        for step in range(5):
            x, y = module.example(4, torch.Generator().manual_seed(10 * step + C.get_rank()))
            module.loss(model(x), y).backward()
            first.step()
            if step >= 2:
                second.step()
            first.zero_grad()
            second.zero_grad()
        assert model.engine.layout_generation == int(rebuild)
        out[rebuild] = model.full_state_dict()
        model.engine.close()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_an_optimizer_first_used_after_the_rebuild_follows_it(stage: int) -> None:
    for result in run_ranks(_late_follower, 2, stage, timeout=120):
        for name, value in result[False].items():
            torch.testing.assert_close(result[True][name], value, rtol=1e-5, atol=1e-6, msg=name)
            assert not torch.equal(value, spec("shuffled").build().state_dict()[name]), f"{name} never trained"
