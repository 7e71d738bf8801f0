"""The code paths NCCL takes, run on gloo on the CPU (issue #31: no dead non-gloo branches).

``backend_traits.forcing_native_paths()`` makes the collectives use the backend's own
reduce-scatter and all-gather (``reduce_scatter_tensor``, ``all_gather_into_tensor``, which gloo
also has) and stage 3's tagged gathers take NCCL's shape: a tag all-gather plus the payload
straight into the unit's buffer, checked later ([Note: deferred tag checks] in
core/unit_order.py). ``host.deferring_reads()`` makes every device-to-host read say "not ready"
until it must be made, as a CUDA event does while the GPU is behind, so the used-parameter
flags and the tags are read where CUDA reads them. Under both, training must match plain
torch exactly as on the default paths, and every agreement check must still raise on every
rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

import shardpar
from shardpar.comm import backend_traits, host
from shardpar.comm import collectives as C
from shardpar.core.unit_order import UnitOrderMismatch
from shardpar.errors import RanksOutOfStep
from tests.support.harness import run_ranks
from tests.support.models import KITCHEN_BRANCHES, MLP, TRANSFORMER
from tests.support.parity import Recipe, check_parity, train_sharded


@contextlib.contextmanager
def cuda_like() -> None:
    with backend_traits.forcing_native_paths(), host.deferring_reads():
        yield


def _train_like_cuda(recipe: Recipe, stage: int, wrap_options: tuple = ()) -> object:
    with cuda_like():
        return train_sharded(recipe, stage, wrap_options)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("world_size", [2, 3])
def test_parity_on_the_native_paths_with_deferred_reads(stage: int, world_size: int) -> None:
    recipe = Recipe(TRANSFORMER, steps=3)
    results = run_ranks(_train_like_cuda, world_size, recipe, stage)
    check_parity(results, recipe, world_size, what=f"native paths, stage {stage}, N={world_size}")


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_unused_parameters_on_the_native_paths(stage: int) -> None:
    """Rank-dependent branches (some parameters used on one rank only, some on none): which
    parameters no rank used is read only at step(), and they are skipped there as plain torch
    skips them."""
    recipe = Recipe(KITCHEN_BRANCHES, steps=3, clip=0.5, chunked_reference=True)
    results = run_ranks(_train_like_cuda, 2, recipe, stage)
    check_parity(results, recipe, 2, what=f"branches, native paths, stage {stage}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_gradient_accumulation_on_the_native_paths(stage: int) -> None:
    recipe = Recipe(MLP, steps=3, micro_batches=2)
    results = run_ranks(_train_like_cuda, 2, recipe, stage)
    check_parity(results, recipe, 2, what=f"no_sync, native paths, stage {stage}")


def _skip_a_backward_on_rank_1(stage: int) -> str:
    """Rank 1 runs one backward more than rank 0 before the same step: the counters differ."""
    with cuda_like():
        torch.manual_seed(0)
        model = shardpar.wrap(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), stage=stage)
        opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
        x = torch.randn(4, 8)
        try:
            for _ in range(3):
                model(x).sum().backward()
                if C.get_rank() == 1:
                    with model.no_sync():
                        model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        except RanksOutOfStep as error:
            return str(error)
        return "no error"


@pytest.mark.parametrize("stage", [0, 2])
def test_ranks_out_of_step_are_named_on_every_rank_when_read_later(stage: int) -> None:
    messages = run_ranks(_skip_a_backward_on_rank_1, 2, stage)
    for rank, message in enumerate(messages):
        assert "backward passes in all" in message and "this rank" in message, f"rank {rank}: {message}"


class _TwoSizes(nn.Module):
    """Units of different sizes; rank 1 runs them in the other order from the second step."""

    def __init__(self) -> None:
        super().__init__()
        self.small = nn.Linear(4, 4)
        self.big = nn.Linear(4, 64)
        self.head = nn.Linear(64, 1)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        swap = self.step >= 1 and torch.distributed.get_rank() == 1
        self.step += 1
        if swap:
            return self.head(self.big(self.small(x)).relu()) * 0 + self.head(self.big(x).relu())
        return self.head(self.big(self.small(x)).relu())


def _order_error(build: Callable[[], nn.Module], policy: type, width: int) -> str:
    """Three steps of stage 3 on the paths CUDA takes; the UnitOrderMismatch raised, if any."""
    with cuda_like():
        torch.manual_seed(0)
        model = shardpar.wrap(build(), stage=3, wrap_policy=[policy], min_unit_params=1)
        opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
        x = torch.randn(2, width)
        try:
            for _ in range(3):
                model(x).sum().backward()
                opt.step()
                opt.zero_grad()
        except UnitOrderMismatch as error:
            return str(error)
        return "no error"


def test_units_of_different_sizes_at_one_point_raise_on_every_rank() -> None:
    """On NCCL this pairing (a 16-element unit's gather against a 256-element one's) hung
    until the watchdog; on the native path the rank that departs from the last pass probes
    with its tag alone, so no payloads of different sizes meet, and both ranks name the units."""
    messages = run_ranks(_order_error, 2, _TwoSizes, nn.Linear, 4, timeout=60)
    for rank, message in enumerate(messages):
        assert "units ran in a different order" in message, f"rank {rank}: {message}"
        assert "rank 0: unit" in message and "rank 1: unit" in message, f"rank {rank}: {message}"


class _LeftoverBranches(nn.Module):
    """Two blocks (policy units) and two leftover Linears chosen per rank from the second step."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2))
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)
        self.step = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        other = self.step >= 1 and torch.distributed.get_rank() == 1
        self.step += 1
        x = self.blocks[0](x)
        x = self.right(x) if other else self.left(x)
        return self.blocks[1](x)


def test_rank_dependent_leftover_units_raise_naming_them_where_gathers_cannot_be_recovered() -> None:
    """gloo recovers from ranks running different leftover units (they are then held with the
    root); NCCL could not (the drain would pair gathers of different sizes), so there every
    rank raises, naming each rank's unit."""
    messages = run_ranks(_order_error, 2, _LeftoverBranches, nn.Sequential, 8, timeout=60)
    for rank, message in enumerate(messages):
        assert "rank 1: unit 'right'" in message and "raise min_unit_params" in message, f"rank {rank}: {message}"


def test_mixed_backend_strings_are_read_per_device_type(monkeypatch: pytest.MonkeyPatch) -> None:
    """A "cpu:gloo,cuda:nccl" group keeps NCCL's average and alignment for CUDA tensors (it was
    compared whole to "nccl" and lost both) and gloo's paths for CPU tensors."""
    from shardpar.comm import devices

    monkeypatch.setattr(devices, "backend_config", lambda group=None: "cpu:gloo,cuda:nccl")
    cuda, cpu = C.traits(None, torch.device("cuda", 0)), C.traits(None, torch.device("cpu"))
    assert (cuda.backend, cuda.averages, cuda.aligns, cuda.emulated_split, cuda.tolerant_gathers) == (
        "nccl",
        True,
        True,
        False,
        False,
    )
    assert (cpu.backend, cpu.averages, cpu.aligns, cpu.emulated_split, cpu.tolerant_gathers) == (
        "gloo",
        False,
        False,
        True,
        True,
    )
    assert C.traits(None).backend == "nccl"  # no device: the CUDA one, which layouts align for
    monkeypatch.setattr(devices, "backend_config", lambda group=None: "ucc")
    unknown = C.traits(None, torch.device("cuda", 0))
    assert (unknown.averages, unknown.emulated_split, unknown.tolerant_gathers) == (False, False, False)
