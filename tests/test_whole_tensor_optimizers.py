"""Optimizers whose update reads whole tensors (issue #43): Muon, Adafactor, LAMB, nanochat's
Muon and a Shampoo-like toy, as scripts use them, at every stage ([Note: whole-tensor
ownership] in shardpar/core/layout.py).

- At every stage, world 2, each trains bit for bit as torch DDP with the same optimizer on the
  same per-rank batches (losses and parameters ``torch.equal``), also accumulating micro-batches
  under ``no_sync``: DDP all-reduces the gradients divided by 2 and stages 1-3 reduce-scatter
  them divided by 2, and a sum of two values does not depend on the order, so the optimizer
  sees the same averaged gradient bit for bit, whole on the rank that owns the tensor. Muon
  goes with AdamW for the non-matrix parameters (two optimizers over one model, as nanochat),
  and so does nanochat's Muon, which regroups the tensors it is given by shape.
- ``memory_stats()["optimizer_state"]`` is the bytes the optimizers' state tensors really hold;
  at stage 0 it equals DDP's, at stages 1-3 each rank holds at most half of DDP's plus the
  state of one tensor, and the ranks' together hold DDP's (each owned tensor's state once).
- nanochat's Muon runs Newton-Schulz once per matrix per step on each rank at stage 0, and once
  per matrix per step over the whole job at stages 1-3 (on the owner).
- World 4 and hybrid 2x2 against DDP at world 4 (close: gloo's all-reduce and reduce-scatter of
  four values may add them in different orders), mixed precision against stage 0 with the same
  precision (bit for bit), clipping against DDP + torch's clip, and checkpoints saved at one stage
  and world size and resumed at another against training straight through.
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


def _state_bytes(optimizers: list[Any], only: Any = None, least_dims: int = 0) -> int:
    """Bytes of the optimizers' state tensors (of the tensor ``only``, if given; of at least
    ``least_dims`` dimensions), counted from the tensors themselves."""
    return sum(
        value.nbytes
        for opt in optimizers
        for tensor, state in opt.state.items()
        if only is None or tensor is only
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() >= least_dims
    )


def _against_ddp(case: str, micro_batches: int, stage: int = 0, **options: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = shardpar.wrap(_net(), stage=stage, bucket_cap_mb=0.001, min_unit_params=1, **options)  # several buckets
    optimizers = OPTIMIZERS[case](model, _shardpar_make(model))
    NanochatMuon.reset_count()  # the check that ran the class while building it counts too
    out["losses"] = _train(model, optimizers, micro_batches)
    out["params"] = model.full_state_dict()
    out["reported"] = model.memory_stats()["optimizer_state"]
    out["held"] = _state_bytes(optimizers)
    out["held, not 0-d"] = _state_bytes(optimizers, least_dims=1)
    out["newton_schulz_runs"] = NanochatMuon.newton_schulz_runs
    model.engine.close()

    ddp = DistributedDataParallel(_net())
    ddp_optimizers = OPTIMIZERS[case](ddp.module, lambda cls, params, **kw: cls(params, **kw))
    NanochatMuon.reset_count()
    out["ddp losses"] = _train(ddp, ddp_optimizers, micro_batches)
    out["ddp params"] = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    out["ddp held"] = _state_bytes(ddp_optimizers)
    out["ddp held, not 0-d"] = _state_bytes(ddp_optimizers, least_dims=1)
    out["ddp newton_schulz_runs"] = NanochatMuon.newton_schulz_runs
    out["largest state"] = max(_state_bytes([opt], one) for opt in ddp_optimizers for one in opt.state)
    return out


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", list(OPTIMIZERS))
def test_each_trains_bit_for_bit_as_torch_ddp_at_every_stage(case: str, stage: int, micro_batches: int) -> None:
    matrices = len(_split(_net())[0])
    results = run_ranks(_against_ddp, 2, case, micro_batches, stage, timeout=120)
    for rank, out in enumerate(results):
        where = f"{case}, stage {stage}, {micro_batches} micro-batches, rank {rank}"
        assert out["losses"] == out["ddp losses"], (where, out["losses"], out["ddp losses"])
        assert out["params"].keys() == out["ddp params"].keys(), where
        for name, value in out["ddp params"].items():
            assert torch.equal(out["params"][name], value), (
                f"{where}: {name} differs by {(out['params'][name] - value).abs().max().item():.3e}"
            )
        assert out["held"] > 0, where
        assert out["reported"] == out["held"], (where, out["reported"], out["held"])
        if stage == 0:
            assert out["held"] == out["ddp held"], (where, out["held"], out["ddp held"])
        else:  # within one tensor's state of half
            assert out["held"] <= out["ddp held"] / 2 + out["largest state"], (where, out["held"], out["ddp held"])
    if stage:  # every state element once over the ranks (a 0-d step is held by each rank with a piece)
        together = sum(out["held, not 0-d"] for out in results)
        assert together == results[0]["ddp held, not 0-d"], [out["held, not 0-d"] for out in results]
    if case.startswith("nanochat"):  # one Newton-Schulz per matrix per step: on every rank at 0, on its owner at 1-3
        runs = [out["newton_schulz_runs"] for out in results]
        assert all(out["ddp newton_schulz_runs"] == STEPS * matrices for out in results)
        assert runs == [STEPS * matrices] * 2 if stage == 0 else sum(runs) == STEPS * matrices, (stage, runs)


# --------------------------------------------------------------------------- world 4, hybrid 2x2


def _at_world_4(case: str, stage: int, shard_group_size: int | None) -> dict[str, Any]:
    hybrid = {} if shard_group_size is None else {"shard_group_size": shard_group_size}
    return _against_ddp(case, 2, stage, **hybrid)


@pytest.mark.parametrize("shard_group_size", [None, 2])
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", ["torch Muon + AdamW", "nanochat Muon + AdamW", "Adafactor"])
def test_at_world_4_and_hybrid_2x2_each_trains_as_torch_ddp(
    case: str, stage: int, shard_group_size: int | None
) -> None:
    """Close, not bit for bit: at world 4 gloo's all-reduce (DDP) and its reduce-scatter (or,
    hybrid, reduce-scatter in a group of 2 then all-reduce across 2) add four values in
    different orders, an ulp apart; the update itself is the same whole-tensor update."""
    matrices = len(_split(_net())[0])
    results = run_ranks(_at_world_4, 4, case, stage, shard_group_size, timeout=180)
    group = 4 if shard_group_size is None else shard_group_size
    for rank, out in enumerate(results):
        where = f"{case}, stage {stage}, shard group {group}, rank {rank}"
        assert out["losses"] == pytest.approx(out["ddp losses"], rel=1e-5, abs=1e-7), where
        for name, value in out["ddp params"].items():
            assert torch.allclose(out["params"][name], value, rtol=1e-4, atol=1e-6), (
                f"{where}: {name} differs by {(out['params'][name] - value).abs().max().item():.3e}"
            )
        assert out["reported"] == out["held"] <= out["ddp held"] / group + out["largest state"], (where, out["held"])
    for start in range(0, 4, group):  # each shard group holds every state element once
        together = sum(out["held, not 0-d"] for out in results[start : start + group])
        assert together == results[0]["ddp held, not 0-d"], (start, [out["held, not 0-d"] for out in results])
    if case.startswith("nanochat"):  # once per matrix per step in each shard group (replicas repeat it)
        runs = sum(out["newton_schulz_runs"] for out in results)
        assert runs == STEPS * matrices * (4 // group), runs


# --------------------------------------------------------------------------- mixed precision, clipping


def _mixed_precision(case: str, stage: int) -> dict[str, Any]:
    mp = shardpar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shardpar.wrap(_net(), stage=stage, bucket_cap_mb=0.001, min_unit_params=1, mixed_precision=mp)
    optimizers = OPTIMIZERS[case](model, _shardpar_make(model))
    losses = _train(model, optimizers, 2)
    out = {"losses": losses, "params": model.full_state_dict()}
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", ["torch Muon + AdamW", "Adafactor"])
def test_under_mixed_precision_each_trains_as_at_stage_0_bit_for_bit(case: str, stage: int) -> None:
    """bf16 compute, fp32 masters: the owner steps its fp32 master of the whole tensor."""
    expected = run_ranks(_mixed_precision, 2, case, 0, timeout=120)
    for rank, out in enumerate(run_ranks(_mixed_precision, 2, case, stage, timeout=120)):
        assert out["losses"] == expected[rank]["losses"], (rank, out["losses"], expected[rank]["losses"])
        for name, value in expected[rank]["params"].items():
            assert value.dtype == torch.float32 and torch.equal(out["params"][name], value), (rank, name)


def _clipped(case: str, stage: int | None) -> dict[str, Any]:
    if stage is None:
        model: Any = DistributedDataParallel(_net())
        optimizers = OPTIMIZERS[case](model.module, lambda cls, params, **kw: cls(params, **kw))
    else:
        model = shardpar.wrap(_net(), stage=stage, bucket_cap_mb=0.001, min_unit_params=1)
        optimizers = OPTIMIZERS[case](model, _shardpar_make(model))
    norms = []
    for step in range(STEPS):
        model(_batch(step, 0)).square().mean().backward()
        if stage is None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05).item())
        else:
            norms.append(model.clip_grad_norm_(0.05).item())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    params = model.module.state_dict() if stage is None else model.full_state_dict()
    return {"norms": norms, "params": {k: v.detach().clone() for k, v in params.items()}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_by_the_global_norm_then_muon_trains_as_torch_ddp(stage: int) -> None:
    """The norm is summed over every rank's pieces, owned tensors once (on their owners); it may
    differ from torch's in its last bit ([Note: a norm per piece] in core/clipping.py)."""
    expected = run_ranks(_clipped, 2, "torch Muon + AdamW", None, timeout=120)
    for rank, out in enumerate(run_ranks(_clipped, 2, "torch Muon + AdamW", stage, timeout=120)):
        assert out["norms"] == pytest.approx(expected[rank]["norms"], rel=1e-6), (rank, out["norms"])
        assert all(norm > 0.05 for norm in out["norms"])  # the clip took effect
        for name, value in expected[rank]["params"].items():
            assert torch.allclose(out["params"][name], value, rtol=1e-5, atol=1e-7), (rank, name)


# --------------------------------------------------------------------------- checkpoints


def _save_then_continue(case: str, stage: int, directory: str) -> dict[str, Any]:
    """Two steps, a checkpoint per optimizer, two steps more: the straight-through result."""
    return _steps_2_and_3(case, stage, directory, resume=False)


def _resume(case: str, stage: int, directory: str, shard_group_size: int | None = None) -> dict[str, Any]:
    """The checkpoints of :func:`_save_then_continue` loaded, then its last two steps."""
    return _steps_2_and_3(case, stage, directory, resume=True, shard_group_size=shard_group_size)


def _steps_2_and_3(
    case: str, stage: int, directory: str, resume: bool, shard_group_size: int | None = None
) -> dict[str, Any]:
    hybrid = {} if shard_group_size is None else {"shard_group_size": shard_group_size}
    model = shardpar.wrap(_net(), stage=stage, bucket_cap_mb=0.001, min_unit_params=1, **hybrid)
    optimizers = OPTIMIZERS[case](model, _shardpar_make(model))
    if not resume:
        _train_steps(model, optimizers, range(2))
    for index, opt in enumerate(optimizers):
        (shardpar.load_checkpoint if resume else shardpar.save_checkpoint)(f"{directory}/optimizer{index}", model, opt)
    _train_steps(model, optimizers, range(2, 4))
    out = {"params": model.full_state_dict()}
    model.engine.close()
    return out


def _train_steps(model: Any, optimizers: list[Any], steps: range) -> None:
    """One backward per step on the global batch split over the ranks (the same global batch at
    any world size)."""
    for step in steps:
        model(_batch(step, 0)).square().mean().backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()


def test_a_checkpoint_resumes_under_hybrid_sharding_as_training_straight_through(tmp_path: Any) -> None:
    """Saved at world 2, full sharding (one shard group of 2), resumed at world 4 in shard groups
    of 2: each owned tensor's state goes to its owner in every shard group."""
    through = run_ranks(_save_then_continue, 2, "torch Muon + AdamW", 2, str(tmp_path), timeout=180)
    back = run_ranks(_resume, 4, "torch Muon + AdamW", 2, str(tmp_path), 2, timeout=180)
    for name, value in through[0]["params"].items():
        for rank, out in enumerate(back):
            assert torch.allclose(out["params"][name], value, rtol=1e-4, atol=1e-6), (rank, name)


def _accumulated(case: str, stage: int, micro_batches: int) -> dict[str, torch.Tensor]:
    """One step per global batch of 16 rows, as ``micro_batches`` backwards (all but the last
    under ``no_sync``), each on its part of this rank's rows and its loss divided by their number."""
    model = shardpar.wrap(_net(), stage=stage, bucket_cap_mb=0.001, min_unit_params=1)
    optimizers = OPTIMIZERS[case](model, _shardpar_make(model))
    for step in range(STEPS):
        rows = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
        mine = rows[C.get_rank() * 8 : (C.get_rank() + 1) * 8]
        for micro, part in enumerate(mine.chunk(micro_batches)):
            with contextlib.nullcontext() if micro == micro_batches - 1 else model.no_sync():
                (model(part).square().mean() / micro_batches).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    params = model.full_state_dict()
    model.engine.close()
    return params


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("case", ["torch Muon + AdamW", "nanochat Muon + AdamW", "Adafactor"])
def test_four_micro_batches_step_as_one_batch_of_four(case: str, stage: int) -> None:
    """Accumulated gradients reach the owner once, after the last micro-batch: the update is the
    one of the whole batch, within the precision of the update (the two sum the rows' gradients
    in another order; Muon orthogonalises in bfloat16)."""
    whole = run_ranks(_accumulated, 2, case, stage, 1, timeout=120)
    accumulated = run_ranks(_accumulated, 2, case, stage, 4, timeout=120)
    for rank in range(2):
        for name, value in whole[rank].items():
            assert torch.allclose(accumulated[rank][name], value, rtol=1e-3, atol=1e-5), (
                rank,
                name,
                (accumulated[rank][name] - value).abs().max().item(),
            )


@pytest.mark.parametrize(
    ("case", "saved", "resumed"),
    [
        ("torch Muon + AdamW", (2, 2), (2, 3)),
        ("torch Muon + AdamW", (2, 3), (1, 0)),
        ("torch Muon + AdamW", (2, 1), (4, 2)),
        ("LAMB", (2, 2), (4, 3)),
        ("LAMB", (2, 3), (2, 0)),
        ("nanochat Muon + AdamW", (2, 2), (2, 1)),
        ("Adafactor", (2, 2), (4, 3)),
        ("Adafactor", (2, 3), (2, 0)),
        ("Adafactor", (2, 0), (2, 1)),
        ("Shampoo toy", (2, 1), (2, 3)),
    ],
)
def test_a_checkpoint_resumes_at_another_stage_and_world_size_as_training_straight_through(
    case: str, saved: tuple[int, int], resumed: tuple[int, int], tmp_path: Any
) -> None:
    """(world size, stage) saved and resumed. An owned tensor's state is written once, by its
    owner, as a whole piece, and read back by whichever rank owns it (or a slice of it) in the
    new layout; at the same world size the result is bit for bit, at another it is as close as
    the two worlds' gradient averages are (four quarters summed against two halves). Adafactor's
    factored moments and Shampoo's preconditioners, shaped otherwise than their parameter, are
    stored whole (the manifest's ``whole_state``), once."""
    through = run_ranks(_save_then_continue, saved[0], case, saved[1], str(tmp_path), timeout=180)
    back = run_ranks(_resume, resumed[0], case, resumed[1], str(tmp_path), timeout=180)
    for name, value in through[0]["params"].items():
        for rank, out in enumerate(back):
            if resumed[0] == saved[0]:
                assert torch.equal(out["params"][name], value), (rank, name)
            else:
                assert torch.allclose(out["params"][name], value, rtol=1e-4, atol=1e-6), (
                    rank,
                    name,
                    (out["params"][name] - value).abs().max().item(),
                )


def _adafactor_saved(directory: str) -> None:
    model = shardpar.wrap(_net(), stage=2, bucket_cap_mb=0.001)
    opt = shardpar.optimizer(model, torch.optim.Adafactor, lr=0.01)
    _train_steps(model, [opt], range(2))
    shardpar.save_checkpoint(directory, model, opt)
    model.engine.close()


def _adafactor_state(directory: str, stage: int) -> dict[str, Any]:
    model = shardpar.wrap(_net(), stage=stage, bucket_cap_mb=0.001)
    opt = shardpar.optimizer(model, torch.optim.Adafactor, lr=0.01)
    shardpar.load_checkpoint(directory, model, opt)
    state = {
        (piece.name, key): value.clone()
        for pieces in opt.pieces()
        for piece in pieces
        for key, value in opt.state_of(piece).items()
        if isinstance(value, torch.Tensor) and value.dim()
    }
    model.engine.close()
    return state


def test_factored_state_is_stored_whole_once_and_resharded_offline(tmp_path: Any) -> None:
    """Adafactor's ``row_var``/``col_var`` of each matrix: one safetensors entry each, written by
    the matrix's owner, in the manifest's ``whole_state`` with their own shape; ``reshard``
    carries them, and a load at stage 0 (every rank) and stage 3 (the new owners) reads them back
    equal."""
    from shardpar.checkpoint.format import read_manifest
    from shardpar.checkpoint.offline import reshard

    saved = str(tmp_path / "saved")
    run_ranks(_adafactor_saved, 2, saved, timeout=120)
    manifest = read_manifest(saved)
    assert manifest.optimizer is not None
    matrices = {name: p.shape for name, p in _net().named_parameters() if p.ndim == 2}
    whole = manifest.optimizer.whole_state
    assert set(whole) == set(matrices)
    for name, shape in matrices.items():
        assert {key: entry.shape for key, entry in whole[name].items()} == {
            "row_var": (shape[0], 1),
            "col_var": (1, shape[1]),
        }, name
        assert all(len(entry.pieces) == 1 for entry in whole[name].values()), name  # once, by its owner
        assert name not in manifest.optimizer.state  # nothing of the parameter's shape besides
    resharded = reshard(saved, tmp_path / "resharded", world_size=3, progress=False)
    assert read_manifest(resharded).optimizer.whole_state.keys() == whole.keys()
    every_rank = run_ranks(_adafactor_state, 2, saved, 0, timeout=120)
    for rank, state in enumerate(every_rank):
        for name in matrices:
            for key in ("row_var", "col_var"):
                assert (name, key) in state, (rank, name, key)
    owners = run_ranks(_adafactor_state, 2, str(resharded), 3, timeout=120)
    for name in matrices:
        for key in ("row_var", "col_var"):
            held = [state[name, key] for state in owners if (name, key) in state]
            assert len(held) == 1, (name, key)  # on its owner only
            assert torch.equal(held[0], every_rank[0][name, key]), (name, key)


# --------------------------------------------------------------------------- tied and frozen weights


class TiedNet(nn.Module):
    """A projection tied to the output head by registration (one parameter, used twice), a
    frozen matrix between, and trainable ones: Muon over the trainable matrices, AdamW over
    the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.proj = nn.Linear(16, 16, bias=False)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.proj.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.frozen(self.proj(F.gelu(self.inp(x)))))
        return self.head(self.norm(h))


def _tied(stage: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    net = TiedNet()
    if stage is None:
        model: Any = DistributedDataParallel(net)
        make: Make = lambda cls, params, **kw: cls(params, **kw)  # noqa: E731
        module = model.module
    else:
        model = shardpar.wrap(net, stage=stage, bucket_cap_mb=0.001, min_unit_params=1)
        make = _shardpar_make(model)
        module = model
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizers = [
        make(torch.optim.Muon, [p for p in trainable if p.ndim == 2], lr=0.02),
        make(torch.optim.AdamW, [p for p in trainable if p.ndim != 2], lr=0.01),
    ]
    losses = _train(model, optimizers, 2)
    params = model.module.state_dict() if stage is None else model.full_state_dict()
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in params.items()}}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tied_and_frozen_weights_train_as_torch_ddp(stage: int) -> None:
    expected = run_ranks(_tied, 2, None, timeout=120)
    for rank, out in enumerate(run_ranks(_tied, 2, stage, timeout=120)):
        assert out["losses"] == expected[rank]["losses"], (rank, out["losses"])
        for name, value in expected[rank]["params"].items():
            assert torch.equal(out["params"][name], value), (rank, name)
