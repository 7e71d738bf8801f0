"""``zero_grad()`` does not zero shardpar's gradient buffers (as torch's default
``set_to_none=True``): the next backward overwrites them. These tests pin what that must not
break, at every stage: a parameter that got a gradient in one step and none in the next
(on every rank, or on some ranks only) contributes zero, never its stale value; a
first reduction after ``zero_grad`` overwrites the stage-2/3 gradient shard; and between
``zero_grad`` and the next backward there are no gradients to clip.

The oracle is plain torch on the concatenated batch with SGD without momentum or weight
decay, under which a zero gradient and no gradient update a parameter identically.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from tests.support.parity import run

STEPS = 4
ROWS_PER_RANK = 3
DIM = 8


class TwoBranches(nn.Module):
    """``branch_a`` runs on even steps, ``branch_b`` on odd ones; with ``per_rank`` the
    choice also flips between neighbouring ranks, so each branch gets a gradient on some
    ranks only."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.branch_a = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.branch_b = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.head = nn.Linear(DIM, 1)
        self.use_a = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = self.branch_a(h) if self.use_a else self.branch_b(h)
        return self.head(h)


def _build() -> TwoBranches:
    torch.manual_seed(0)
    return TwoBranches()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(ROWS_PER_RANK, DIM, generator=generator), torch.randn(ROWS_PER_RANK, 1, generator=generator)


def _uses_a(step: int, rank: int, per_rank: bool) -> bool:
    return (step + (rank if per_rank else 0)) % 2 == 0


def _train_sharded(stage: int, per_rank: bool) -> dict[str, torch.Tensor]:
    rank = C.get_rank() if C.is_initialized() else 0
    model = shardpar.wrap(_build(), stage=stage, bucket_cap_mb=300 * 4 / 2**20, min_unit_params=10**9)
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.5)
    inner = model.module
    for step in range(STEPS):
        inner.use_a = _uses_a(step, rank, per_rank)
        x, y = _batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        # After zero_grad there is nothing to clip, whatever the buffers still hold.
        assert float(model.clip_grad_norm_(1.0)) == 0.0
    return {name: tensor.clone() for name, tensor in model.full_state_dict().items()}


def _train_reference(world_size: int, per_rank: bool) -> dict[str, torch.Tensor]:
    """One process: the loss of rank r's rows is weighted 1/N, as data parallel averages."""
    model = _build()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(STEPS):
        for rank in range(world_size):
            model.use_a = _uses_a(step, rank, per_rank)
            x, y = _batch(step, rank)
            (nn.functional.mse_loss(model(x), y) / world_size).backward()
        opt.step()
        opt.zero_grad()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("per_rank", [False, True], ids=["same-branch-every-rank", "branch-differs-by-rank"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_unused_after_zero_grad_gets_zero_not_its_stale_gradient(stage: int, per_rank: bool) -> None:
    world_size = 2
    expected = _train_reference(world_size, per_rank)
    for rank, state in enumerate(run(_train_sharded, world_size, stage, per_rank)):
        assert state.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(
                state[name],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=f"stage {stage}, rank {rank}: {name} differs from plain torch",
            )
