"""When rank 0's buffers (BatchNorm running statistics) reach the other ranks: torch DDP's rule
at every stage, with torch DDP (gloo) as the oracle; see [Note: when buffers are broadcast] in
shardpar/engines/buffer_sync.py.

- evaluation under ``no_grad`` after a training step: every rank evaluates with rank 0's
  statistics, as under DDP (before: only rank 0 matched DDP, rank 1 was off by percents);
- gradient accumulation with ``no_sync()`` and with nanoGPT's ``require_backward_grad_sync``:
  the broadcast comes at the first micro-batch after each synchronising one, so every rank's
  statistics after every micro-batch equal DDP's (before: a broadcast before every micro-batch);
- evaluation on rank 0 alone (stages 0-2) still completes, with rank 0's output and every
  rank's statistics afterwards equal to DDP's where every rank evaluates;
- with activation checkpointing around a BatchNorm (its recompute updates the statistics
  again, inside backward) the same holds;
- a state dict loaded on every rank between a step and the next forward is not overwritten
  by rank 0's statistics of before the load;
- a buffer re-assigned in every training forward (``self.mean = ...``, a new tensor each
  time) and one registered at the first forward, after wrap, are the ones sent, as DDP sends
  them (it re-reads ``named_buffers()`` before each broadcast).

World sizes 2 and 3; one harness call per world size runs DDP and stages 0-3.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import shardpar
from tests.support.harness import run_ranks

STAGES = (0, 1, 2, 3)
STEPS = 3
MICRO = 3  # micro-batches per step in the accumulation scenarios
TOL = 1e-5  # fp32 reductions in another order than DDP's differ by a few ulps; a rank off by one broadcast differs by >1e-2


class Drift(nn.Module):
    """Centres and scales its input by statistics it keeps in buffers the way some modules
    do: ``mean`` re-assigned to a new tensor by every training forward, ``peak`` registered
    at the first one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
            if not hasattr(self, "peak"):
                self.register_buffer("peak", x.detach().abs().amax(0) + 1)
        return (x - self.mean) / self.peak


class BatchNormNet(nn.Module):
    def __init__(self, checkpointed: bool = False, drifting: bool = False) -> None:
        super().__init__()
        self.checkpointed = checkpointed
        """Activation checkpointing around the first BatchNorm: its recompute in backward
        updates the running statistics a second time (in plain torch and DDP too)."""
        self.drift = Drift(6) if drifting else nn.Identity()
        # No bias before a BatchNorm: its gradient is zero up to rounding, which Adam would
        # turn into full-size steps of a sign that depends on the order of the sums.
        self.inp = nn.Linear(6, 16, bias=False)
        self.bn1 = nn.BatchNorm1d(16)
        self.mid = nn.Linear(16, 16, bias=False)
        self.bn2 = nn.BatchNorm1d(16, momentum=None)  # cumulative average: num_batches_tracked matters too
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = lambda x: F.relu(self.bn1(self.inp(self.drift(x))))  # noqa: E731
        h = checkpoint(first, x, use_reentrant=False) if self.checkpointed and torch.is_grad_enabled() else first(x)
        return self.out(F.relu(self.bn2(self.mid(h))))


def _net(scenario: str) -> BatchNormNet:
    torch.manual_seed(0)
    return BatchNormNet(checkpointed="checkpointed" in scenario, drifting="re-assigned" in scenario)


def _batch(step: int, micro: int, rank: int) -> torch.Tensor:
    """Each rank's data has its own mean and scale, so that ranks' statistics differ."""
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(8, 6, generator=generator) * (1 + rank) + rank


def _eval_batch(rank: int) -> torch.Tensor:
    return torch.randn(5, 6, generator=torch.Generator().manual_seed(77 + rank)) * 2


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in module.named_buffers()}


def _train(scenario: str, model: Any, module: nn.Module, opt: Any, no_sync: Any) -> dict[str, list]:
    """What one rank sees in one scenario: eval outputs, and its buffers after every
    micro-batch and evaluation."""
    rank = dist.get_rank()
    seen: dict[str, list] = {"eval": [], "buffers": []}
    initial = {k: v.detach().clone() for k, v in module.state_dict().items()}  # (stage 3: a collective)

    def evaluate() -> None:
        model.eval()
        with torch.no_grad():
            seen["eval"].append(model(_eval_batch(rank)).detach().clone())
        model.train()
        seen["buffers"].append(_buffers(module))

    for step in range(STEPS):
        micros = MICRO if scenario.startswith("accumulate") else 1
        for micro in range(micros):
            last = micro == micros - 1
            if scenario == "accumulate (require_backward_grad_sync)":
                model.require_backward_grad_sync = last  # nanoGPT's way
                context = contextlib.nullcontext()
            else:
                context = contextlib.nullcontext() if last else no_sync()
            with context:
                model(_batch(step, micro, rank)).square().mean().backward()
            seen["buffers"].append(_buffers(module))
            if scenario == "accumulate, evaluate between micro-batches" and micro == 1:
                evaluate()
        opt.step()
        opt.zero_grad()
        if scenario == "load, then evaluate":
            module.load_state_dict(initial)  # on every rank, between the backward and the next forward
        if scenario in (
            "evaluate",
            "accumulate, evaluate between micro-batches",
            "load, then evaluate",
            "evaluate, BatchNorm checkpointed",
            "evaluate, buffers re-assigned and registered in forward",
        ):
            evaluate()
        elif scenario == "evaluate on rank 0 only":
            if rank == 0:
                evaluate()
            dist.barrier()  # the script's own "wait for rank 0"
    seen["final"] = [_buffers(module)]
    return seen


SCENARIOS = (
    "evaluate",
    "accumulate (no_sync)",
    "accumulate (require_backward_grad_sync)",
    "accumulate, evaluate between micro-batches",
    "load, then evaluate",
    "evaluate, BatchNorm checkpointed",
    "evaluate, buffers re-assigned and registered in forward",
)


def _ddp(scenario: str) -> dict[str, list]:
    module = _net(scenario)
    ddp = DistributedDataParallel(module)
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    return _train(scenario, ddp, module, opt, ddp.no_sync)


def _shardpar(scenario: str, stage: int) -> dict[str, list]:
    module = _net(scenario)
    model = shardpar.wrap(module, stage=stage, min_unit_params=1, bucket_cap_mb=0.0005)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    try:
        return _train(scenario, model, module, opt, model.no_sync)
    finally:
        model.engine.close()


def _everything() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for scenario in SCENARIOS:
        out[("ddp", scenario)] = _ddp(scenario)
        for stage in STAGES:
            out[(stage, scenario)] = _shardpar(scenario, stage)
    for stage in (0, 1, 2):  # at stage 3 every forward gathers from every rank
        out[(stage, "evaluate on rank 0 only")] = _shardpar("evaluate on rank 0 only", stage)
    return out


_cache: dict[int, list[dict[str, Any]]] = {}


def _results(world_size: int) -> list[dict[str, Any]]:
    if world_size not in _cache:
        _cache[world_size] = run_ranks(_everything, world_size, timeout=300)
    return _cache[world_size]


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if not expected.is_floating_point():
        return 0.0 if torch.equal(actual, expected) else float("inf")
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def _assert_close(actual: dict[str, list], expected: dict[str, list], what: str) -> None:
    for key in ("eval", "buffers", "final"):
        assert len(actual[key]) == len(expected[key]), f"{what}: {key}"
        for index, (a, e) in enumerate(zip(actual[key], expected[key])):
            pairs = [(name, a[name], e[name]) for name in e] if isinstance(e, dict) else [("output", a, e)]
            for name, x, y in pairs:
                error = _rel_error(x, y)
                assert error <= TOL, f"{what}: {key}[{index}] {name} differs from DDP's by {error:.2e}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_rank_sees_ddp_buffers(scenario: str, stage: int, world_size: int) -> None:
    for rank, result in enumerate(_results(world_size)):
        _assert_close(result[(stage, scenario)], result[("ddp", scenario)], f"stage {stage}, rank {rank}, {scenario}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_evaluation_on_rank_0_only_completes_with_ddp_values(stage: int, world_size: int) -> None:
    # DDP itself hangs when rank 0 evaluates alone after a step (its broadcast waits for the
    # others); the oracle is DDP with every rank evaluating (eval mode: no statistics change).
    # There the other ranks take rank 0's statistics at the evaluation, here at their next
    # forward: after the last step, with no forward after it, they still hold their own.
    for rank, result in enumerate(_results(world_size)):
        ours, ddp = result[(stage, "evaluate on rank 0 only")], result[("ddp", "evaluate")]
        after_training = [b for i, b in enumerate(ddp["buffers"]) if i % 2 == 0]  # (train, eval) per step
        expected = {
            "eval": ddp["eval"] if rank == 0 else [],
            "final": ddp["final"] if rank == 0 else after_training[-1:],
            "buffers": ddp["buffers"] if rank == 0 else after_training,
        }
        _assert_close(ours, expected, f"stage {stage}, rank {rank}, evaluating on rank 0 only")
