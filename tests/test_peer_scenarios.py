"""Scenarios from the peers' own tests (torch FSDP2's, DDP's, DeepSpeed ZeRO's) that shardpar
once got wrong or refused (#32): each trains at every stage on two or three gloo ranks and is
compared with plain single-process torch on the concatenated batch (or with FSDP2, where the
peer is the definition).

- a module checkpointed twice with *reentrant* activation checkpointing;
- a second backward through a submodule called directly (FSDP2's chunked-loss pattern);
- one submodule registered under two names (tied modules, ``nn.Sequential(mlp, mlp)``);
- mixed precision where a block adds an fp32 buffer to a low-precision activation (each
  unit's floating inputs are cast, as FSDP2 casts them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks

DIM = 16
BATCH = 12  # divisible by 2 and 3
STEPS = 3
LR = 0.05
TOLERANCE = 1e-5


def _batch(step: int) -> torch.Tensor:
    return torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(100 + step))


def _slice(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = x.shape[0] // world_size
    return x[rank * size : (rank + 1) * size]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


# --------------------------------------------------------------------------- models


class ReentrantTwice(nn.Module):
    """``l0 -> checkpoint(l1) -> checkpoint(l1) -> out``: one module recomputed twice."""

    def __init__(self, reentrant: bool = True) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.l0 = nn.Linear(DIM, DIM)
        self.l1 = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l0(x))
        h = checkpoint(self.l1, h, use_reentrant=self.reentrant)
        h = checkpoint(self.l1, h, use_reentrant=self.reentrant)
        return self.out(h)


class InsideAndOutside(nn.Module):
    """``l1`` once plainly and once inside a reentrant checkpoint: the outer backward's
    gradient of ``l1`` and the inner one's arrive separately."""

    def __init__(self) -> None:
        super().__init__()
        self.l0 = nn.Linear(DIM, DIM)
        self.l1 = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(torch.tanh(self.l0(x))))
        h = checkpoint(self.l1, h, use_reentrant=True)
        return self.out(torch.tanh(h))


class ConvTwice(nn.Module):
    """A channels_last conv checkpointed reentrantly twice: its late gradient must land in the
    element order its bucket keeps ([Note: element order] in core/element_order.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.conv = nn.Conv2d(4, 4, 3, padding=1)
        self.out = nn.Linear(DIM, DIM)
        self.conv.weight.data = self.conv.weight.data.to(memory_format=torch.channels_last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x)).reshape(-1, 4, 2, 2).contiguous(memory_format=torch.channels_last)
        h = checkpoint(self.conv, h, use_reentrant=True)
        h = checkpoint(self.conv, torch.tanh(h), use_reentrant=True)
        return self.out(h.flatten(1))


class ChunkedHead(nn.Module):
    """FSDP2's chunked-loss pattern: the trunk's output is detached, the head runs per chunk
    with its own backward, and the trunk's backward follows."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, skip_head: bool = False) -> torch.Tensor:
        h = self.trunk(x)
        return h if skip_head else self.head(h)


class ProjBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj = nn.Linear(DIM, DIM)
        self.mix = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(torch.tanh(self.in_proj(x)))


class SharedProjection(nn.Module):
    """Two blocks holding one ``in_proj`` module under two names (``blocks.1.in_proj`` is
    ``blocks.0.in_proj``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ProjBlock() for _ in range(2))
        self.blocks[1].in_proj = self.blocks[0].in_proj
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, 2 * DIM)
        self.proj = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


def _same_mlp_twice() -> nn.Module:
    mlp = Mlp()
    return nn.Sequential(nn.Linear(DIM, DIM), mlp, mlp, nn.Linear(DIM, DIM))


def _reentrant_twice() -> nn.Module:
    return ReentrantTwice(reentrant=True)


def _non_reentrant_twice() -> nn.Module:
    return ReentrantTwice(reentrant=False)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "reentrant_twice": _reentrant_twice,
    "non_reentrant_twice": _non_reentrant_twice,
    "inside_and_outside": InsideAndOutside,
    "conv_twice": ConvTwice,
    "chunked_head": ChunkedHead,
    "shared_projection": SharedProjection,
    "same_mlp_twice": _same_mlp_twice,
}


def _build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


# --------------------------------------------------------------------------- steps


def _plain_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()


def _chunked_step(model: Any, x: torch.Tensor) -> None:
    """The head's backward runs per chunk (a backward through a submodule called directly),
    then the trunk's backward; one optimizer step follows."""
    module = model.module if isinstance(model, shardpar.ShardedModule) else model
    h = model(x, skip_head=True)
    detached = h.detach().requires_grad_(True)
    for chunk in detached.chunk(2):
        (module.head(chunk).pow(2).sum() / x.shape[0]).backward()
    h.backward(detached.grad)


def _head_twice_step(model: Any, x: torch.Tensor) -> None:
    """Minimal case: two backward passes through a submodule called directly."""
    module = model.module if isinstance(model, shardpar.ShardedModule) else model
    for half in x.chunk(2):
        (module.head(half).pow(2).sum() / x.shape[0]).backward()


STEP_FNS: dict[str, Callable[[Any, torch.Tensor], None]] = {
    "plain": _plain_step,
    "chunked": _chunked_step,
    "head_twice": _head_twice_step,
}


def _reference(model_name: str, step_name: str) -> dict[str, torch.Tensor]:
    model = _build(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for step in range(STEPS):
        STEP_FNS[step_name](model, _batch(step))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train_sharded(model_name: str, step_name: str, stage: int, options: dict[str, Any], comm: bool = False) -> Any:
    rank, world_size = C.get_rank(), C.get_world_size()
    model = shardpar.wrap(_build(model_name), stage=stage, **options)
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
    for step in range(STEPS):
        if step == STEPS - 1:
            model.reset_comm_stats()
        STEP_FNS[step_name](model, _slice(_batch(step), rank, world_size))
        opt.step()
        opt.zero_grad()
    if comm:
        return model.comm_stats()
    return model.full_state_dict()


def _check_against_torch(
    model_name: str,
    step_name: str,
    stage: int,
    world_size: int = 2,
    options: dict[str, Any] | None = None,
    tolerance: float = TOLERANCE,
) -> None:
    want = _reference(model_name, step_name)
    results = run_ranks(_train_sharded, world_size, model_name, step_name, stage, options or {}, timeout=120)
    for rank, got in enumerate(results):
        assert got.keys() == want.keys()
        for key in want:
            error = _rel(got[key], want[key])
            assert error <= tolerance, f"{model_name}/{step_name} stage {stage} rank {rank}: {key} off by {error:.2e}"


# --------------------------------------------------------------------------- 1. reentrant checkpointing twice

STAGE3_POLICIES = {"default": {}, "own_unit": {"wrap_policy": [nn.Sequential, nn.Linear], "min_unit_params": 1}}


BUCKETS = {"one_bucket": {}, "bucket_per_tensor": {"bucket_cap_mb": 1e-6}}
"""One bucket: the second gradient of ``l1`` arrives before the bucket launches. A bucket per
tensor: it arrives after ``l1``'s buckets launched (a second round of reductions)."""


@pytest.mark.parametrize("buckets", sorted(BUCKETS))
@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("model_name", ["reentrant_twice", "non_reentrant_twice"])
def test_a_module_checkpointed_twice_gets_the_sum_of_both_uses(stage: int, model_name: str, buckets: str) -> None:
    _check_against_torch(model_name, "plain", stage, options=BUCKETS[buckets])


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_module_used_outside_and_inside_a_reentrant_checkpoint(stage: int) -> None:
    _check_against_torch("inside_and_outside", "plain", stage, world_size=3, options=BUCKETS["bucket_per_tensor"])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_channels_last_module_checkpointed_twice(stage: int) -> None:
    options = {"wrap_policy": [nn.Conv2d], "min_unit_params": 1} if stage == 3 else BUCKETS["bucket_per_tensor"]
    _check_against_torch("conv_twice", "plain", stage, options=options)


@pytest.mark.parametrize("model_name, late_rounds", [("reentrant_twice", 4), ("non_reentrant_twice", 0)])
def test_late_gradients_cost_one_more_reduction_per_bucket(model_name: str, late_rounds: int) -> None:
    """A bucket per tensor, stage 2: one reduce-scatter per trainable tensor, plus one per
    tensor of ``l1`` when its second gradient arrives after its bucket was reduced (reentrant
    checkpointing); none more where autograd sums both uses itself (non-reentrant)."""
    tensors = sum(1 for _ in _build(model_name).parameters())
    for stats in run_ranks(_train_sharded, 2, model_name, "plain", 2, BUCKETS["bucket_per_tensor"], True, timeout=120):
        assert stats["reduce_scatter"]["calls"] == tensors + late_rounds


@pytest.mark.parametrize("policy", sorted(STAGE3_POLICIES))
@pytest.mark.parametrize("model_name", ["reentrant_twice", "non_reentrant_twice"])
def test_a_module_checkpointed_twice_at_stage_3(policy: str, model_name: str) -> None:
    _check_against_torch(model_name, "plain", 3, options=STAGE3_POLICIES[policy])


# --------------------------------------------------------------------------- 2. second backward


HEAD_OWN_UNIT = {"wrap_policy": [nn.Linear], "min_unit_params": 1}
"""At stage 3 the head called directly must be a unit of its own (as under FSDP2, where it
is a ``fully_shard`` module): the root's parameters are gathered around the root's forward."""


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("step_name", ["chunked", "head_twice"])
def test_backward_passes_through_a_submodule_called_directly_accumulate(stage: int, step_name: str) -> None:
    _check_against_torch("chunked_head", step_name, stage, options=HEAD_OWN_UNIT if stage == 3 else {})


@pytest.mark.parametrize("step_name", ["chunked", "head_twice"])
def test_a_submodule_of_the_roots_unit_called_directly_at_stage_3(step_name: str) -> None:
    """With the default policy the head's parameters go with the root's unit; calling the
    head gathers that unit for the call ([Note: entry modules] in core/units.py)."""
    _check_against_torch("chunked_head", step_name, 3, world_size=3)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_backward_passes_through_a_submodule_called_directly_under_mixed_precision(stage: int) -> None:
    """Under bf16 parameters ``.grad`` holds placeholders between backward and step at stage 0
    too. Plain fp32 torch is the oracle, within bf16's resolution."""
    options = {"mixed_precision": "bf16", **(HEAD_OWN_UNIT if stage == 3 else {})}
    _check_against_torch("chunked_head", "chunked", stage, options=options, tolerance=3e-2)


# --------------------------------------------------------------------------- 3. tied modules


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model_name", ["shared_projection", "same_mlp_twice"])
def test_a_module_registered_under_two_names_trains_as_in_torch(stage: int, model_name: str) -> None:
    _check_against_torch(model_name, "plain", stage)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("model_name", ["shared_projection", "same_mlp_twice"])
def test_a_module_registered_under_two_names_in_stage_3_units(stage: int, model_name: str) -> None:
    """The same with units around the blocks: a module shared by two units is gathered
    around its own forward (each use); a unit used twice is gathered for each use."""
    policy = {"shared_projection": [ProjBlock], "same_mlp_twice": [Mlp]}[model_name]
    if stage == 3:
        _check_against_torch(
            model_name, "plain", 3, world_size=3, options={"wrap_policy": policy, "min_unit_params": 1}
        )
    else:
        _check_against_torch(model_name, "plain", stage, world_size=3, options={"bucket_cap_mb": 1e-6})


# --------------------------------------------------------------------------- 4. mixed precision


class BufferBlock(nn.Module):
    """Adds an fp32 buffer to its low-precision activation: its output is fp32."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.register_buffer("offset", torch.linspace(-0.5, 0.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + self.offset


class BufferModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BufferBlock() for _ in range(3))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _buffer_model() -> BufferModel:
    torch.manual_seed(0)
    return BufferModel()


def _buffer_model_step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).float().pow(2).mean().backward()


def _train_buffer_model(stage: int | None) -> dict[str, Any]:
    """stage None: FSDP2 (``fully_shard`` on each block, the head and the root) under
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``; else shardpar with
    ``MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)`` and no ``buffer_dtype``."""
    rank, world_size = C.get_rank(), C.get_world_size()
    module = _buffer_model()
    if stage is None:
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from torch.distributed.tensor import DTensor

        from shardpar.comm.compat import fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for sub in [*module.blocks, module.head, module]:
            fully_shard(sub, mp_policy=policy)
        model, opt = module, torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9)

        def state() -> dict[str, torch.Tensor]:
            return {
                k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                for k, v in model.state_dict().items()
            }
    else:
        mp = shardpar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = shardpar.wrap(module, stage=stage, mixed_precision=mp, wrap_policy=[BufferBlock], min_unit_params=1)
        opt = shardpar.optimizer(model, torch.optim.SGD, lr=LR, momentum=0.9)
        state = model.full_state_dict
    outputs = []
    for step in range(STEPS):
        x = _slice(_batch(step), rank, world_size)
        _buffer_model_step(model, x)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            outputs.append(model(x).float())
    return {"state": state(), "outputs": outputs}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_mixed_precision_casts_each_modules_inputs_as_fsdp2_does(stage: int) -> None:
    """A block adds an fp32 buffer to its bf16 activation, so the next block's input is fp32:
    FSDP2 casts each unit's floating inputs and trains it; shardpar casts the inputs of each
    module holding parameters, at every stage, and matches FSDP2."""
    want = run_ranks(_train_buffer_model, 2, None, timeout=120)
    got = run_ranks(_train_buffer_model, 2, stage, timeout=120)
    for rank in range(2):
        for key, value in want[rank]["state"].items():
            assert got[rank]["state"][key].dtype == value.dtype, key
            error = _rel(got[rank]["state"][key], value)
            assert error <= TOLERANCE, f"stage {stage} rank {rank}: {key} off FSDP2 by {error:.2e}"
        for step, (a, b) in enumerate(zip(got[rank]["outputs"], want[rank]["outputs"])):
            assert _rel(a, b) <= TOLERANCE, f"stage {stage} rank {rank}: output of step {step} off FSDP2"
