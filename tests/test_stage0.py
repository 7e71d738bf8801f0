"""Stage 0 (DDP), the issue's "Done when": parity with plain torch and with torch DDP,
bucket edge cases, overlap, exact byte counts, no_sync, memory, state dict, modes.

World size 1 runs in this process with no process group; 2-4 on harness ranks. Runs are
cached (``tests.support.parity.sharded``) so one run serves every property checked on it.
"""

from __future__ import annotations

import contextlib
import copy
import math
from fractions import Fraction
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import shardpar
from shardpar.comm import collectives as C
from shardpar.core.reduce_strategies import IN_PLACE_MAX_NUMEL
from tests.support.harness import run_ranks
from tests.support.models import (
    KITCHEN,
    KITCHEN_BATCHNORM,
    KITCHEN_BRANCHES,
    MLP,
    TRANSFORMER,
    KitchenSink,
    spec,
    trainable_numel,
)
from tests.support.parity import (
    Recipe,
    Result,
    assert_ranks_identical,
    assert_states_close,
    cap_mb,
    check_parity,
    closed_form_buckets,
    global_batch,
    param_groups,
    rank_slice,
    run,
    sharded,
    train_sharded,
)

WORLD_SIZES = [1, 2, 3, 4]
SEVERAL_BUCKETS = (("bucket_cap_mb", cap_mb(100)),)  # ~100 fp32 elements: several buckets
ALIGNED = SEVERAL_BUCKETS + (("align_for_bandwidth", True),)  # NCCL's layout, on gloo
KITCHEN_ADAMW = Recipe(KITCHEN, steps=3, clip=0.5)

MODELS = {
    "kitchen": KITCHEN_ADAMW,
    "kitchen-rank-branches": Recipe(KITCHEN_BRANCHES, steps=3, clip=0.5, chunked_reference=True),
    "transformer": Recipe(TRANSFORMER, steps=3, clip=0.5),
}


# --------------------------------------------------------------------------- parity


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("model", list(MODELS))
def test_parity_with_plain_torch(model: str, world_size: int) -> None:
    recipe = MODELS[model]
    results = sharded(recipe, 0, world_size, SEVERAL_BUCKETS)
    assert len(results[0].extra["bucket_numels"]) > 1
    check_parity(results, recipe, world_size, what=f"stage 0, {model}, N={world_size}")


# --------------------------------------------------------------------------- torch DDP


# [Note: unused parameters under torch DDP]
# With find_unused_parameters=True, DDP all-reduces zeros for a parameter unused on *this*
# rank, so a parameter used on some ranks only gets the same averaged gradient as under
# shardpar. A parameter unused on *every* rank in a step keeps grad None under DDP (the
# optimizer skips it: no weight decay, no Adam moment decay, no step count), while shardpar
# hands the optimizer a zero gradient. The two update such a parameter the same way only if
# the update of a zero gradient is zero: the parameter never had a gradient (Adam's m = v =
# 0) and its group has no weight decay. So the test puts `unused.*` in the no-decay group
# and compares every tensor; and it uses data (data_seed) for which each branch is used on
# some rank and unused on another in every step, because a branch that is globally unused
# in one step after being used in an earlier one keeps moving under shardpar (its Adam
# moments are non-zero) but not under DDP, and would then change every later forward.
DDP_RECIPE = Recipe(KITCHEN_BATCHNORM, steps=3, clip=0.5, exclude_from_decay=("unused.",), data_seed=1242)


def _ddp_and_shardpar(recipe: Recipe) -> tuple[dict, dict]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = recipe.model.build()
    ddp = DistributedDataParallel(module, find_unused_parameters=True)
    opt = torch.optim.AdamW(
        param_groups(module, lr=recipe.lr, exclude_from_decay=recipe.exclude_from_decay), lr=recipe.lr
    )
    for step in range(recipe.steps):
        x, y = global_batch(module, recipe, step)
        module.loss(ddp(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), recipe.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    ddp_state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return ddp_state, train_sharded(recipe, 0, SEVERAL_BUCKETS).state


def _branches_used(recipe: Recipe, world_size: int) -> list[list[str]]:
    """Per step, the branch each rank runs (a function of the data only)."""
    model = recipe.model.build()
    used = []
    for step in range(recipe.steps):
        x, _ = global_batch(model, recipe, step)
        used.append(
            ["branch_a" if int(rank_slice(x, r, world_size)[0, 0]) % 2 == 0 else "branch_b" for r in range(world_size)]
        )
    return used


@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_with_torch_ddp(world_size: int) -> None:
    # BatchNorm (rank-local batch statistics, rank 0's buffers broadcast before forward),
    # rank-dependent branches, an unused Linear, a tied head and a frozen parameter.
    recipe = DDP_RECIPE
    for step, used in enumerate(_branches_used(recipe, world_size)):
        assert set(used) == {"branch_a", "branch_b"}, f"step {step}: see [Note: unused parameters under torch DDP]"
    for rank, (ddp_state, shardpar_state) in enumerate(run(_ddp_and_shardpar, world_size, recipe)):
        assert_states_close(shardpar_state, ddp_state, what=f"vs DDP, rank {rank}")
        assert torch.equal(shardpar_state["unused.weight"], recipe.model.build().unused.weight)


# --------------------------------------------------------------------------- buckets


BUCKET_CASES = {
    # every parameter in a bucket of its own (cap of one element)
    "one-param-per-bucket": (KITCHEN_ADAMW, (("bucket_cap_mb", cap_mb(1)),)),
    # the cap is smaller than most parameters (emb 128, Linears 64) but holds the biases
    "cap-below-one-param": (KITCHEN_ADAMW, (("bucket_cap_mb", cap_mb(20)),)),
    # the cap is exactly the size of the Linear weights
    "cap-equals-param": (KITCHEN_ADAMW, (("bucket_cap_mb", cap_mb(64)),)),
    "one-bucket": (KITCHEN_ADAMW, ()),
    # one bucket whose size is 1 below, at, and 1 above a multiple of 12 = lcm(1, 2, 3, 4)
    "psi=12k-1": (Recipe(spec("mlp", extra=7), steps=3), ()),
    "psi=12k": (Recipe(spec("mlp", extra=8), steps=3), ()),
    "psi=12k+1": (Recipe(spec("mlp", extra=9), steps=3), ()),
}


@pytest.mark.parametrize("world_size", [3, 4])
@pytest.mark.parametrize("case", list(BUCKET_CASES))
def test_bucket_edge_cases_give_the_same_result(case: str, world_size: int) -> None:
    recipe, options = BUCKET_CASES[case]
    results = sharded(recipe, 0, world_size, options)
    info = results[0].extra
    if case == "one-param-per-bucket":
        trainable = [p for p in recipe.model.build().parameters() if p.requires_grad]
        assert len(info["bucket_numels"]) == len(trainable)
    if case.startswith("psi="):
        assert len(info["bucket_numels"]) == 1
        residue = {"psi=12k-1": 11, "psi=12k": 0, "psi=12k+1": 1}[case]
        assert info["psi"] % 12 == residue
        assert info["padding"] == (-info["psi"]) % world_size
    check_parity(results, recipe, world_size, what=f"stage 0, {case}, N={world_size}")


# --------------------------------------------------------------------------- overlap


def _timeline() -> tuple[list, int]:
    module = MLP.build()
    model = shardpar.wrap(module, stage=0, bucket_cap_mb=cap_mb(1))
    recipe = Recipe(MLP)
    x, y = global_batch(module, recipe, 0)
    x, y = rank_slice(x, C.get_rank(), C.get_world_size()), rank_slice(y, C.get_rank(), C.get_world_size())
    model.engine.reducer.timeline = []
    module.loss(model(x), y).backward()
    return list(model.engine.reducer.timeline), len(model.engine.reducer.buckets)


@pytest.mark.parametrize("world_size", [1, 2])
def test_first_bucket_launches_before_backward_ends(world_size: int) -> None:
    for timeline, buckets in run(_timeline, world_size):
        assert buckets > 2
        launches = [event[1] for event in timeline if event[0] == "launch"]
        assert launches == list(range(buckets)), "buckets launch once each, in bucket order"
        first_launch = timeline.index(("launch", 0))
        last_grad = max(i for i, event in enumerate(timeline) if event[0] == "grad")
        assert first_launch < last_grad, f"no overlap: {timeline}"


# --------------------------------------------------------------------------- bytes & memory


def _expected_sent(factor: int, numel: int, world_size: int, steps: int) -> float:
    return float(Fraction(steps * factor * numel * 4 * (world_size - 1), world_size))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("model", ["kitchen", "transformer"])
def test_all_reduce_bytes_match_the_closed_form(model: str, world_size: int) -> None:
    recipe = MODELS[model]
    results = sharded(recipe, 0, world_size, SEVERAL_BUCKETS)
    psi = trainable_numel(recipe.model.build())
    k = recipe.steps
    for result in results:
        info, comm = result.extra, result.extra["comm"]["all_reduce"]
        assert info["psi"] == psi
        assert comm["calls"] == k * len(info["bucket_numels"])
        assert comm["payload_bytes"] == k * psi * 4
        assert comm["padding_bytes"] == k * info["padding"] * 4
        # k · 2 · Ψ · 4 · (N-1)/N, exactly; padding reported on its own
        assert comm["sent_bytes"] == _expected_sent(2, psi, world_size, k)
        assert comm["padding_sent_bytes"] == _expected_sent(2, info["padding"], world_size, k)
        assert "reduce_scatter" not in result.extra["comm"] and "all_gather" not in result.extra["comm"]


def _trainable_numels_in_layout_order(recipe: Recipe) -> list[int]:
    """Reverse registration order ([Note: layout order]); a tied parameter once."""
    return [p.numel() for p in reversed(list(recipe.model.build().parameters())) if p.requires_grad]


@pytest.mark.parametrize("world_size", [2, 3])
def test_aligned_buckets_train_alike_and_send_the_closed_form(world_size: int) -> None:
    """``align_for_bandwidth=True`` (Megatron-core's layout: parameters at multiples of 64
    elements, buckets of lcm(N, 128)) changes where gradients live, not what training
    computes: parity with plain torch, padding zero in every buffer after every backward, and
    the all-reduce sends Ψ payload plus exactly the closed-form padding (at N = 2 five buckets
    of 128 for 344 parameters: 296 elements, worked out in tests/test_buffer_layout.py)."""
    recipe = KITCHEN_ADAMW
    results = sharded(recipe, 0, world_size, ALIGNED)
    check_parity(results, recipe, world_size, what=f"stage 0 aligned, N={world_size}")
    psi = trainable_numel(recipe.model.build())
    buckets = closed_form_buckets(_trainable_numels_in_layout_order(recipe), world_size, 100, aligned=True)
    padding = sum(size - payload for size, payload in buckets)
    assert all(size % math.lcm(world_size, 128) == 0 for size, _ in buckets)
    if world_size == 2:
        assert (psi, padding, [size for size, _ in buckets]) == (344, 296, [128] * 5)
    k = recipe.steps
    numel_of = {name: p.numel() for name, p in recipe.model.build().named_parameters()}
    for result in results:
        info, comm = result.extra, result.extra["comm"]["all_reduce"]
        # Step 1 reduces in the buckets laid out at wrap; the first backward then rebuilds them
        # in gradient-ready order ([Note: bucket rebuild]), aligned alike: the same closed form
        # over the rebuilt order gives every later step's buckets.
        assert info["at_wrap"]["bucket_numels"] == [size for size, _ in buckets]
        assert info["at_wrap"]["padding"] == padding
        rebuilt_order = [numel_of[name] for names in info["bucket_names"] for name in names]
        rebuilt = closed_form_buckets(rebuilt_order, world_size, 100, aligned=True)
        rebuilt_padding = sum(size - payload for size, payload in rebuilt)
        assert info["bucket_numels"] == [size for size, _ in rebuilt]
        assert (info["psi"], info["padding"]) == (psi, rebuilt_padding)
        assert comm["calls"] == len(buckets) + (k - 1) * len(rebuilt)
        assert comm["payload_bytes"] == k * psi * 4
        sent_padding = padding + (k - 1) * rebuilt_padding
        assert comm["padding_bytes"] == sent_padding * 4
        assert comm["sent_bytes"] == _expected_sent(2, psi, world_size, k)
        assert comm["padding_sent_bytes"] == _expected_sent(2, sent_padding, world_size, 1)
        for largest, looked_at in info["padding_after_backward"]:
            assert largest == 0.0 and looked_at >= 2, "padding of the parameter or gradient buffer is not zero"
        memory = info["memory"]
        assert memory["params"] == 4 * (psi + rebuilt_padding + info["frozen_numel"])
        assert memory["grads"] == 4 * (psi + rebuilt_padding)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_memory_stats_count_params_and_grads_with_padding(world_size: int) -> None:
    recipe = KITCHEN_ADAMW
    psi = trainable_numel(recipe.model.build())
    for result in sharded(recipe, 0, world_size, SEVERAL_BUCKETS):
        padding = result.extra["padding"]
        # closed form: each bucket is padded up to the next multiple of N
        assert padding == sum((-payload) % world_size for payload in result.extra["bucket_payloads"])
        assert sum(result.extra["bucket_payloads"]) == psi
        for memory in [result.extra["memory"], *result.extra["memory_after_backward"]]:
            # frozen parameters are held in full too (and counted as params, as the planner does)
            assert memory["params"] == 4 * (psi + padding + result.extra["frozen_numel"])
            assert memory["grads"] == 4 * (psi + padding)


# --------------------------------------------------------------------------- no_sync


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_no_sync_accumulation_equals_one_big_batch(world_size: int) -> None:
    recipe = KITCHEN_ADAMW.with_(micro_batches=3, steps=2)
    results = sharded(recipe, 0, world_size, SEVERAL_BUCKETS)
    check_parity(results, recipe, world_size, what=f"stage 0 no_sync, N={world_size}")
    # one reduction per step, not one per micro-batch
    buckets = len(results[0].extra["bucket_numels"])
    assert results[0].extra["comm"]["all_reduce"]["calls"] == recipe.steps * buckets


# --------------------------------------------------------------------------- zero_grad


@pytest.mark.parametrize("how", ["model", "module"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_zero_grad_set_to_none_still_trains_correctly(how: str, world_size: int) -> None:
    recipe = KITCHEN_ADAMW.with_(zero_grad=how)
    check_parity(sharded(recipe, 0, world_size, SEVERAL_BUCKETS), recipe, world_size, what=f"zero_grad via {how}")


# --------------------------------------------------------------------------- state dict, modes


@pytest.mark.parametrize("world_size", [1, 2])
def test_full_state_dict_has_the_modules_keys(world_size: int) -> None:
    expected = KITCHEN.build().state_dict()
    for result in sharded(KITCHEN_ADAMW, 0, world_size, SEVERAL_BUCKETS):
        state = result.state
        assert list(state) == list(expected)
        for key in ("emb.weight", "head.weight", "frozen_bias", "scale", "unused.weight"):
            assert key in state
        assert "mask" not in state  # non-persistent buffer, as in module.state_dict()
        assert torch.equal(state["head.weight"], state["emb.weight"])  # tied alias, full tensor
        assert torch.equal(state["frozen_bias"], expected["frozen_bias"])  # frozen: never updated
        for key, tensor in expected.items():
            assert state[key].shape == tensor.shape


def _modes() -> dict:
    recipe = Recipe(KITCHEN_BATCHNORM)
    reference = recipe.model.build()
    module = copy.deepcopy(reference)
    model = shardpar.wrap(module, stage=0)
    x, y = global_batch(module, recipe, 0)
    x, y = rank_slice(x, C.get_rank(), C.get_world_size()), rank_slice(y, C.get_rank(), C.get_world_size())
    out = {}
    model.eval()
    reference.eval()
    out["eval_flags"] = [m.training for m in module.modules()]
    with torch.no_grad():
        got = model(x)
    out["no_grad_requires_grad"] = got.requires_grad
    out["eval_error"] = float((got - reference(x)).detach().abs().max())
    model.train()
    out["train_flags"] = [m.training for m in module.modules()]
    assert model.training
    # A training step still works after the no_grad forward.
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
    module.loss(model(x), y).backward()
    opt.step()
    out["finite"] = all(torch.isfinite(p).all() for p in model.parameters())
    # Forward under no_grad in train mode updates BatchNorm statistics like torch does.
    with torch.no_grad():
        model(x)
    out["bn_batches"] = int(module.bn.num_batches_tracked)
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_train_eval_and_no_grad_forward(world_size: int) -> None:
    for out in run(_modes, world_size):
        assert not any(out["eval_flags"])
        assert all(out["train_flags"])
        assert out["no_grad_requires_grad"] is False
        assert out["eval_error"] <= 1e-6
        assert out["finite"]
        assert out["bn_batches"] == 2


def test_ranks_hold_identical_weights_after_wrap() -> None:
    results = run(_weights_after_wrap, 2)
    assert_ranks_identical(results)


def _weights_after_wrap() -> Result:
    torch.manual_seed(100 + C.get_rank())  # deliberately different initial weights per rank
    model = shardpar.wrap(KitchenSink(norm="batch"), stage=0)
    return Result(state=model.full_state_dict())


# --------------------------------------------------------------------------- gradients in place


def _in_place_run(stage: int) -> dict[str, Any]:
    """Four backwards of the MLP at ``stage`` (several buckets), the third under no_sync
    (accumulated into the fourth): per backward, how many arrivals each of the reducer's two
    paths took; whether ``.grad`` was None after each ``zero_grad``; the final state, and plain
    torch's on the whole batch ([Note: gradients accumulate in the buffer] in core/reducer.py)."""
    from shardpar.core.reducer import GradientReducer

    counts = {"full": 0, "in_place": 0}
    on_grad_ready = GradientReducer.on_grad_ready
    counters = {"arrived_in_place": GradientReducer.arrived_in_place, "arrived_staged": GradientReducer.arrived_staged}

    def full(self: GradientReducer, name: str, param: torch.nn.Parameter) -> Any:
        counts["full"] += 1
        return on_grad_ready(self, name, param)

    def counted(counter: Any) -> Any:
        def in_place(self: GradientReducer, name: str, param: torch.nn.Parameter) -> bool:
            taken: bool = counter(self, name, param)
            counts["in_place"] += taken
            return taken

        return in_place

    GradientReducer.on_grad_ready = full  # type: ignore[method-assign]
    for attribute, counter in counters.items():
        setattr(GradientReducer, attribute, counted(counter))
    try:
        module = MLP.build()
        reference = copy.deepcopy(module)
        model = shardpar.wrap(module, stage=stage, **dict(SEVERAL_BUCKETS))
        opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
        rank, world = C.get_rank(), C.get_world_size()
        rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
        per_backward, none_after_zero_grad = [], []
        for step in range(4):
            x, y = module.example(8, torch.Generator().manual_seed(step))  # type: ignore[operator]
            counts.update(full=0, in_place=0)
            with model.no_sync() if step == 2 else contextlib.nullcontext():
                F.mse_loss(model(x[rows]), y[rows]).backward()
            per_backward.append(dict(counts))
            F.mse_loss(reference(x), y).backward()
            if step != 2:
                opt.step()
                ref_opt.step()
                opt.zero_grad()
                ref_opt.zero_grad()
                none_after_zero_grad.append(all(p.grad is None for p in module.parameters()))
        out = {
            "per_backward": per_backward,
            "buckets": len(model.engine.reducer.buckets),
            "tensors": len(model.engine.reducer.names),
            "largest": max(p.numel() for p in module.parameters()),
            "none_after_zero_grad": none_after_zero_grad,
            "state": model.full_state_dict(),
            "reference": reference.state_dict(),
        }
        model.engine.close()
        return out
    finally:
        GradientReducer.on_grad_ready = on_grad_ready  # type: ignore[method-assign]
        for attribute, counter in counters.items():
            setattr(GradientReducer, attribute, counter)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_gradients_accumulate_in_the_buffer_and_one_arrival_per_bucket_takes_the_full_path(stage: int) -> None:
    """From the second synchronising backward on, autograd accumulates into the buffer's views
    and the reducer counts each arrival in one call (stages 0-1; at stage 2 the reducer counts
    it and the strategy copies it into its staging bucket); only the arrival that completes a
    bucket takes the full path. The first backward (every gradient checked as autograd made
    it) and a no_sync backward take the full path for every gradient. ``zero_grad`` still
    leaves ``.grad`` None, and training matches plain torch on the whole batch."""
    for rank, out in enumerate(run_ranks(_in_place_run, 2, stage, timeout=120)):
        tensors, buckets = out["tensors"], out["buckets"]
        assert buckets > 1, buckets  # several buckets, so several complete during backward
        if stage < 2:  # (stage 2 copies each gradient, of any size)
            assert out["largest"] <= IN_PLACE_MAX_NUMEL["cpu"], out["largest"]  # every tensor small enough
        everything = {"full": tensors, "in_place": 0}
        counted = {"full": buckets, "in_place": tensors - buckets}
        assert out["per_backward"] == [everything, counted, everything, counted], (rank, out["per_backward"])
        assert out["none_after_zero_grad"] == [True, True, True], rank
        assert_states_close(out["state"], out["reference"], what=f"stage {stage}, rank {rank}")
