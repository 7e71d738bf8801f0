"""Values real models hold that the common path never meets: NaN gradients in one rank's
shard, and parameters that are not real floating point.

- ``clip_grad_norm_`` with a NaN in one rank's shard returns NaN on every rank, as torch's
  own ``clip_grad_norm_`` does on the whole model, for every norm type; with
  ``error_if_nonfinite=True`` every rank raises. (A MAX all-reduce drops a NaN: before, the
  infinity norm came back finite on every rank and the step wrote NaN into the weights.)
- Frozen integer, bool, complex64 and float64 parameters wrap, train (untouched) and
  checkpoint at every stage, with and without bf16 mixed precision, and load at another
  stage with their dtype and values. Entries no checkpoint can hold (complex128) and
  trainable complex parameters are refused at ``wrap``, naming the parameter.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks

# --------------------------------------------------------------------------- NaN in one shard

NORM_TYPES = (float("inf"), 2.0, 1.0)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def _norms_with_a_nan_on(stage: int, owner: int) -> dict[str, object]:
    """Backward, then put a NaN into the first element this rank owns, on rank ``owner`` only."""
    rank = C.get_rank()
    model = shardpar.wrap(_mlp(), stage=stage, min_unit_params=1, bucket_cap_mb=0.001)
    model(torch.randn(4, 6)).square().sum().backward()
    grads, sharded = model.engine.owned_grads()
    assert sharded, "the scenario needs sharded gradients"
    if rank == owner:
        next(g for g in grads if g.numel()).view(-1)[0] = math.nan
    norms = [float(model.clip_grad_norm_(1.0, norm_type)) for norm_type in NORM_TYPES]
    try:
        model.clip_grad_norm_(1.0, float("inf"), error_if_nonfinite=True)
        raised = None
    except RuntimeError as error:
        raised = str(error)
    return {"norms": norms, "raised": raised}


@pytest.mark.parametrize("world_size, owner", [(2, 0), (2, 1), (3, 2)])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_nan_in_one_ranks_shard_makes_every_norm_nan_on_every_rank(stage: int, world_size: int, owner: int) -> None:
    # The oracle: torch's clip_grad_norm_ over a model with one NaN gradient element.
    model = _mlp()
    model(torch.randn(4, 6)).square().sum().backward()
    next(model.parameters()).grad.view(-1)[0] = math.nan
    expected = [float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, t)) for t in NORM_TYPES]
    assert all(math.isnan(n) for n in expected)

    results = run_ranks(_norms_with_a_nan_on, world_size, stage, owner, timeout=60)
    for rank, result in enumerate(results):
        assert all(math.isnan(n) for n in result["norms"]), (
            f"stage {stage}, NaN on rank {owner}: rank {rank} got norms {result['norms']} for {NORM_TYPES}"
        )
        assert result["raised"] is not None and "non-finite" in result["raised"], (
            f"stage {stage}: rank {rank} did not raise with error_if_nonfinite=True"
        )


def _inf_norm_without_nan(stage: int) -> float:
    model = shardpar.wrap(_mlp(), stage=stage, min_unit_params=1, bucket_cap_mb=0.001)
    torch.manual_seed(1 + C.get_rank())
    model(torch.randn(4, 6)).square().sum().backward()
    return float(model.clip_grad_norm_(1e9, float("inf")))


@pytest.mark.parametrize("stage", [1, 3])
def test_the_nan_flag_leaves_finite_infinity_norms_as_they_were(stage: int) -> None:
    """The flag rides beside the maximum: without a NaN the result is torch's, on every rank."""
    model = _mlp()
    for rank in range(2):
        torch.manual_seed(1 + rank)
        (model(torch.randn(4, 6)).square().sum() / 2).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9, float("inf")))
    for norm in run_ranks(_inf_norm_without_nan, 2, stage, timeout=60):
        assert norm == pytest.approx(expected, rel=1e-5)


# --------------------------------------------------------------------------- unusual dtypes


class WithFrozenOddities(nn.Module):
    """A trainable layer beside frozen parameters of every non-float kind a model keeps:
    token ids (int64), a mask (bool), rotary phases (complex64), a float64 table."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.ids = nn.Parameter(torch.arange(6, dtype=torch.int64), requires_grad=False)
        self.mask = nn.Parameter(torch.tensor([True, False, True]), requires_grad=False)
        self.phase = nn.Parameter(torch.polar(torch.ones(3), torch.arange(3.0)), requires_grad=False)
        self.table = nn.Parameter(torch.linspace(0, 1, 5, dtype=torch.float64), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.ids[:4].to(x.dtype) + self.mask.sum().to(x.dtype)
        return self.lin(x) * scale + self.phase.real.sum().to(x.dtype) + self.table.sum().to(x.dtype)


FROZEN = ("ids", "mask", "phase", "table")


def _train_save_reload(stage: int, other_stage: int, mixed_precision: str | None, directory: str) -> dict[str, object]:
    torch.manual_seed(0)
    original = {k: v.clone() for k, v in WithFrozenOddities().state_dict().items()}
    torch.manual_seed(0)
    options = {"mixed_precision": mixed_precision} if mixed_precision else {}
    model = shardpar.wrap(WithFrozenOddities(), stage=stage, min_unit_params=1, **options)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    torch.manual_seed(1 + C.get_rank())
    for _ in range(2):
        model(torch.randn(2, 4)).sum().backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    shardpar.save_checkpoint(directory, model, opt)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(5)  # different initial weights: the load must bring every value
    reloaded = shardpar.wrap(WithFrozenOddities(), stage=other_stage, min_unit_params=1)
    shardpar.load_checkpoint(directory, reloaded, shardpar.optimizer(reloaded, torch.optim.AdamW, lr=1e-2))
    return {"original": original, "trained": trained, "reloaded": reloaded.state_dict()}


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
@pytest.mark.parametrize("stage, other_stage", [(0, 3), (1, 2), (2, 0), (3, 1)])
def test_frozen_parameters_of_any_dtype_train_and_checkpoint_at_every_stage(
    stage: int, other_stage: int, mixed_precision: str | None, tmp_path: Path
) -> None:
    results = run_ranks(_train_save_reload, 2, stage, other_stage, mixed_precision, str(tmp_path / "ckpt"), timeout=90)
    for rank, result in enumerate(results):
        original, trained, reloaded = result["original"], result["trained"], result["reloaded"]
        for name in FROZEN:
            assert trained[name].dtype == original[name].dtype, f"rank {rank}: {name} changed dtype"
            assert torch.equal(trained[name], original[name]), f"rank {rank}: frozen {name} changed in training"
        assert not torch.equal(trained["lin.weight"], original["lin.weight"]), "the trainable layer did not train"
        assert trained.keys() == reloaded.keys()
        for name, value in trained.items():
            assert reloaded[name].dtype == value.dtype and torch.equal(reloaded[name], value), (
                f"rank {rank}: {name} differs after a load at stage {other_stage}"
            )
    assert torch.equal(results[0]["trained"]["lin.weight"], results[1]["trained"]["lin.weight"])


class WithComplex128(nn.Module):
    def __init__(self, persistent: bool = True, parameter: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        value = torch.ones(3, dtype=torch.complex128)
        if parameter:
            self.freqs = nn.Parameter(value, requires_grad=False)
        else:
            self.register_buffer("freqs", value, persistent=persistent)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("parameter", [False, True])
def test_a_complex128_state_entry_is_refused_at_wrap_by_name(stage: int, parameter: bool) -> None:
    kind = "parameter" if parameter else "buffer"
    with pytest.raises(ValueError, match=rf"{kind} 'freqs' has dtype torch.complex128.*cannot store"):
        shardpar.wrap(WithComplex128(parameter=parameter), stage=stage)


def test_a_non_persistent_complex128_buffer_is_fine() -> None:
    model = shardpar.wrap(WithComplex128(persistent=False), stage=0)
    assert "freqs" not in model.state_dict()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_trainable_complex_parameter_is_refused_at_wrap_by_name(stage: int) -> None:
    module = nn.Linear(2, 2)
    module.phase = nn.Parameter(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ValueError, match=r"parameter 'phase' is complex.*view_as_real"):
        shardpar.wrap(module, stage=stage)
