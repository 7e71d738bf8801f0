"""fp16 dynamic loss scaling with ``shardpar.GradScaler`` at every stage (issue 6).

An inf/nan gradient may be visible on one rank only: the rank whose loss overflowed before the
gradient collective, or -- once gradients are reduce-scattered (stages 1-3) -- only the rank that
owns the poisoned element. Every rank must still skip the same steps and keep the same scale,
or the ranks' parameters (and their collectives) drift apart.

Run with ``python -m pytest -q tests/test_grad_scaler.py``.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks
from tests.support.models import KITCHEN, ModelSpec
from tests.support.parity import Recipe, build_optimizer, cap_mb, global_batch, rank_slice, run

FP16 = torch.float16
STAGES = (0, 1, 2, 3)
INIT_SCALE = 2.0**12
"""Large enough that fp16 gradients of these models neither underflow nor overflow on their own
(so the only skipped step is the injected one), and a power of two, so scaling is exact."""
GROWTH_INTERVAL = 2
STEPS = 6
INJECT_STEP = 2


def kitchen_units(name: str, module: torch.nn.Module) -> bool:
    return name in ("body", "out")


OPTIONS = {s: (("bucket_cap_mb", cap_mb(100)),) for s in (0, 1, 2)} | {3: (("wrap_policy", kitchen_units),)}


@dataclass
class ScalerTrace:
    states: list[dict[str, torch.Tensor]] = field(default_factory=list)
    """Parameters (fp32 masters) before step 0 and after every step."""
    scales: list[float] = field(default_factory=list)
    """``get_scale()`` after each ``update()``."""
    found_inf: list[bool] = field(default_factory=list)
    local_nonfinite: list[bool] = field(default_factory=list)
    """Whether this rank's own reduced gradients held inf/nan before the cross-rank check."""
    skipped: list[int] = field(default_factory=list)
    adam_steps: set[float] = field(default_factory=set)
    compute_dtype: torch.dtype | None = None


def _poison_one_element(model: shardpar.ShardedModule, owner: int) -> Any:
    """A hook that writes inf into one gradient element that rank ``owner`` owns after the
    reduce-scatter (stages 1-3; at stage 0 every rank ends up with it)."""
    flat = model.engine.storage.spaces[0]  # the first trainable parameter space
    piece = next(iter(flat.layout.pieces(owner)))
    param = flat.params[piece.name]
    index = piece.param_range.start

    def poison(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad.view(-1)[index] = math.inf
        return grad

    return param.register_hook(poison)


def train_fp16(
    stage: int, inject: str | None, skip_step: bool = False, spec: ModelSpec = KITCHEN, explicit_unscale: bool = True
) -> ScalerTrace:
    """Train fp16 with loss scaling on this rank. ``inject``: None, "loss" (the last rank's loss
    times inf at INJECT_STEP) or "element" (rank 0 poisons one gradient element the last rank
    owns). ``skip_step``: leave INJECT_STEP out entirely (the run a skipped step must equal)."""
    rank, world_size = C.get_rank(), C.get_world_size()
    recipe = Recipe(spec, steps=STEPS, clip=1.0)
    module = spec.build()
    model = shardpar.wrap(module, stage=stage, mixed_precision="fp16", **dict(OPTIONS[stage]))
    opt, _ = build_optimizer(recipe, model, lambda cls, params, **kw: shardpar.optimizer(model, cls, params, **kw))
    scaler = shardpar.GradScaler(model, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    names = [n for n, _ in module.named_parameters()]
    trace = ScalerTrace(compute_dtype=next(model.parameters()).dtype)

    def params_now() -> dict[str, torch.Tensor]:
        state = model.full_state_dict()
        return {n: state[n] for n in names}

    trace.states.append(params_now())
    for step in range(STEPS):
        if skip_step and step == INJECT_STEP:
            continue
        hook = None
        if inject == "element" and step == INJECT_STEP and rank == 0:
            hook = _poison_one_element(model, owner=world_size - 1)
        x, y = global_batch(module, recipe, step)
        loss = module.loss(model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size))
        if inject == "loss" and step == INJECT_STEP and rank == world_size - 1:
            loss = loss * math.inf
        scaler.scale(loss).backward()
        if hook is not None:
            hook.remove()
        grads, _ = model.engine.owned_grads()
        trace.local_nonfinite.append(any(not torch.isfinite(g).all() for g in grads))
        if explicit_unscale:
            scaler.unscale_(opt)  # before clipping, as with torch's scaler
            model.clip_grad_norm_(recipe.clip)
        scaler.step(opt)
        trace.found_inf.append(scaler.found_inf)
        scaler.update()
        opt.zero_grad()
        trace.scales.append(scaler.get_scale())
        trace.skipped.append(scaler.skipped_steps)
        trace.states.append(params_now())
    trace.adam_steps = {float(s["step"]) for s in opt.state.values() if "step" in s}
    model.engine.close()
    return trace


@functools.cache
def traces(
    world_size: int, stage: int, inject: str | None, skip_step: bool = False, explicit_unscale: bool = True
) -> list[ScalerTrace]:
    return run(train_fp16, world_size, stage, inject, skip_step, KITCHEN, explicit_unscale, timeout=120)


def torch_scales(found_inf: list[bool]) -> list[float]:
    """The scale ``torch.amp.GradScaler`` has after each update for an overflow pattern."""
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
    weight = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([weight], lr=0.0)
    out = []
    for overflow in found_inf:
        loss = weight.sum() * (math.inf if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out.append(scaler.get_scale())
    return out


CASES = [(2, s, "loss") for s in STAGES] + [(2, s, "element") for s in (1, 2, 3)] + [(3, 2, "loss"), (3, 3, "element")]


def _explicit(stage: int) -> bool:
    return stage % 2 == 0  # stages 1 and 3 let step() unscale (and skip clipping)


@pytest.mark.parametrize("world_size,stage,inject", CASES)
def test_overflow_on_one_rank_skips_the_step_on_every_rank(world_size: int, stage: int, inject: str) -> None:
    """One rank's inf makes every rank skip that step: parameters (fp32 masters) unchanged and
    bitwise equal on all ranks, ``skipped_steps`` 1, Adam's step counter not advanced, the scale
    halved and then grown again after GROWTH_INTERVAL clean steps, exactly as torch's scaler."""
    per_rank = traces(world_size, stage, inject, False, _explicit(stage))
    what = f"N={world_size}, stage {stage}, inf via {inject}"
    expected_found = [step == INJECT_STEP for step in range(STEPS)]
    for rank, trace in enumerate(per_rank):
        assert trace.compute_dtype == FP16, what
        assert trace.found_inf == expected_found, f"{what}: rank {rank} found_inf {trace.found_inf}"
        assert trace.skipped == [int(step >= INJECT_STEP) for step in range(STEPS)], f"{what}: rank {rank}"
        for name, before in trace.states[INJECT_STEP].items():
            assert torch.equal(trace.states[INJECT_STEP + 1][name], before), f"{what}: rank {rank} changed '{name}'"
        for step in range(STEPS):
            if step != INJECT_STEP:
                moved = any(
                    not torch.equal(trace.states[step + 1][n], trace.states[step][n]) for n in trace.states[step]
                )
                assert moved, f"{what}: rank {rank} did not step at clean step {step}"
        assert trace.adam_steps == {float(STEPS - 1)}, f"{what}: rank {rank} Adam steps {trace.adam_steps}"
        assert trace.scales == torch_scales(expected_found), f"{what}: rank {rank} scales {trace.scales}"
        assert trace.scales[INJECT_STEP] == trace.scales[INJECT_STEP - 1] / 2
        assert trace.scales[INJECT_STEP + GROWTH_INTERVAL] == 2 * trace.scales[INJECT_STEP]
    for rank, trace in enumerate(per_rank[1:], start=1):
        for step, state in enumerate(trace.states):
            for name, tensor in per_rank[0].states[step].items():
                assert torch.equal(state[name], tensor), (
                    f"{what}: '{name}' differs on rank {rank} after step {step - 1}"
                )


@pytest.mark.parametrize("world_size,stage", [(2, 1), (2, 2), (2, 3), (3, 3)])
def test_inf_visible_in_one_shard_only_still_skips_everywhere(world_size: int, stage: int) -> None:
    """The poisoned element is reduce-scattered to its owner only: before the cross-rank check
    exactly one rank (the last) holds a non-finite gradient, yet every rank reports found_inf."""
    per_rank = traces(world_size, stage, "element", False, _explicit(stage))
    local = [trace.local_nonfinite[INJECT_STEP] for trace in per_rank]
    assert local == [False] * (world_size - 1) + [True], local
    assert all(trace.found_inf[INJECT_STEP] for trace in per_rank)


@pytest.mark.parametrize("world_size,stage", [(2, s) for s in STAGES] + [(3, 2)])
def test_training_after_a_skipped_step_equals_training_without_that_step(world_size: int, stage: int) -> None:
    """After the skip, training continues as if the overflowing step had never been taken: the
    run with the injected inf equals, at every later step, a run that leaves that step out.
    Bitwise: the two differ only in the loss scale (halved by the skip), and multiplying by a
    power of two is exact in binary floating point as long as nothing under/overflows -- which
    INIT_SCALE ensures for these models (no step but the injected one is skipped)."""
    injected = traces(world_size, stage, "loss", False, _explicit(stage))[0]
    left_out = run(train_fp16, world_size, stage, None, True, KITCHEN, _explicit(stage), timeout=120)[0]
    assert left_out.skipped[-1] == 0
    # injected.states: before, after 0, 1, 2 (skipped), 3, 4, 5; left_out: before, after 0, 1, 3, 4, 5.
    expected = injected.states[: INJECT_STEP + 1] + injected.states[INJECT_STEP + 2 :]
    assert len(left_out.states) == len(expected)
    for index, (state, reference) in enumerate(zip(left_out.states, expected)):
        for name, tensor in reference.items():
            assert torch.equal(state[name], tensor), f"stage {stage}: '{name}' differs at state {index}"


def _step_without_backward_after_an_overflow(stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = shardpar.wrap(module, stage=stage, mixed_precision="fp16", **({"min_unit_params": 1} if stage == 3 else {}))
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
    scaler = shardpar.GradScaler(model, init_scale=2.0**40, growth_interval=1000)  # fp16 gradients overflow
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(C.get_rank()))
    scaler.scale(model(x).float().square().mean()).backward()
    scaler.step(opt)
    found = [scaler.found_inf]
    scaler.update()
    opt.zero_grad()
    before = model.full_state_dict()
    scaler.step(opt)  # a skipped batch: no backward since zero_grad
    found.append(scaler.found_inf)
    scaler.update()
    unchanged = all(torch.equal(before[k], v) for k, v in model.full_state_dict().items())
    model.engine.close()
    return {"found": found, "scale": scaler.get_scale(), "skipped": scaler.skipped_steps, "unchanged": unchanged}


@pytest.mark.parametrize("stage", STAGES)
def test_a_step_without_backward_after_an_overflow_is_not_another_overflow(stage: int) -> None:
    # The gradient buffers still held the overflowed step's inf after zero_grad(); at stages
    # 2-3 the unscale read them, so the step was skipped as an overflow and the scale backed
    # off twice. With every gradient None there is nothing to check (torch's scaler records
    # no inf check then): the step changes nothing and the scale stays.
    for rank, out in enumerate(run_ranks(_step_without_backward_after_an_overflow, 2, stage, timeout=120)):
        assert out == {"found": [True, False], "scale": 2.0**39, "skipped": 1, "unchanged": True}, (rank, out)


# --------------------------------------------------------------------------- single process


def _wrapped(stage: int = 0) -> shardpar.ShardedModule:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    return shardpar.wrap(module, stage=stage, mixed_precision="fp16")


def _one_backward(model: shardpar.ShardedModule, scaler: shardpar.GradScaler) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))
    scaler.scale(model(x).float().square().mean()).backward()


def test_unscale_twice_raises() -> None:
    model = _wrapped()
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
    scaler = shardpar.GradScaler(model, init_scale=2.0**8)
    _one_backward(model, scaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.unscale_(opt)
    scaler.step(opt)  # uses the one unscale, does not unscale again
    scaler.update()
    opt.zero_grad()
    _one_backward(model, scaler)
    scaler.unscale_(opt)  # allowed again after update()


def test_unscale_divides_by_the_scale_exactly() -> None:
    """fp32 master gradients after ``unscale_`` equal the unscaled run's (power-of-two scale)."""
    grads = []
    for scale in (2.0**8, 1.0):
        model = _wrapped()
        opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
        scaler = shardpar.GradScaler(model, init_scale=scale)
        _one_backward(model, scaler)
        scaler.unscale_(opt)
        grads.append([g.clone() for g in model.engine.owned_grads()[0]])
    for scaled, plain in zip(*grads):
        assert scaled.dtype == torch.float32
        assert torch.equal(scaled, plain)


def test_state_dict_round_trip() -> None:
    model = _wrapped()
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
    source = shardpar.GradScaler(model, init_scale=2.0**9, growth_factor=4.0, backoff_factor=0.25, growth_interval=3)
    for _ in range(4):  # 3 clean steps grow the scale once, then the tracker is at 1
        _one_backward(model, source)
        source.step(opt)
        source.update()
        opt.zero_grad()
    state = source.state_dict()
    assert state["scale"] == 2.0**11
    assert json.loads(json.dumps(state)) == state, "the state must be plain numbers (no pickle needed)"
    target = shardpar.GradScaler(model, init_scale=1.0, growth_interval=1000)
    target.load_state_dict(state)
    assert target.state_dict() == state
    assert target.get_scale() == source.get_scale()
    for scaler in (source, target):  # two more clean updates: both reach the next growth together
        scaler.update()
        scaler.update()
    assert target.get_scale() == source.get_scale() == 2.0**13


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"growth_factor": 1.0}, ValueError, "growth_factor"),
        ({"growth_factor": 0.5}, ValueError, "growth_factor"),
        ({"backoff_factor": 0.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 1.0}, ValueError, "backoff_factor"),
        ({"backoff_factor": 1.5}, ValueError, "backoff_factor"),
        ({"growth_interval": 0}, ValueError, "growth_interval"),
        ({"init_scale": 0.0}, ValueError, "init_scale"),
        ({"init_scale": -1.0}, ValueError, "init_scale"),
        ({"init_scale": math.nan}, ValueError, "init_scale"),
        ({"init_scale": math.inf}, ValueError, "init_scale"),
    ],
)
def test_bad_arguments_raise(kwargs: dict[str, Any], error: type[Exception], words: str) -> None:
    """A scale of 0 (or negative, nan, inf) would silently turn every loss into 0/nan and skip
    every step forever (0 times any factor stays 0): it must be refused like the others."""
    with pytest.raises(error, match=words):
        shardpar.GradScaler(_wrapped(), **kwargs)


def test_needs_the_wrapped_model() -> None:
    with pytest.raises(TypeError, match="shardpar.wrap"):
        shardpar.GradScaler(torch.nn.Linear(2, 2))


def test_disabled_scaler_passes_through() -> None:
    model = _wrapped()
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
    scaler = shardpar.GradScaler(model, enabled=False)
    loss = model(torch.ones(1, 4)).float().sum()
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0
    loss.backward()
    before = {k: v.clone() for k, v in model.full_state_dict().items()}
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    after = model.full_state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before), "step() must still step"
    assert scaler.skipped_steps == 0


def _torch_scaler_is_refused(stage: int) -> dict[str, Any]:
    """One good fp16 step with shardpar.GradScaler, then torch's own scaler (as a DDP script
    has it), with and without an explicit ``unscale_``; then shardpar's scaler again."""
    torch.manual_seed(0)
    model = shardpar.wrap(
        torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)), stage=stage, mixed_precision="fp16"
    )
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ours = shardpar.GradScaler(model, init_scale=2.0**10)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(C.get_rank()))

    def one_step(scaler: Any, unscale: bool) -> None:
        scaler.scale(model(x).float().sum()).backward()
        if unscale:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    one_step(ours, unscale=False)
    errors = []
    for unscale in (False, True):
        before = {k: v.clone() for k, v in model.full_state_dict().items()}
        try:
            one_step(torch.amp.GradScaler("cpu", init_scale=2.0**10), unscale)
        except TypeError as error:
            errors.append(str(error))
        opt.zero_grad()
        after = model.full_state_dict()
        errors.append(all(torch.equal(after[k], before[k]) for k in before))
    before = {k: v.clone() for k, v in model.full_state_dict().items()}
    one_step(ours, unscale=True)
    after = model.full_state_dict()
    errors.append(any(not torch.equal(after[k], before[k]) for k in before))
    one_step(torch.amp.GradScaler("cpu", enabled=False), unscale=True)  # disabled: passes through
    errors.append(any(not torch.equal(model.full_state_dict()[k], after[k]) for k in after))
    model.engine.close()
    return {"results": errors}


@pytest.mark.parametrize("stage", STAGES)
def test_torch_grad_scaler_on_a_shardpar_optimizer_is_refused_by_name(stage: int) -> None:
    """torch.amp.GradScaler cannot see the gradients a shardpar optimizer steps from (and at
    stages 1-3 would check a different slice on each rank): its step raises a TypeError that
    names shardpar.GradScaler, changes nothing, and leaves the optimizer usable. Disabled, it
    passes through as in torch."""
    for rank, out in enumerate(run_ranks(_torch_scaler_is_refused, 2, stage, timeout=120)):
        plain_error, plain_unchanged, unscaled_error, unscaled_unchanged, still_steps, disabled_steps = out["results"]
        for error in (plain_error, unscaled_error):
            assert (
                isinstance(error, str) and "shardpar.GradScaler(model)" in error and "torch.amp.GradScaler" in error
            ), (rank, error)
        assert plain_unchanged is True and unscaled_unchanged is True, rank
        assert still_steps is True and disabled_steps is True, rank
