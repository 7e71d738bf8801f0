"""The engine's wait clock ([Note: exposed communication] in shardpar/core/wait_clock.py):
every wait for a collective is counted once, under the phase it happened in.

Counts, not seconds, are asserted exactly: they follow from the layout (buckets, units) and
are the same on every run; seconds are only checked to be non-negative (and positive where a
wait certainly blocked on a gather in flight)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardpar
from shardpar.core.wait_clock import PHASES
from tests.support.harness import run_ranks

WIDTH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.tanh(self.fc(x)))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(Block() for _ in range(3)))


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
    return F.mse_loss(model(x), torch.zeros(4, WIDTH))


def _clock(model: Any) -> dict[str, dict[str, float]]:
    return model.engine.wait_clock.snapshot()


def _replicated_step(stage: int) -> dict[str, Any]:
    """Stages 0-2 with several buckets: the clock after each part of two steps."""
    from shardpar.core.flat_param import ShardState

    rank = torch.distributed.get_rank()
    model = shardpar.wrap(_model(), stage=stage, bucket_cap_mb=WIDTH * (WIDTH + 1) * 4 / 2**20)  # one Linear a bucket
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
    clock = model.engine.wait_clock
    out: dict[str, Any] = {"buckets": len(model.engine.reducer.buckets)}
    _loss(model, rank, 0).backward()
    out["first_step_backward"] = _clock(model)
    clock.reset()
    model.clip_grad_norm_(1.0)
    opt.step()
    out["clip_and_step"] = _clock(model)
    groups = model.engine.storage.groups
    out["pending_after_step"] = sum(g.state is ShardState.GATHERING for g in groups)
    opt.zero_grad()
    clock.reset()
    loss = _loss(model, rank, 1)
    out["second_forward"] = _clock(model)
    loss.backward()
    out["second_forward_backward"] = _clock(model)
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_lazily_gathered_bucket_is_one_forward_wait(stage: int) -> None:
    for result in run_ranks(_replicated_step, 2, stage, timeout=60):
        buckets = result["buckets"]
        assert buckets >= 6, "the test needs several buckets"
        first = result["first_step_backward"]
        # No step yet: nothing was gathered, the first forward waited for nothing.
        assert first["waits"]["forward"] == 0 and first["seconds"]["forward"] == 0.0
        # Every bucket's reduction, then the used-parameter flags.
        assert first["waits"]["backward"] == buckets + 1
        assert first["waits"]["backward_gather"] == 0
        step = result["clip_and_step"]
        # Clipping all-reduces the partial norms where gradients are sharded (stages 1-2).
        assert step["waits"] == {"forward": 0, "backward_gather": 0, "backward": 0, "step": 1 if stage else 0}
        forward = result["second_forward"]
        if stage == 0:
            assert result["pending_after_step"] == 0
            assert forward["waits"]["forward"] == 0
        else:
            # Every bucket's post-step gather was in flight, and the forward waited once for
            # each (the use hooks of later modules of a bucket find it complete: not a wait).
            assert result["pending_after_step"] == buckets
            assert forward["waits"]["forward"] == buckets
            assert forward["seconds"]["forward"] > 0
        assert forward["waits"]["backward"] == forward["waits"]["step"] == 0
        both = result["second_forward_backward"]
        assert both["waits"]["forward"] == forward["waits"]["forward"]
        assert both["waits"]["backward"] == buckets + 1
        for snapshot in (first, step, forward, both):
            assert set(snapshot["seconds"]) == set(PHASES)
            assert all(s >= 0 for s in snapshot["seconds"].values())


def _unit_step(prefetch: int) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    model = shardpar.wrap(_model(), stage=3, wrap_policy=[Block], prefetch_units=prefetch)
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
    out: dict[str, Any] = {"flats": len(model.engine.gatherer.flats), "buckets": len(model.engine.reducer.buckets)}
    for step in range(2):
        model.engine.wait_clock.reset()
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        out[step] = _clock(model)
    model.engine.close()
    return out


@pytest.mark.parametrize("prefetch", [0, 1])
def test_stage3_unit_gathers_are_waited_in_forward_and_backward(prefetch: int) -> None:
    for result in run_ranks(_unit_step, 2, prefetch, timeout=60):
        flats = result["flats"]
        assert flats == 3  # one trainable group per block; the root holds no parameters
        for step in range(2):
            clock = result[step]
            # Every unit is gathered in forward and again in backward (freed after its
            # forward), but the last block, whose backward comes first, stays gathered from
            # forward into backward; a prefetched gather is waited for too, when its unit runs.
            assert clock["waits"]["forward"] == flats
            assert clock["waits"]["backward_gather"] == flats - 1
            assert clock["waits"]["backward"] == result["buckets"] + 1
            assert clock["waits"]["step"] == 0
            assert all(s >= 0 for s in clock["seconds"].values())
            if prefetch == 0:  # nothing gathered ahead: every gather blocked forward
                assert clock["seconds"]["forward"] > 0
