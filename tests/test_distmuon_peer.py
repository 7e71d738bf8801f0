"""tools/benchkit's DistMuon-style peer (config ``distmuon``, issue #43's baseline): at world
size 2, on the nanochat-shaped GPT, it trains bit for bit as torch DDP with the same two
optimizers (``torch.optim.Muon`` over the blocks' matrices, AdamW over the embedding and the
head) on the same per-rank batches, and each rank holds about half of DDP's optimizer state:
every matrix's momentum on its owner only (balanced: at most half the elements plus one
matrix), AdamW's moments of one slice of the flat vector. Why bit for bit: [Note: the DistMuon
peer] in tools/benchkit/distmuon.py."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tests.support.harness import run_ranks
from tools.benchkit.distmuon import DistMuon, owners_longest_first
from tools.benchkit.models import parse_models
from tools.benchkit.optimizers import muon_and_adamw
from tools.benchkit.runners import DistMuonRunner

[SPEC] = parse_models("nanochat:tiny")
STEPS = 3


def _build() -> torch.nn.Module:
    torch.manual_seed(0)
    return SPEC.build()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    return SPEC.batch_for(torch.Generator().manual_seed(1000 * step + rank))


def _state_bytes(tensors: Any) -> int:
    return sum(t.nbytes for t in tensors)


def _peer_and_ddp() -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    out: dict[str, Any] = {}
    peer = DistMuonRunner(_build(), SPEC, {})
    out["losses"] = []
    for step in range(STEPS):
        out["losses"].append(peer.forward_backward(_batch(step, rank)).item())
        peer.step()
        peer.zero_grad()
    out["params"] = {k: v.detach().clone() for k, v in peer.model.state_dict().items()}
    [both] = peer.optimizers
    muon, adamw = both.parts
    assert isinstance(muon, DistMuon)
    out["muon state"], out["adamw state"] = _state_bytes(muon.state_tensors()), _state_bytes(adamw.state_tensors())
    out["owned elements"] = sum(p.numel() for p in muon.owned)
    out["owners"] = muon.owners

    ddp = DistributedDataParallel(_build())
    optimizers = muon_and_adamw(ddp.module, lambda cls, params, **options: cls(params, **options))
    out["ddp losses"] = []
    for step in range(STEPS):
        inputs, targets = _batch(step, rank)
        loss = F.cross_entropy(ddp(inputs).flatten(0, -2), targets)
        loss.backward()
        out["ddp losses"].append(loss.item())
        for opt in optimizers:
            opt.step()
        for opt in optimizers:
            opt.zero_grad()
    out["ddp params"] = {k: v.detach().clone() for k, v in ddp.module.state_dict().items()}
    out["ddp state"] = [
        _state_bytes(v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))
        for opt in optimizers
    ]
    return out


def test_the_distmuon_peer_trains_as_ddp_with_the_same_optimizers_holding_half_the_state() -> None:
    results = run_ranks(_peer_and_ddp, 2, timeout=120)
    model = _build()
    matrices = [p.numel() for p in model.muon_params()]
    adamw_numel = sum(p.numel() for p in model.adamw_params())
    for rank, out in enumerate(results):
        assert out["losses"] == out["ddp losses"], (rank, out["losses"], out["ddp losses"])
        for name, value in out["ddp params"].items():
            assert torch.equal(out["params"][name], value), (
                f"rank {rank}: {name} differs by {(out['params'][name] - value).abs().max().item():.3e}"
            )
        # Muon's momentum: one fp32 value per owned element; owners balanced within one matrix
        assert out["muon state"] == 4 * out["owned elements"], (rank, out)
        assert out["owned elements"] <= sum(matrices) / 2 + max(matrices), (rank, out["owned elements"])
        # AdamW: two moments of a half of the flat vector (padded to even) and one step
        assert out["adamw state"] == 2 * 4 * -(-adamw_numel // 2) + 4, (rank, out["adamw state"])
    assert results[0]["owners"] == results[1]["owners"]
    muon_ddp, adamw_ddp = results[0]["ddp state"]
    assert muon_ddp == 4 * sum(matrices)  # DDP: every rank holds all of it
    assert sum(out["muon state"] for out in results) == muon_ddp  # each matrix's momentum on exactly one rank
    for out in results:
        assert out["muon state"] + out["adamw state"] <= (muon_ddp + adamw_ddp) / 2 + 4 * max(matrices) + 4


def test_owners_are_balanced_longest_first() -> None:
    assert owners_longest_first([10, 30, 20, 20], 2) == [0, 0, 1, 1]  # 30 + 10 | 20 + 20
    assert owners_longest_first([5, 5, 5], 2) == [0, 1, 0]
    assert owners_longest_first([7], 3) == [0]  # ranks 1 and 2 own nothing
    numels = [4096, 1024, 1024, 1024, 1024, 3072, 64, 64]
    for world in (2, 3, 4):
        owners = owners_longest_first(numels, world)
        loads = [sum(n for n, o in zip(numels, owners) if o == r) for r in range(world)]
        assert max(loads) <= sum(numels) / world + max(numels), (world, loads)
