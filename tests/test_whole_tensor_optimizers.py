"""Optimizers whose update reads whole tensors (issue #43): Muon, Adafactor, LAMB, nanochat's
Muon and a Shampoo-like toy, as scripts use them.

- At stage 0, world 2, each trains bit for bit as torch DDP with the same optimizer on the same
  per-rank batches (losses and parameters ``torch.equal``), also accumulating micro-batches
  under ``no_sync``; both reduce with one all-reduce of the gradients divided by 2 first, so the
  optimizer sees the same averaged gradient bit for bit. Muon goes with AdamW for the
  non-matrix parameters (two optimizers over one model, as nanochat), and so does nanochat's
  Muon, which regroups the tensors it is given by shape. ``memory_stats()["optimizer_state"]``
  is the bytes the optimizers' state tensors really hold, and DDP's optimizers hold the same.
  nanochat's Muon runs Newton-Schulz once per matrix per step on each rank (at stage 0 every
  rank updates every matrix: #43 makes it one rank per matrix).
- At stages 1-3 each is refused today, on every rank, with a ValueError that names the class,
  says its update reads whole tensors and that such optimizers run at stage 0, and gives the
  probe's finding without an empty ``AssertionError`` (nanochat's bare ``assert``) and without
  speaking of norms where the optimizer takes none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks
from tests.support.whole_tensor_optimizers import Lamb, NanochatMuon, ShampooToy

GLOBAL_ROWS = 8
"""Rows of every micro-batch, over all ranks: 4 per rank at world size 2."""
STEPS = 3


class MatrixNet(nn.Module):
    """Matrices of three shapes (two of one shape, so a grouping by shape groups), biases and a
    LayerNorm: what a second optimizer (AdamW) takes where Muon takes only matrices."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 16)
        self.fc3 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.fc1(x))
        x = x + F.gelu(self.fc3(F.gelu(self.fc2(self.norm(x)))))
        return self.head(x)


def _net() -> MatrixNet:
    torch.manual_seed(0)
    return MatrixNet()


def _split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    params = list(model.parameters())
    return [p for p in params if p.ndim == 2], [p for p in params if p.ndim != 2]


Make = Callable[..., Any]
"""``make(optimizer_class, params, **options)``: a plain torch optimizer or a shardpar one."""


def _shardpar_make(model: shardpar.ShardedModule) -> Make:
    return lambda cls, params, **options: shardpar.optimizer(model, cls, params, **options)


OPTIMIZERS: dict[str, Callable[[nn.Module, Make], list[Any]]] = {
    "torch Muon + AdamW": lambda model, make: [
        make(torch.optim.Muon, _split(model)[0], lr=0.02),
        make(torch.optim.AdamW, _split(model)[1], lr=0.01),
    ],
    "Adafactor": lambda model, make: [make(torch.optim.Adafactor, list(model.parameters()), lr=0.01)],
    "LAMB": lambda model, make: [make(Lamb, list(model.parameters()), lr=0.01)],
    "nanochat Muon + AdamW": lambda model, make: [
        make(NanochatMuon, _split(model)[0], lr=0.02),
        make(torch.optim.AdamW, [{"params": _split(model)[1]}], lr=0.01, betas=(0.8, 0.95)),
    ],
    "Shampoo toy": lambda model, make: [make(ShampooToy, list(model.parameters()), lr=0.01)],
}
CLASSES = {
    "torch Muon + AdamW": torch.optim.Muon,
    "Adafactor": torch.optim.Adafactor,
    "LAMB": Lamb,
    "nanochat Muon + AdamW": NanochatMuon,
    "Shampoo toy": ShampooToy,
}
"""The class that reads whole tensors in each case (the one refused at stages 1-3)."""


def _batch(step: int, micro: int) -> torch.Tensor:
    """This rank's rows of micro-batch ``micro`` of step ``step``."""
    rows = torch.randn(GLOBAL_ROWS, 8, generator=torch.Generator().manual_seed(100 * step + micro))
    size = GLOBAL_ROWS // C.get_world_size()
    return rows[C.get_rank() * size : (C.get_rank() + 1) * size]


def _train(model: Any, optimizers: list[Any], micro_batches: int) -> list[float]:
    """A DDP script's loop: ``micro_batches`` backwards per step, all but the last under
    ``no_sync``, each loss divided by their number; every optimizer steps, then zero_grad."""
    losses = []
    for step in range(STEPS):
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = model(_batch(step, micro)).square().mean() / micro_batches
                loss.backward()
            losses.append(loss.item())
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
    return losses


def _state_bytes(optimizers: list[Any]) -> int:
    """Bytes of the optimizers' state tensors, counted from the tensors themselves."""
    return sum(
        value.nbytes
        for opt in optimizers
        for state in opt.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def _against_ddp(case: str, micro_batches: int, stage: int = 0) -> dict[str, Any]:
    out: dict[str, Any] = {}
    NanochatMuon.reset_count()
    model = shardpar.wrap(_net(), stage=stage, bucket_cap_mb=0.001, min_unit_params=1)  # several buckets
    optimizers = OPTIMIZERS[case](model, _shardpar_make(model))
    out["losses"] = _train(model, optimizers, micro_batches)
    out["params"] = model.full_state_dict()
    out["reported"] = model.memory_stats()["optimizer_state"]
    out["held"] = _state_bytes(optimizers)
    out["newton_schulz_runs"] = NanochatMuon.newton_schulz_runs
    model.engine.close()

    NanochatMuon.reset_count()
    ddp = DistributedDataParallel(_net())
    ddp_optimizers = OPTIMIZERS[case](ddp.module, lambda cls, params, **kw: cls(params, **kw))
    out["ddp losses"] = _train(ddp, ddp_optimizers, micro_batches)
    out["ddp params"] = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    out["ddp held"] = _state_bytes(ddp_optimizers)
    out["ddp newton_schulz_runs"] = NanochatMuon.newton_schulz_runs
    return out


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_at_stage_0_each_trains_bit_for_bit_as_torch_ddp(case: str, micro_batches: int) -> None:
    matrices = len(_split(_net())[0])
    for rank, out in enumerate(run_ranks(_against_ddp, 2, case, micro_batches, timeout=120)):
        where = f"{case}, {micro_batches} micro-batches, rank {rank}"
        assert out["losses"] == out["ddp losses"], (where, out["losses"], out["ddp losses"])
        assert out["params"].keys() == out["ddp params"].keys(), where
        for name, value in out["ddp params"].items():
            assert torch.equal(out["params"][name], value), (
                f"{where}: {name} differs by {(out['params'][name] - value).abs().max().item():.3e}"
            )
        assert out["held"] > 0, where
        assert out["reported"] == out["held"] == out["ddp held"], (where, out["reported"], out["held"])
        if case.startswith("nanochat"):  # at stage 0 every rank orthogonalises every matrix once per step
            assert out["newton_schulz_runs"] == out["ddp newton_schulz_runs"] == STEPS * matrices, (where, out)


def _refusals() -> dict[tuple[int, str], str | None]:
    messages: dict[tuple[int, str], str | None] = {}
    for stage in (1, 2, 3):
        for case, build in OPTIMIZERS.items():
            model = shardpar.wrap(_net(), stage=stage, min_unit_params=1, bucket_cap_mb=0.001)
            try:
                build(model, _shardpar_make(model))
                messages[stage, case] = None
            except ValueError as error:
                messages[stage, case] = str(error)
            model.engine.close()
    return messages


def test_at_stages_1_to_3_each_is_refused_on_every_rank_naming_the_class_and_why() -> None:
    results = run_ranks(_refusals, 2, timeout=120)
    for rank, messages in enumerate(results):
        for (stage, case), message in messages.items():
            where = f"rank {rank}, stage {stage}, {case}"
            assert message is not None, f"{where}: built over 1-D pieces of the parameters"
            cls = CLASSES[case]
            assert message.startswith(
                f"{cls.__module__}.{cls.__qualname__} does not update parameters element by element ("
            ), (where, message)
            assert "its update reads whole tensors" in message, (where, message)
            assert "run at stage 0 today" in message and "Use stage=0" in message, (where, message)
            assert f"at stage {stage} each rank updates 1-D slices" in message, (where, message)
            assert "AssertionError: )" not in message, (where, message)
            if case != "LAMB":  # only LAMB's reason is a norm (its trust ratio)
                assert "norm" not in message, (where, message)
            if case == "LAMB":
                assert "two halves" in message and "trust ratio" in message, (where, message)
            if case == "nanochat Muon + AdamW":  # its bare assert, shown where it is
                assert (
                    "a step on a 128 tensor failed (AssertionError, with no message, at "
                    "whole_tensor_optimizers.py:" in message
                ), (where, message)
                assert "assert matrix.ndim >= 2" in message, (where, message)
            if case == "torch Muon + AdamW":
                assert "it refuses a 1-D tensor (ValueError: Muon only supports 2D parameters" in message, message
    assert results[0] == results[1]  # the same refusal on every rank
