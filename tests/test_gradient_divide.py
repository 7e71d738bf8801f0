"""``gradient_divide_factor``: gradients summed over the ranks (1.0), or divided by any factor,
instead of averaged -- FSDP2's ``set_gradient_divide_factor``, torch DDP's sum hook.

- Parity with torch DDP whose communication hook divides by the same factor (1.0: it only
  all-reduces), at stages 0-3 on 2 ranks and under hybrid sharding (G = 2 of 4) at stages
  1-3: parameters after SGD-with-momentum steps (linear in the gradient, so a wrong scale
  shows, where Adam would hide it) and the clipping norms, which are the gradients' norms.
  Clipping clips the summed gradients, as torch's on DDP's does.
- A factor F gives N/F times the mean: the first step's norm is the default run's times N/F.
- ``comm_stats()`` equals the default run's exactly: the factor changes scaling passes only.
- Reduction in bf16, and fp16 with ``GradScaler`` and ``no_sync`` accumulation: summing with
  learning rate η equals averaging with N·η, bit for bit at N = 2 (the two differ by a factor
  of two, exact in binary floating point while nothing under- or overflows).
- World size 1: the factor still divides (0.5 doubles the gradients).
- Bad values raise a TypeError/ValueError naming the option, on every rank; ranks passing
  different factors are caught at wrap like any other option mismatch.
- :func:`shardpar.core.averaging.averaging`'s factors in closed form, NCCL's ``avg`` included
  (no NCCL here: the decision is a pure function).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import shardpar
from shardpar.comm import collectives as C
from shardpar.core.averaging import Averaging, averaging
from tests.support.models import KITCHEN, TRANSFORMER
from tests.support.parity import (
    Recipe,
    Result,
    assert_close_values,
    assert_ranks_identical,
    assert_states_close,
    build_optimizer,
    cap_mb,
    global_batch,
    rank_slice,
    reference,
    run,
    sharded,
    train_sharded,
)

STAGES = (0, 1, 2, 3)
OPTIONS = (("bucket_cap_mb", cap_mb(2000)), ("min_unit_params", 1))
"""Several buckets at stages 0-2, several units at stage 3."""
HYBRID = (("shard_group_size", 2),) + OPTIONS
SGD = Recipe(model=TRANSFORMER, steps=3, optimizer="SGD", optimizer_options=(("momentum", 0.9),), lr=0.05, clip=1.0)
"""Two param groups (weight decay 0.1 / 0.0, the second at half the rate), clipped at 1.0."""
NO_SYNC = SGD.with_(micro_batches=2)


def with_factor(options: tuple, factor: float | None) -> tuple:
    return options + (("gradient_divide_factor", factor),)


# --------------------------------------------------------------------------- torch DDP


def divide_then_sum(factor, bucket):  # type: ignore[no-untyped-def]
    """DDP communication hook: the bucket divided by ``factor`` (1.0: untouched), then summed.
    Unannotated: DDP compares the annotations with ``dist.GradBucket`` and this module's are
    strings (``from __future__ import annotations``)."""
    tensor = bucket.buffer()
    if factor != 1.0:
        tensor.div_(factor)
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda done: done.value()[0])


def train_ddp(recipe: Recipe, factor: float) -> Result:
    """torch DDP with :func:`divide_then_sum`, trained as :func:`tests.support.parity.train_sharded`
    trains shardpar: the same rank slices, ``no_sync`` micro-batches, clipping and optimizer."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    module = recipe.model.build()
    ddp = DistributedDataParallel(module)
    ddp.register_comm_hook(factor, divide_then_sum)
    opt, _ = build_optimizer(recipe, module, lambda cls, params, **kw: cls(params, **kw))
    result = Result(state={})
    for step in range(recipe.steps):
        for index in range(recipe.micro_batches):
            x, y = global_batch(module, recipe, step, index)
            last = index == recipe.micro_batches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
                (module.loss(ddp(x), y) / recipe.micro_batches).backward()
        result.norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), recipe.clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    result.state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return result


def shardpar_and_ddp(recipe: Recipe, stage: int, options: tuple, factor: float) -> tuple[Result, Result]:
    return train_sharded(recipe, stage, with_factor(options, factor)), train_ddp(recipe, factor)


@functools.cache
def against_ddp(
    recipe: Recipe, stage: int, world_size: int, options: tuple, factor: float
) -> list[tuple[Result, Result]]:
    return run(shardpar_and_ddp, world_size, recipe, stage, options, factor, timeout=180)


def check_against_ddp(recipe: Recipe, stage: int, world_size: int, options: tuple, factor: float) -> None:
    what = f"stage {stage}, N={world_size}, {dict(options)}, factor {factor}"
    results = against_ddp(recipe, stage, world_size, options, factor)
    assert_ranks_identical([ours for ours, _ in results], what)
    for rank, (ours, ddp) in enumerate(results):
        assert_states_close(ours.state, ddp.state, what=f"{what}: rank {rank} vs DDP")
        assert_close_values(ours.norms, ddp.norms, what=f"{what}: clip norms on rank {rank} vs DDP")
    # Summed over N = world_size ranks, the norms are far above the clip (1.0): clipping ran.
    assert all(norm > recipe.clip for norm in results[0][0].norms), results[0][0].norms


@pytest.mark.parametrize("factor", [1.0, 3.0], ids=["sum", "divided by 3"])
@pytest.mark.parametrize("stage", STAGES)
def test_parity_with_torch_ddp_and_a_dividing_hook(stage: int, factor: float) -> None:
    check_against_ddp(SGD, stage, 2, OPTIONS, factor)


@pytest.mark.parametrize("stage", STAGES)
def test_no_sync_accumulation_sums(stage: int) -> None:
    """Two micro-batches, the first under ``no_sync``: the accumulated gradients are summed once."""
    check_against_ddp(NO_SYNC, stage, 2, OPTIONS, 1.0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hybrid_sharding_divides_once_over_both_collectives(stage: int) -> None:
    """G = 2 of 4: the reduce-scatter within the shard group and the all-reduce across the
    replicas together divide by exactly the factor (not once per group)."""
    check_against_ddp(SGD, stage, 4, HYBRID, 1.0)
    check_against_ddp(SGD, stage, 4, HYBRID, 3.0)
    assert set(against_ddp(SGD, stage, 4, HYBRID, 1.0)[0][0].extra["comm"]["by_group"]) >= {
        "shard_group",
        "replica_group",
    }


@pytest.mark.parametrize("factor", [1.0, 3.0])
@pytest.mark.parametrize("stage", STAGES)
def test_a_factor_gives_world_over_factor_times_the_mean(stage: int, factor: float) -> None:
    """Before the first step both runs see the same gradients; the clip norm is theirs. The
    default run is the mean (DESIGN.md's parity with plain torch on the concatenated batch)."""
    mean = sharded(SGD, stage, 2, OPTIONS)
    divided = against_ddp(SGD, stage, 2, OPTIONS, factor)
    assert_close_values([mean[0].norms[0]], reference(SGD).norms[:1], what=f"stage {stage}: default vs plain torch")
    for rank in range(2):
        assert_close_values(
            [divided[rank][0].norms[0]],
            [mean[rank].norms[0] * 2 / factor],
            what=f"stage {stage}, factor {factor}, rank {rank}",
        )


@pytest.mark.parametrize(
    "world_size,stage,options", [(2, s, OPTIONS) for s in STAGES] + [(4, s, HYBRID) for s in (1, 2, 3)]
)
def test_comm_stats_equal_the_default_runs(world_size: int, stage: int, options: tuple) -> None:
    """Same collectives, same bytes, same counts, per group under hybrid sharding."""
    mean = sharded(SGD, stage, world_size, options)
    for factor in (1.0, 3.0):
        divided = against_ddp(SGD, stage, world_size, options, factor)
        for rank in range(world_size):
            assert divided[rank][0].extra["comm"] == mean[rank].extra["comm"], (factor, rank)


def test_an_explicit_world_size_is_the_default() -> None:
    """``gradient_divide_factor=2.0`` at N = 2 is the mean: bit for bit the default run."""
    for stage in STAGES:
        default, explicit = sharded(SGD, stage, 2, OPTIONS), sharded(SGD, stage, 2, with_factor(OPTIONS, 2))
        for name, tensor in default[0].state.items():
            assert torch.equal(explicit[0].state[name], tensor), (stage, name)


# --------------------------------------------------------------------------- low precision


BF16_REDUCE = shardpar.MixedPrecision(
    param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
)
FP16_REDUCE = shardpar.MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
LOW_PRECISION = Recipe(
    model=KITCHEN,
    steps=4,
    optimizer="SGD",
    optimizer_options=(("momentum", 0.9),),
    lr=0.02,
    groups=False,
    clip=None,
    micro_batches=2,
)
"""SGD without weight decay or clipping: the update is linear in the gradient, so summing at
learning rate η and averaging at N·η take the same steps."""
INIT_SCALE = 2.0**12
"""A power of two (scaling is exact) with which these gradients neither under- nor overflow."""


def train_low_precision(
    stage: int, policy: shardpar.MixedPrecision, factor: float | None, lr: float, loss_scaling: bool
) -> tuple[list[dict[str, torch.Tensor]], list[bool]]:
    """``LOW_PRECISION`` at ``lr`` with ``no_sync`` micro-batches; the full state after every
    step and, with loss scaling, whether the scaler found an inf."""
    rank, world_size = C.get_rank(), C.get_world_size()
    recipe = LOW_PRECISION.with_(lr=lr)
    module = recipe.model.build()
    options = dict(with_factor(OPTIONS, factor))
    if stage == 3:
        options["wrap_policy"] = lambda name, sub: name in ("body", "out")  # KitchenSink's units
    model = shardpar.wrap(module, stage=stage, mixed_precision=policy, **options)
    opt, _ = build_optimizer(recipe, model, lambda cls, params, **kw: shardpar.optimizer(model, cls, params, **kw))
    scaler = shardpar.GradScaler(model, init_scale=INIT_SCALE) if loss_scaling else None
    states, found_inf = [], []
    for step in range(recipe.steps):
        for index in range(recipe.micro_batches):
            x, y = global_batch(module, recipe, step, index)
            last = index == recipe.micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = module.loss(model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
                loss = loss / recipe.micro_batches
                (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.step(opt)
            found_inf.append(scaler.found_inf)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
        states.append(model.full_state_dict())
    model.engine.close()
    return states, found_inf


def sum_and_mean(stage: int, policy: shardpar.MixedPrecision, loss_scaling: bool) -> tuple[Any, Any]:
    lr = LOW_PRECISION.lr
    return (
        train_low_precision(stage, policy, 1.0, lr, loss_scaling),
        train_low_precision(stage, policy, None, lr * C.get_world_size(), loss_scaling),
    )


@pytest.mark.parametrize(
    "policy,loss_scaling", [(BF16_REDUCE, False), (FP16_REDUCE, True)], ids=["bf16 reduce", "fp16 reduce, GradScaler"]
)
@pytest.mark.parametrize("stage", STAGES)
def test_low_precision_sum_at_lr_equals_mean_at_world_times_lr(stage: int, policy: Any, loss_scaling: bool) -> None:
    what = f"stage {stage}, reduce {policy.reduce_dtype}"
    for rank, ((summed, summed_inf), (mean, mean_inf)) in enumerate(run(sum_and_mean, 2, stage, policy, loss_scaling)):
        assert summed_inf == mean_inf == ([False] * LOW_PRECISION.steps if loss_scaling else []), (what, rank)
        for step, (a, b) in enumerate(zip(summed, mean)):
            differ = [name for name, tensor in b.items() if not torch.equal(a[name], tensor)]
            assert not differ, f"{what}, rank {rank}, after step {step}: {differ}"
        first = LOW_PRECISION.model.build().state_dict()
        assert any(not torch.equal(summed[0][k], v) for k, v in first.items() if v.is_floating_point()), what


# --------------------------------------------------------------------------- world size 1


@pytest.mark.parametrize("stage", STAGES)
def test_world_size_1_still_divides(stage: int) -> None:
    """No process group: a factor of 0.5 doubles the gradients, the same SGD steps as plain
    torch at twice the learning rate."""
    recipe = LOW_PRECISION.with_(micro_batches=1, lr=0.01)
    ours = train_sharded(recipe, stage, with_factor(OPTIONS, 0.5))
    assert_states_close(ours.state, reference(recipe.with_(lr=0.02)).state, what=f"stage {stage}, N=1")


# --------------------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    "value,error",
    [
        (0, ValueError),
        (-1.0, ValueError),
        (math.nan, ValueError),
        (math.inf, ValueError),
        (-math.inf, ValueError),
        (10**400, ValueError),
        ("1.0", TypeError),
        (True, TypeError),
        ([1.0], TypeError),
    ],
)
def test_bad_values_name_the_option(value: Any, error: type) -> None:
    with pytest.raises(error, match="gradient_divide_factor"):
        shardpar.ShardConfig(gradient_divide_factor=value)
    with pytest.raises(error, match="gradient_divide_factor"):
        shardpar.wrap(TRANSFORMER.build(), stage=1, gradient_divide_factor=value)


def test_accepted_values() -> None:
    assert shardpar.ShardConfig().gradient_divide_factor is None
    assert shardpar.ShardConfig(gradient_divide_factor=2).gradient_divide_factor == 2.0
    assert isinstance(shardpar.ShardConfig(gradient_divide_factor=2).gradient_divide_factor, float)
    assert shardpar.ShardConfig(gradient_divide_factor=1e-3).gradient_divide_factor == 1e-3
    # Straight from a config file: numpy scalars are numbers.
    assert shardpar.ShardConfig(gradient_divide_factor=np.float32(0.5)).gradient_divide_factor == 0.5
    assert shardpar.ShardConfig(gradient_divide_factor=np.int64(4)).gradient_divide_factor == 4.0


def wrap_outcome(factors: list[Any]) -> str:
    try:
        shardpar.wrap(TRANSFORMER.build(), stage=2, gradient_divide_factor=factors[C.get_rank()])
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "wrapped"


def test_a_bad_value_on_one_rank_or_ranks_disagreeing_fail_on_every_rank() -> None:
    bad = run(wrap_outcome, 2, [1.0, -1.0])
    assert all(o.startswith("ValueError") and "gradient_divide_factor" in o for o in bad), bad
    assert "rank 1" in bad[0], bad
    mismatch = run(wrap_outcome, 2, [1.0, None])
    for outcome in mismatch:
        assert outcome.startswith("ValueError") and "differ between ranks" in outcome, mismatch
        assert "gradient_divide_factor=1.0" in outcome and "gradient_divide_factor=None" in outcome, mismatch
    assert run(wrap_outcome, 2, [2, 2.0]) == ["wrapped", "wrapped"]  # the same request


def test_lightning_strategies_accept_the_option() -> None:
    from shardpar.integrations.lightning import ShardparFabricStrategy, ShardparStrategy

    for strategy in (ShardparStrategy, ShardparFabricStrategy):
        strategy(stage=2, gradient_divide_factor=1.0)
        with pytest.raises(ValueError, match="gradient_divide_factor"):
            strategy(stage=2, gradient_divide_factor=0.0)


# --------------------------------------------------------------------------- the factors


def test_averaging_factors_in_closed_form() -> None:
    """[Note: averaging]: the default is unchanged (None = N), any other factor sums on every
    backend and applies 1/F around the collective, once; fp16 splits around F."""
    for dtype in (torch.float32, torch.bfloat16):
        for nccl in (True, False):
            for divide_before in (True, False):
                for n in (1, 2, 4):
                    assert averaging(dtype, n, nccl, divide_before, float(n)) == averaging(
                        dtype, n, nccl, divide_before
                    )
                    assert averaging(dtype, n, nccl, divide_before, 1.0) == Averaging()  # a sum: no pass
                side = "before" if divide_before else "after"
                assert averaging(dtype, 4, nccl, divide_before, 3.0) == Averaging(**{side: 1 / 3})  # never "avg"
                assert averaging(dtype, 1, nccl, divide_before, 0.5) == Averaging(**{side: 2.0})
    fp16 = torch.float16
    for nccl in (True, False):
        assert averaging(fp16, 4, nccl, True, 1.0) == Averaging()
        assert averaging(fp16, 4, nccl, True, 4.0) == Averaging(before=0.5, after=0.5)
        assert averaging(fp16, 2, nccl, False, 16.0) == Averaging(before=0.25, after=0.25)
        assert averaging(fp16, 8, nccl, False, 3.0) == Averaging(before=0.5, after=2 / 3)
        assert averaging(fp16, 8, nccl, False, 1.5) == Averaging(after=1 / 1.5)  # never divide by more than F first
        assert averaging(fp16, 2, nccl, False, 0.5) == Averaging(after=2.0)
    for dtype in (torch.float32, torch.bfloat16, fp16):
        for factor in (0.5, 1.0, 1.5, 3.0, 4.0, 8.0, 100.0):
            plan = averaging(dtype, 8, False, False, factor)
            assert plan.op == "sum" and math.isclose(plan.before * plan.after, 1 / factor, rel_tol=1e-15), (
                dtype,
                factor,
            )
