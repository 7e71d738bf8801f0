"""The memory planner and communication model (``shardpar.planner``, ``tools/estimate.py``).

Closed forms first (DESIGN.md's four formulas, other optimizers, bf16), then the model
against what the engines measure on 2 gloo ranks: per-rank memory by kind within 10% at
every stage, and bytes sent per step exactly. Then ``choose_stage`` around its boundaries
and the command-line tool end to end. Last, tensors owned whole (``whole_tensors``: Muon's
matrices, LAMB's tensors) against the engines on 2 and 4 ranks and hybrid 2x2, to the byte.
"""

from __future__ import annotations

import functools
import importlib.util
import re
import shlex
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from shardpar.comm import process_group
from shardpar.comm.comm_stats import merge_snapshots
from shardpar.planner import (
    OPTIMIZER_STATE_BYTES,
    choose_stage,
    estimate_communication,
    estimate_memory,
    format_bytes,
    parse_bytes,
    parse_count,
)
from tests.support.harness import run_ranks

ROOT = Path(__file__).resolve().parent.parent
PSI = 7_000_000_000  # divisible by every world size below, so Ψ/N is exact
WORLD_SIZES = [1, 2, 8, 64]
MiB = 2**20


# --------------------------------------------------------------------------- models


class Tower(nn.Module):
    """Six equal 512x512 weights (1.57M parameters) and a buffer. With a 1 MiB bucket cap
    every weight is one bucket and, at stage 3, one unit: equal sizes arriving in order,
    the case the workspace model describes exactly."""

    width = 512

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(self.width, self.width, bias=False) for _ in range(6))
        self.register_buffer("gain", torch.ones(self.width))  # broadcast before every forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x * self.gain))
        return x


class Uneven(nn.Module):
    """256-1024-1024-256 MLP with biases (1.58M parameters): buckets of very different sizes."""

    width = 256

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(256, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Odd(nn.Module):
    """Four 50x50 Linears with biases (10,200 parameters): no tensor a multiple of 64 elements,
    so aligning for NCCL (``align_for_bandwidth``) pads in front of tensors and at the end of
    every bucket and unit."""

    width = 50

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(self.width, self.width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def tower() -> Tower:
    """Factory for ``tools/estimate.py --model tests.test_planner:tower``."""
    return Tower()


TOWER_PSI = 6 * 512 * 512
TOWER_CAP_MB = 1.0  # 262144 fp32 elements: exactly one 512x512 weight per bucket
MODELS = {"tower": Tower, "uneven": Uneven, "odd": Odd}


# --------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_design_formulas_fp32_adam(world_size: int) -> None:
    """DESIGN.md: 16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N, 16Ψ/N, plus bounded workspace."""
    n = world_size
    expected = {0: 16 * PSI, 1: 8 * PSI + 8 * PSI // n, 2: 4 * PSI + 12 * PSI // n, 3: 16 * PSI // n}
    per_kind = {
        0: (4 * PSI, 4 * PSI, 8 * PSI),
        1: (4 * PSI, 4 * PSI, 8 * PSI // n),
        2: (4 * PSI, 4 * PSI // n, 8 * PSI // n),
        3: (4 * PSI // n, 4 * PSI // n, 8 * PSI // n),
    }
    for stage in range(4):
        e = estimate_memory(PSI, n, stage)
        assert e.model_state == expected[stage], f"stage {stage}, N={n}"
        assert (e.params, e.grads, e.optimizer_state) == per_kind[stage]
        assert e.total == e.model_state + e.workspace
        assert (e.param_count, e.world_size, e.stage, e.optimizer) == (PSI, n, stage, "adamw")
    # Workspace: none at stages 0-1; 3 buckets of 25 MiB at stage 2; stage 3 with units of
    # Ψ/10: 2 gathered + 3 staged, fp32.
    assert estimate_memory(PSI, n, 0).workspace == estimate_memory(PSI, n, 1).workspace == 0
    assert estimate_memory(PSI, n, 2).workspace == 3 * 25 * MiB
    assert estimate_memory(PSI, n, 3).workspace == (2 + 3) * 4 * PSI // 10


def test_workspace_is_capped_by_the_model() -> None:
    small = 1000  # one bucket, one unit
    assert estimate_memory(small, 2, 2).workspace == 4 * small
    assert estimate_memory(small, 2, 3, largest_unit_params=small).workspace == (4 + 4) * small
    assert estimate_memory(PSI, 8, 3, largest_unit_params=PSI // 100).workspace == (2 + 3) * 4 * PSI // 100
    assert estimate_memory(PSI, 8, 2, bucket_cap_mb=100).workspace == 3 * 100 * MiB


def test_padding_of_a_count_aligned_and_dense() -> None:
    """A bare count is one tensor per bucket and per unit. Ψ = 1000 on N = 3: aligned for NCCL
    (buckets and units of lcm(3, 128) = 384) one bucket of 3·384 = 1152 elements (P = 152), or
    10 units of 100, each 384 (P = 10·284 = 2840); dense, one bucket of 1002 (P = 2) and units
    of 102 (P = 20). Padding is stored like parameters, not in the optimizer state, and sent
    as padding (gathers add a 16-byte tag per rank)."""
    n, f = 3, 2 / 3
    for aligned, bucket, unit in ((True, 1152, 384), (False, 1002, 102)):
        e0 = estimate_memory(1000, n, 0, align_for_bandwidth=aligned)
        assert (e0.params, e0.grads, e0.optimizer_state) == (4 * bucket, 4 * bucket, 8 * 1000)
        e3 = estimate_memory(1000, n, 3, align_for_bandwidth=aligned)
        assert (e3.params, e3.grads, e3.optimizer_state) == (4 * 10 * unit // n, 4 * 10 * unit // n, round(8000 / n))
        assert e3.workspace == (2 + 3) * 4 * unit  # 2 gathered + 3 staged units
        c0 = estimate_communication(1000, n, 0, align_for_bandwidth=aligned)
        assert c0.padding_as_dict() == {"all_reduce": pytest.approx(2 * (bucket - 1000) * 4 * f)}
        assert c0.all_reduce_bytes == pytest.approx(2 * 1000 * 4 * f)  # the payload does not change
        c3 = estimate_communication(1000, n, 3, align_for_bandwidth=aligned)
        assert c3.padding_as_dict() == {
            "reduce_scatter": pytest.approx(10 * (unit - 100) * 4 * f),
            "all_gather": pytest.approx(2 * 10 * ((unit - 100) * 4 + n * 16) * f),
        }
        assert c3.padding_sent_bytes == pytest.approx(sum(c3.padding_as_dict().values()))
    with pytest.raises(ValueError, match="align_for_bandwidth"):
        estimate_memory(1000, n, 0, align_for_bandwidth="yes")


def test_optimizer_table_covers_the_documented_names() -> None:
    assert {"adamw": 8, "adam": 8, "sgd": 0, "sgd_momentum": 4, "adagrad": 4, "rmsprop": 4, "muon": 4}.items() <= (
        OPTIMIZER_STATE_BYTES.items()
    )


@pytest.mark.parametrize(
    "optimizer, k",
    [
        ("sgd", 0),
        ("sgd_momentum", 4),
        ("adagrad", 4),
        ("rmsprop", 4),
        ("rmsprop_momentum", 8),
        ("adam", 8),
        ("muon", 4),
        (torch.optim.SGD, 0),
        (torch.optim.Adam, 8),
        (torch.optim.AdamW, 8),
        (torch.optim.Adagrad, 4),
        (torch.optim.RMSprop, 4),
        (torch.optim.Muon, 4),
    ],
)
def test_optimizer_state_bytes(optimizer: Any, k: int) -> None:
    for stage, divisor in [(0, 1), (1, 8), (2, 8), (3, 8)]:
        e = estimate_memory(PSI, 8, stage, optimizer=optimizer)
        assert e.optimizer_state == k * PSI // divisor
        assert e.optimizer_bytes_per_param == k
    sgd = [estimate_memory(PSI, 8, s, optimizer="sgd").model_state for s in range(4)]
    assert sgd == [8 * PSI, 8 * PSI, 4 * PSI + 4 * PSI // 8, 8 * PSI // 8]


def test_bf16_formulas() -> None:
    """Param dtype 2 bytes, reduce in fp32, fp32 master copy and optimizer state."""
    n = 8
    expected = {  # (params, grads, optimizer_state)
        0: (2 * PSI + 4 * PSI, 4 * PSI, 8 * PSI),
        1: (2 * PSI + 4 * PSI // n, 4 * PSI, 8 * PSI // n),
        2: (2 * PSI + 4 * PSI // n, 4 * PSI // n, 8 * PSI // n),
        3: (4 * PSI // n, 4 * PSI // n, 8 * PSI // n),
    }
    for stage in range(4):
        e = estimate_memory(PSI, n, stage, mixed_precision="bf16")
        assert (e.params, e.grads, e.optimizer_state) == expected[stage], f"stage {stage}"
        assert (e.param_bytes, e.reduce_bytes) == (2, 4)
        full = estimate_memory(
            PSI,
            n,
            stage,
            mixed_precision=shardpar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
        assert (full.as_dict(), full.param_bytes, full.reduce_bytes) == (e.as_dict(), 2, 4)
    assert estimate_memory(PSI, n, 2, mixed_precision="bf16").workspace == 3 * 25 * MiB  # staged in fp32
    assert estimate_memory(PSI, n, 3, mixed_precision="bf16").workspace == (2 * 2 + 3 * 4) * PSI // 10
    # Reducing in bf16 halves the reduced buffers and all staging; stages 0-1 also keep the
    # reduced gradients in fp32 for the optimizer (2Ψ bf16 buffer + 4Ψ fp32 copy at stage 0).
    both = shardpar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert estimate_memory(PSI, n, 0, mixed_precision=both).grads == 2 * PSI + 4 * PSI
    assert estimate_memory(PSI, n, 2, mixed_precision=both).workspace == 3 * 25 * MiB // 2
    assert estimate_memory(PSI, n, 1, mixed_precision="fp16").params == 2 * PSI + 4 * PSI // n


class WithFrozenAndTied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 10)
        self.head = nn.Linear(10, 100, bias=False)
        self.head.weight = self.emb.weight  # tied: counted once
        self.frozen = nn.Parameter(torch.zeros(40), requires_grad=False)


def test_module_counts_tied_once_and_frozen_in_params() -> None:
    model = WithFrozenAndTied()
    psi, frozen = 1000, 40
    for stage in range(4):
        e = estimate_memory(model, 2, stage)
        assert (e.param_count, e.frozen_param_count) == (psi, frozen)
        count = estimate_memory(psi, 2, stage)
        shares = 2 if stage == 3 else 1
        assert e.params == count.params + 4 * frozen // shares
        assert (e.grads, e.optimizer_state) == (count.grads, count.optimizer_state)
    with torch.device("meta"):  # costs no memory: how tools/estimate.py builds models
        meta = Tower()
    assert estimate_memory(meta, 8, 3).as_dict() == estimate_memory(Tower(), 8, 3).as_dict()


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: estimate_memory(PSI, 0, 0), "world_size"),
        (lambda: estimate_memory(PSI, 8, 4), "stage"),
        (lambda: estimate_memory(0, 8, 0), "parameter count"),
        (lambda: estimate_memory(PSI, 8, 0, optimizer="lion"), "optimizer='lion'"),
        (lambda: estimate_memory(PSI, 8, 0, optimizer=torch.optim.LBFGS), "LBFGS"),
        (lambda: estimate_memory(PSI, 8, 0, mixed_precision="int8"), "mixed_precision"),
        (lambda: estimate_memory(PSI, 8, 2, bucket_cap_mb=0), "bucket_cap_mb"),
        (lambda: estimate_communication(PSI, 8, 0, bandwidth_gbps=0), "bandwidth_gbps"),
        (lambda: choose_stage(PSI, 8, None), "memory_budget"),
        (lambda: choose_stage(PSI, 8, "lots"), "cannot read memory size 'lots'"),
    ],
)
def test_bad_arguments_name_the_problem(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize(
    "text, expected",
    [
        ("24GB", 24 * 10**9),
        ("24 GiB", 24 * 2**30),
        ("512MiB", 512 * 2**20),
        ("80G", 80 * 10**9),
        ("1.5TB", 1.5 * 10**12),
        ("100", 100),
        (4096, 4096),
        ("2kib", 2048),
    ],
)
def test_parse_bytes(text: Any, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("7e9", 7 * 10**9),
        ("7B", 7 * 10**9),
        ("350M", 350 * 10**6),
        ("1.3b", 1_300_000_000),
        ("125K", 125_000),
        ("1000", 1000),
        (42, 42),
    ],
)
def test_parse_count(text: Any, expected: int) -> None:
    assert parse_count(text) == expected


@pytest.mark.parametrize("text", ["7x", "", "GB", "-3GB", "1e400"])
def test_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(55.125e9, binary=False) == "55.12 GB"
    assert format_bytes(0) == "0 B"


# --------------------------------------------------------------------------- choose_stage


def test_choose_stage_at_the_boundaries() -> None:
    psi, n = 1_000_000_000, 8
    totals = [estimate_memory(psi, n, s).total for s in range(4)]
    assert totals == sorted(totals, reverse=True)  # here every stage needs less than the one below
    for stage, total in enumerate(totals):
        assert choose_stage(psi, n, total) == stage  # exactly at the budget: fits
        if stage < 3:
            assert choose_stage(psi, n, total - 1) == stage + 1  # a byte short: next stage
    with pytest.raises(ValueError) as error:
        choose_stage(psi, n, totals[3] - 1)
    message = str(error.value)
    assert "\n" not in message
    assert format_bytes(totals[3] - 1, binary=False) in message and format_bytes(totals[3]) in message


def test_choose_stage_reads_decimal_and_binary_budgets() -> None:
    psi = 1_550_000_000  # 16Ψ = 24.8e9 bytes: more than 24GB, less than 24GiB
    assert choose_stage(psi, 1, "24GiB") == 0
    with pytest.raises(ValueError, match="24.00 GB"):
        choose_stage(psi, 1, "24GB")
    assert choose_stage(psi, 2, "24GB") == 1  # 8Ψ + 4Ψ = 18.6e9
    assert choose_stage(PSI, 64, "24GB") == 3
    assert choose_stage(PSI, 64, "24GB", mixed_precision="bf16") == 2
    assert choose_stage(PSI, 64, "80GB") == 1
    assert choose_stage(PSI, 64, "80GB", optimizer="sgd") == 0  # 8Ψ = 56e9


@pytest.mark.parametrize("backend, aligned", [("nccl", True), ("gloo", False)])
def test_auto_stage_before_the_group_exists_plans_the_alignment_its_backend_will_get(
    monkeypatch: pytest.MonkeyPatch, backend: str, aligned: bool
) -> None:
    """wrap(stage='auto') under torchrun plans before it creates the default group; the plan
    must still count the alignment padding the engine will use on that group's backend."""
    wrap_module = importlib.import_module("shardpar.wrap")  # the module (shardpar.wrap is the function)
    seen: dict[str, Any] = {}

    def record(module: Any, world_size: int, budget: Any, shard_group_sizes: Any = None, **options: Any) -> Any:
        seen.update(options, world_size=world_size)
        return types.SimpleNamespace(stage=0, shard_group_size=None, reason="recorded")

    assert not C.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(wrap_module, "choose_plan", record)
    monkeypatch.setattr(process_group, "backend_for", lambda device: backend)
    config, _ = wrap_module._build_config(nn.Linear(4, 4), "auto", {"memory_budget": "1GB"})
    assert config.stage == 0 and seen == {"align_for_bandwidth": aligned, "world_size": 2}
    # An explicit choice is the user's and is passed through unchanged.
    wrap_module._build_config(nn.Linear(4, 4), "auto", {"memory_budget": "1GB", "align_for_bandwidth": False})
    assert seen["align_for_bandwidth"] is False


# --------------------------------------------------------------------------- communication


def test_communication_closed_form_7b_on_64_ranks() -> None:
    n, f = 64, 63 / 64
    tensors = PSI // 1_000_000  # a count assumes one tensor per million parameters
    flags = 2 * 4 * (tensors + 6) * f  # the used-parameter all-reduce: 4 bytes per tensor + 3 counters, negated too
    for stage in (0, 1, 2):
        c = estimate_communication(PSI, n, stage, bandwidth_gbps=25, latency_us=10)
        assert c.used_flags_bytes == pytest.approx(flags, rel=1e-12)
        assert c.sent_bytes - c.used_flags_bytes == pytest.approx(2 * PSI * 4 * f, rel=1e-12)  # 55.125 GB
        assert c.seconds == pytest.approx(c.sent_bytes / 25e9 + c.calls * 10e-6)
    assert estimate_communication(PSI, n, 0).as_dict() == {
        "all_reduce": pytest.approx(2 * PSI * 4 * f, rel=1e-12),
        "used_flags": pytest.approx(flags, rel=1e-12),
    }
    assert estimate_communication(PSI, n, 1).as_dict() == {
        "reduce_scatter": pytest.approx(PSI * 4 * f, rel=1e-12),
        "all_gather": pytest.approx(PSI * 4 * f, rel=1e-12),
        "used_flags": pytest.approx(flags, rel=1e-12),
    }
    c3 = estimate_communication(PSI, n, 3, bandwidth_gbps=25)
    assert c3.sent_bytes - flags == pytest.approx(3 * PSI * 4 * f, rel=1e-12)  # 82.69 GB
    assert c3.seconds == pytest.approx(c3.sent_bytes / 25e9)  # 3.31 s
    assert c3.calls == 31  # 10 assumed units: gather twice, reduce-scatter once; + the flags
    no_reshard = estimate_communication(PSI, n, 3, reshard_after_forward=False)
    assert no_reshard.sent_bytes - flags == pytest.approx(2 * PSI * 4 * f, rel=1e-12)
    bf16 = estimate_communication(PSI, n, 3, reduce_bytes=4, gather_bytes=2)
    assert bf16.sent_bytes - flags == pytest.approx((2 * 2 + 4) * PSI * f, rel=1e-12)
    assert estimate_communication(PSI, 1, 0, bandwidth_gbps=25, latency_us=10).seconds == 0.0
    assert estimate_communication(PSI, n, 0).seconds is None  # no bandwidth, no time
    assert estimate_communication(PSI, n, 0, buckets=7).calls == 8  # 7 buckets + the flags


# --------------------------------------------------------------------------- measured


def _measure(cases: dict[str, tuple[str, int, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """On every rank: wrap, two AdamW steps; memory after the second step, bytes sent by each."""
    results = {}
    for case, (model_name, stage, options) in cases.items():
        torch.manual_seed(0)
        module = MODELS[model_name]()
        model = shardpar.wrap(module, stage=stage, **options)
        opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
        # Every rank's optimizer-state bytes and tensors (one Adam `step` scalar each).
        pieces = sum(len(group) for group in opt.pieces())
        x = torch.randn(4, module.width, generator=torch.Generator().manual_seed(C.get_rank()))
        comm = []
        for _ in range(2):
            model.reset_comm_stats()
            model(x).float().square().mean().backward()
            opt.step()
            comm.append(model.comm_stats())
            memory = model.memory_stats()
            opt.zero_grad()
        model.engine.close()
        results[case] = {
            "memory": memory,
            "comm": comm,
            "optimizer_state_per_rank": C.all_gather_objects((memory["optimizer_state"], pieces)),
        }
    return results


CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    **{f"stage{s}": ("tower", s, {"bucket_cap_mb": TOWER_CAP_MB}) for s in range(4)},
    **{f"stage{s}-bf16": ("tower", s, {"bucket_cap_mb": TOWER_CAP_MB, "mixed_precision": "bf16"}) for s in range(4)},
    "stage3-keep-gathered": ("tower", 3, {"reshard_after_forward": False}),
    "stage2-uneven": ("uneven", 2, {"bucket_cap_mb": 1.0}),
    # One Linear per bucket or unit, aligned: [bias 50 | gap 14 | weight 2500 | tail 124] = 2688.
    **{
        f"stage{s}-aligned": (
            "odd",
            s,
            {"bucket_cap_mb": 2600 * 4 / MiB, "min_unit_params": 2000, "align_for_bandwidth": True},
        )
        for s in range(4)
    },
}
ALIGNED_CASES = [f"stage{s}-aligned" for s in range(4)]
MEMORY_CASES = [f"stage{s}{mp}" for mp in ("", "-bf16") for s in range(4)]


@functools.cache
def measured() -> dict[str, dict[str, Any]]:
    """Rank 0's measurements for every case (one harness call for all)."""
    return run_ranks(_measure, 2, CASES, timeout=60)[0]


def _estimates(case: str) -> tuple[Any, Any]:
    """The planner's memory and communication estimates for a case, as tools/estimate.py
    makes them (mixed precision: reduce in fp32, gather and broadcast buffers in bf16)."""
    model_name, stage, options = CASES[case]
    cap = options.get("bucket_cap_mb", 25.0)
    shared = {k: options[k] for k in ("min_unit_params", "align_for_bandwidth") if k in options}
    memory = estimate_memory(
        MODELS[model_name](), 2, stage, mixed_precision=options.get("mixed_precision"), bucket_cap_mb=cap, **shared
    )
    mp = memory.mixed_precision
    comm = estimate_communication(
        MODELS[model_name](),
        2,
        stage,
        reduce_bytes=memory.reduce_bytes,
        gather_bytes=memory.param_bytes if mp else None,
        bucket_cap_mb=cap,
        reshard_after_forward=options.get("reshard_after_forward", True),
        buffer_dtype=mp.buffer_dtype if mp else None,
        **shared,
    )
    return memory, comm


def _peak_workspace(memory: dict[str, int], stage: int) -> int:
    """What the planner's ``workspace`` models: transient buffers at their peak. The engines
    report the staging peak, and at stage 3 the parameter peak including gathered units."""
    if stage == 2:
        return memory["peak_staging"]
    return memory["peak_staging"] + memory["peak_params"] - memory["params"]


@pytest.mark.parametrize("case", MEMORY_CASES)
def test_memory_matches_the_engines_within_10_percent(case: str) -> None:
    """params, grads and optimizer state within 10% of what the engine holds (they match to
    Adam's per-tensor ``step`` scalars; the margin is for padding at other world sizes).
    Workspace too: with equal buckets and units arriving in order the model is exact, so
    10% also covers only padding. ``memory_stats()["workspace"]`` itself is what stays
    allocated between steps (a staging pool), so the peak is compared."""
    stage = CASES[case][1]
    memory = measured()[case]["memory"]
    estimate, _ = _estimates(case)
    assert estimate.param_count == TOWER_PSI
    for kind in ("params", "grads", "optimizer_state"):
        assert memory[kind] == pytest.approx(getattr(estimate, kind), rel=0.10), f"{case}: {kind}"
    assert memory["params"] + memory["grads"] + memory["optimizer_state"] == pytest.approx(
        estimate.model_state, rel=0.10
    )
    if stage < 2:
        assert memory["workspace"] == estimate.workspace == 0
        assert memory["total"] == pytest.approx(estimate.total, rel=0.10)
    else:
        assert _peak_workspace(memory, stage) == pytest.approx(estimate.workspace, rel=0.10)
        assert memory["workspace"] <= estimate.workspace  # what stays allocated is within the peak


def test_workspace_bounds_uneven_buckets() -> None:
    """Buckets of 256 to 1M elements: the model (3 largest buckets) is an upper bound of
    the staging peak (3 consecutive buckets) when gradients arrive in bucket order."""
    memory = measured()["stage2-uneven"]["memory"]
    estimate, _ = _estimates("stage2-uneven")
    assert memory["peak_staging"] <= estimate.workspace <= 1.25 * memory["peak_staging"]
    assert memory["total"] <= estimate.total


@pytest.mark.parametrize("case", list(CASES))
def test_communication_matches_measured_bytes(case: str) -> None:
    """Bytes sent per step, by kind and in total, equal ``comm_stats()`` (which reports
    payload and padding apart; so does the model), every step; the first step's one-off
    agreements between ranks (kind ``control``, pickles) aside."""
    _, estimate = _estimates(case)
    for step, comm in enumerate(measured()[case]["comm"]):
        comm = dict(comm)
        control = comm.pop("control", None)
        assert (control is not None) == (step == 0), f"step {step}"
        if control is not None:
            comm["total"] = {key: value - control[key] for key, value in comm["total"].items()}
        sent = {op: stats["sent_bytes"] for op, stats in comm.items() if op != "total"}
        assert sent == pytest.approx(estimate.as_dict()), f"step {step}"
        assert comm["total"]["sent_bytes"] == pytest.approx(estimate.sent_bytes)
        total_with_padding = comm["total"]["sent_bytes"] + comm["total"]["padding_sent_bytes"]
        assert abs(total_with_padding - estimate.sent_bytes) <= comm["total"]["padding_sent_bytes"] + 1e-6
        padding = {
            op: stats["padding_sent_bytes"]
            for op, stats in comm.items()
            if op != "total" and stats["padding_sent_bytes"]
        }
        assert padding == pytest.approx(estimate.padding_as_dict()), f"step {step}"
        assert comm["total"]["padding_sent_bytes"] == pytest.approx(estimate.padding_sent_bytes)
        assert sum(stats["calls"] for op, stats in comm.items() if op != "total") == estimate.calls


@pytest.mark.parametrize("case", ALIGNED_CASES)
def test_aligned_memory_and_bytes_equal_the_engines(case: str) -> None:
    """Aligned for NCCL (``align_for_bandwidth=True``, lcm(2, 128) = 128): each Linear is
    [bias 50 | gap 14 | weight 2500 | tail 124] = 2688 elements, one bucket (stages 0-2) or
    unit (stage 3) each, so the layouts hold Ψ + P = 4 x 2688 = 10,752 elements for
    Ψ = 10,200 (P = 552). The planner builds the same layouts: params and grads equal
    ``memory_stats()`` to the byte, so does the workspace peak (equal buckets and units, in
    order), and so does the optimizer state summed over the ranks less Adam's `step` scalars
    (padding belongs to no piece: 8Ψ per copy, one copy per rank at stage 0, one in all at
    stages 1-3). Bytes: see the test above, which runs the aligned cases too."""
    stage = CASES[case][1]
    memory = measured()[case]["memory"]
    estimate, comm = _estimates(case)
    psi, stored = 10_200, 4 * 2688
    assert estimate.param_count == psi
    per_rank = {0: (stored, stored), 1: (stored, stored), 2: (stored, stored // 2), 3: (stored // 2, stored // 2)}
    assert (estimate.params, estimate.grads) == tuple(4 * n for n in per_rank[stage])
    assert (memory["params"], memory["grads"]) == (estimate.params, estimate.grads)
    ranks = measured()[case]["optimizer_state_per_rank"]
    assert estimate.optimizer_state == 8 * psi // (1 if stage == 0 else 2)
    assert sum(state - 4 * pieces for state, pieces in ranks) == 2 * estimate.optimizer_state
    if stage >= 2:
        assert _peak_workspace(memory, stage) == estimate.workspace
    assert comm.padding_sent_bytes > 0


# --------------------------------------------------------------------------- tools/estimate.py


def _tool():
    spec = importlib.util.spec_from_file_location("estimate_tool", ROOT / "tools" / "estimate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start_tool(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "estimate.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def test_tool_end_to_end() -> None:
    # Both at once: each pays for importing torch.
    good = _start_tool(
        "--params",
        "7B",
        "--world-size",
        "8",
        "--world-size",
        "64",
        "--bandwidth",
        "25",
        "--latency",
        "10",
        "--budget",
        "80GB",
    )
    bad = _start_tool("--params", "7B", "--world-size", "1", "--budget", "10GB")
    (stdout, stderr), (_, bad_stderr) = good.communicate(timeout=60), bad.communicate(timeout=60)
    assert good.returncode == 0, stderr
    lines = stdout.splitlines()
    assert lines[0].startswith("7,000,000,000 trainable parameters")
    rows = [line.split() for line in lines[2:]]
    assert [(r[0], r[1]) for r in rows] == [(str(n), str(s)) for n in (8, 64) for s in range(4)]
    for row in rows:
        n, stage = int(row[0]), int(row[1])
        e = estimate_memory(PSI, n, stage)
        assert " ".join(row[10:12]) == format_bytes(e.total)
        comm = estimate_communication(PSI, n, stage, bandwidth_gbps=25, latency_us=10)
        assert float(row[14]) == pytest.approx(comm.seconds, abs=1e-3)
        assert ("picks" in row) == (stage == choose_stage(PSI, n, "80GB"))

    assert bad.returncode != 0
    assert bad_stderr.startswith("error: no stage fits --budget 10GB") and bad_stderr.count("\n") == 1


def test_tool_with_a_model_factory(capsys: pytest.CaptureFixture[str]) -> None:
    assert _tool().main(["--model", "tests.test_planner:tower", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{TOWER_PSI:,} trainable parameters")
    assert format_bytes(estimate_memory(Tower(), 2, 3).total) in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--params", "7x", "--world-size", "8"], "cannot read parameter count '7x'"),
        (["--model", "nope.nothing:f", "--world-size", "8"], "cannot import 'nope.nothing'"),
        (["--model", "tests.test_planner:nothing", "--world-size", "8"], "has no factory 'nothing'"),
        (["--model", "tests.test_planner", "--world-size", "8"], "MODULE:FACTORY"),
        (["--params", "7B", "--world-size", "8", "--budget", "lots"], "cannot read memory size 'lots'"),
        (["--params", "7B", "--world-size", "8", "--budget", "1GB"], "no stage fits --budget 1GB"),
        (["--params", "7B", "--world-size", "0"], "--world-size must be >= 1"),
        (["--params", "7B"], "--world-size"),
        (["--params", "7B", "--world-size", "8", "--bogus"], "unrecognized arguments: --bogus"),
        (["--params", "7B", "--model", "tests.test_planner:tower", "--world-size", "8"], "not allowed with"),
    ],
)
def test_tool_bad_input_is_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool()
    try:
        code = tool.main(argv)
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    assert code != 0
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_docs_tables_are_the_tools_output(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/planner.md pastes the tool's output; keep it true."""
    doc = (ROOT / "docs" / "planner.md").read_text()
    blocks = re.findall(r"```\n\$ python tools/estimate.py ([^\n]*)\n(.*?)```", doc, re.S)
    assert len(blocks) >= 2
    for argv, pasted in blocks:
        assert _tool().main(shlex.split(argv)) == 0
        assert capsys.readouterr().out == pasted, f"docs/planner.md is stale for: {argv}"


def test_start_up_peak_closed_form() -> None:
    """Stage 3: built in full a rank holds the whole model, its shards so far and the unit being
    sharded; from the
    meta device its final params and grads plus the largest unit (Ψ/10 when only a count is
    given). Stages 0-2 hold every parameter either way."""
    psi, n = 10**8, 8
    e3 = estimate_memory(psi, n, 3)
    unit = 4 * psi // 10
    assert e3.startup_meta == e3.params + e3.grads + unit
    assert e3.startup_built == 4 * psi + unit + e3.params
    for stage in (0, 1, 2):
        e = estimate_memory(psi, n, stage)
        assert e.startup_built == e.startup_meta == e.params + e.grads


# --------------------------------------------------------------------------- whole-tensor ownership

OWNED_CAP_MB = 300 * 4 / MiB
"""300 fp32 elements: MatrixNet (788 parameters) in four buckets, two of them with two matrices."""
OWNED_OPTIONS = {"bucket_cap_mb": OWNED_CAP_MB, "min_unit_params": 100}
"""Four buckets (stages 1-2) and four units (stage 3): owners balanced across layouts."""
OWNED_CASES: dict[int, dict[str, tuple[str, int, dict[str, Any]]]] = {
    2: {
        **{f"{opt} stage{s}": (opt, s, OWNED_OPTIONS) for opt in ("muon", "lamb") for s in (1, 2, 3)},
        **{f"muon stage{s} aligned": ("muon", s, {**OWNED_OPTIONS, "align_for_bandwidth": True}) for s in (1, 2, 3)},
    },
    4: {
        **{f"{opt} stage{s}": (opt, s, OWNED_OPTIONS) for opt in ("muon", "lamb") for s in (1, 2, 3)},
        **{
            f"{opt} stage{s} hybrid": (opt, s, {**OWNED_OPTIONS, "shard_group_size": 2})
            for opt in ("muon", "lamb")
            for s in (1, 2, 3)
        },
    },
}
"""Per world size: (optimizers, stage, wrap options). ``muon``: torch's Muon over the matrices
(owned whole) and SGD with momentum over the rest (slices), both 4 bytes of state per element
(momentum_buffer); ``lamb``: the tests' LAMB over everything (every tensor owned whole), 8 bytes
per element plus a 0-dim ``step`` per tensor."""
OWNED_K = {"muon": 4, "lamb": 8}


def _matrix_net() -> nn.Module:
    from tests.test_whole_tensor_optimizers import MatrixNet

    torch.manual_seed(0)
    return MatrixNet()


def _owned_optimizers(model: shardpar.ShardedModule, recipe: str) -> tuple[list[Any], list[str]]:
    """The recipe's shardpar optimizers over ``model``, and the parameters they own whole."""
    from tests.support.whole_tensor_optimizers import Lamb

    params = dict(model.named_parameters())
    if recipe == "lamb":
        return [shardpar.optimizer(model, Lamb, list(params.values()), lr=0.01)], list(params)
    matrices = [name for name, param in params.items() if param.ndim == 2]
    vectors = [param for name, param in params.items() if name not in matrices]
    return [
        shardpar.optimizer(model, torch.optim.Muon, [params[name] for name in matrices], lr=0.02),
        shardpar.optimizer(model, torch.optim.SGD, vectors, lr=0.01, momentum=0.9),
    ], matrices


def _measure_owned(cases: dict[str, tuple[str, int, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """On every rank: wrap MatrixNet, build the case's optimizers, reset the comm stats (moving
    the buckets to their owned layout, kind "rebuild", is a one-off of construction), then two
    steps: bytes sent by each step; memory after each (the same) and the bytes of 0-dim state
    tensors (LAMB's ``step``), which the planner leaves out."""
    results = {}
    for case, (recipe, stage, options) in cases.items():
        model = shardpar.wrap(_matrix_net(), stage=stage, **options)
        optimizers, _ = _owned_optimizers(model, recipe)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(C.get_rank()))
        comm, memory = [], []
        for _ in range(2):
            model.reset_comm_stats()
            model(x).square().mean().backward()
            for opt in optimizers:
                opt.step()
            comm.append(model.comm_stats())
            memory.append(model.memory_stats())
            for opt in optimizers:
                opt.zero_grad()
        scalars = sum(
            value.nbytes
            for opt in optimizers
            for state in opt.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor) and value.dim() == 0
        )
        model.engine.close()
        held = [{k: v for k, v in m.items() if k in ("params", "grads", "optimizer_state")} for m in memory]
        assert held[0] == held[1], (case, held)  # nothing grows from the second step on
        results[case] = {"memory": memory[0], "comm": comm, "scalar_bytes": scalars}
    return results


@functools.cache
def measured_owned(world_size: int) -> list[dict[str, dict[str, Any]]]:
    """Every rank's measurements for the world size's cases (one harness call for all)."""
    return run_ranks(_measure_owned, world_size, OWNED_CASES[world_size], timeout=180)


def _without_control(snapshot: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """A comm snapshot less the first step's agreements between ranks (kind ``control``)."""
    snapshot = dict(snapshot)
    control = snapshot.pop("control", None)
    if control is not None:
        snapshot["total"] = {key: value - control[key] for key, value in snapshot["total"].items()}
    return snapshot


def _assert_same_snapshot(measured: dict[str, dict[str, float]], expected: dict[str, dict[str, float]]) -> None:
    """Every kind's calls, payload and padding equal (bytes sent are those times (N-1)/N)."""
    assert measured.keys() == expected.keys()
    for op, stats in expected.items():
        assert measured[op] == pytest.approx(stats, rel=1e-12), op


@pytest.mark.parametrize("world_size, case", [(world, case) for world, cases in OWNED_CASES.items() for case in cases])
def test_owned_tensors_memory_and_bytes_equal_the_engines(world_size: int, case: str) -> None:
    """Tensors owned whole ([Note: planned ownership] in shardpar/planner/shapes.py): given the
    names ``shardpar.optimizer`` owns, the planner lays MatrixNet out as the engine does after
    owning them, so params and grads (the padding of the grown slices included) equal
    ``memory_stats()`` to the byte on every rank, the optimizer state (less LAMB's 0-dim
    ``step``) equals the heaviest rank's, k bytes per element it updates (its slice pieces and
    the tensors it owns), and every collective of a step, payload and padding, equals
    ``comm_stats()`` to the byte on every rank. Under hybrid sharding the replica all-reduce of
    each rank's slice is compared as the mean over its shard group (slices hold different shares
    of the padding). Both steps' memory is the estimate's (two optimizers' zero_grads together
    clear every bucket: no stage-1 carry) and both steps' collectives too (each optimizer's
    step gathers its own buckets: the matrices' are apart from the rest's at stages 1-2).
    Owning costs padding: the payload is that without ``whole_tensors``; at stages 1-2 the
    calls may be more (a bucket holding both kinds is cut in two)."""
    recipe, stage, options = OWNED_CASES[world_size][case]
    module = _matrix_net()
    whole = (
        [name for name, _ in module.named_parameters()]
        if recipe == "lamb"
        else [name for name, param in module.named_parameters() if param.ndim == 2]
    )
    planned = {
        k: options[k]
        for k in ("bucket_cap_mb", "min_unit_params", "align_for_bandwidth", "shard_group_size")
        if k in options
    }
    k = OWNED_K[recipe]
    estimate = estimate_memory(
        module, world_size, stage, optimizer="muon" if k == 4 else "adamw", whole_tensors=whole, **planned
    )
    comm = estimate_communication(module, world_size, stage, whole_tensors=whole, **planned)
    ranks = [rank[case] for rank in measured_owned(world_size)]
    for rank, result in enumerate(ranks):
        memory = result["memory"]
        assert (memory["params"], memory["grads"]) == (estimate.params, estimate.grads), f"rank {rank}"
    state = [result["memory"]["optimizer_state"] - result["scalar_bytes"] for result in ranks]
    assert max(state) == estimate.optimizer_state
    psi = sum(p.numel() for p in module.parameters())
    assert sum(state) == k * psi * (world_size // estimate.shard_group_size)  # each tensor's state once per replica
    hybrid = "shard_group_size" in options
    for rank, result in enumerate(ranks):
        for step, snapshot in enumerate(result["comm"]):
            assert ("control" in snapshot) == (step == 0) and "rebuild" not in snapshot, (rank, step)
            if not hybrid:
                expected = merge_snapshots(list(comm.by_group.values()))
                _assert_same_snapshot(_without_control(snapshot), expected)
                continue
            for group in ("shard_group", "all_ranks"):
                expected = comm.by_group[group]
                _assert_same_snapshot(_without_control(snapshot["by_group"][group]), expected)
    if hybrid:
        replicas = comm.by_group["replica_group"]["all_reduce"]
        for step in range(2):
            for shard_group in ([0, 1], [2, 3]):
                measured = [
                    _without_control(ranks[r]["comm"][step]["by_group"]["replica_group"])["all_reduce"]
                    for r in shard_group
                ]
                for key, value in replicas.items():
                    assert sum(m[key] for m in measured) / 2 == pytest.approx(value, rel=1e-12), (step, key)
    unowned = estimate_communication(module, world_size, stage, **planned)
    assert comm.sent_bytes == unowned.sent_bytes  # the same payload
    assert comm.padding_sent_bytes > unowned.padding_sent_bytes
    # a unit's group mixes both kinds (stage 3); a bucket holding both is cut in two (stages 1-2)
    assert comm.calls == unowned.calls if stage == 3 else comm.calls >= unowned.calls


class ThreeMatrices(nn.Module):
    """Three 16x16 weights: one bucket (stages 1-2) and one unit (stage 3) of 768 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(3))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_owned_matrices_closed_form(stage: int) -> None:
    """Three equal matrices owned whole on 2 ranks: one rank owns two, so its slice holds at
    least 512 elements and the heaviest rank holds 4·512 bytes of Muon state (not 4·768/2); the
    bucket is 2S elements, 2S - 768 of them padding, which params, grads and every collective
    over the bucket carry; the payload is unchanged."""
    model = ThreeMatrices()
    names = [name for name, _ in model.named_parameters()]
    owned = estimate_memory(model, 2, stage, optimizer="muon", whole_tensors=names)
    plain = estimate_memory(model, 2, stage, optimizer="muon")
    assert (owned.optimizer_state, plain.optimizer_state) == (4 * 512, 4 * 768 // 2)
    bucket = owned.params // 4 * (2 if stage == 3 else 1)  # 2S: params hold the bucket (stage 3: a slice)
    assert bucket >= 2 * 512 and bucket % 2 == 0
    comm = estimate_communication(model, 2, stage, whole_tensors=names)
    padding = {"reduce_scatter": 4 * (bucket - 768) / 2, "all_gather": 4 * (bucket - 768) / 2}
    if stage == 3:  # the root's unit: gathered once (kept into backward), with a tag per rank
        padding["all_gather"] += 2 * 16 / 2
    assert comm.padding_as_dict() == pytest.approx(padding)
    assert comm.as_dict() == estimate_communication(model, 2, stage).as_dict()


def test_whole_tensors_ignored_at_stage_0_and_for_a_count_checked_and_passed_to_the_stage_choice() -> None:
    model = ThreeMatrices()
    names = [name for name, _ in model.named_parameters()]
    assert estimate_memory(model, 2, 0, whole_tensors=names) == estimate_memory(model, 2, 0)
    assert estimate_communication(model, 2, 0, whole_tensors=names) == estimate_communication(model, 2, 0)
    assert estimate_memory(768, 2, 1, whole_tensors=["w"]) == estimate_memory(768, 2, 1)
    # Owned, stage 1 holds 2 slices of S = 518 (params 4·1036, grads as many, state 4·512 =
    # 10,336 bytes): a byte under stage 0's 9,216 only stage 1 unowned fits, owned none does.
    assert shardpar.planner.choose_plan(model, 2, 9215, node_size=2, optimizer="muon").stage == 1
    assert choose_stage(model, 2, 9215, optimizer="muon") == 1
    assert estimate_memory(model, 2, 1, optimizer="muon", whole_tensors=names).total == 10_336
    with pytest.raises(ValueError, match="no stage fits"):
        shardpar.planner.choose_plan(model, 2, 9215, node_size=2, optimizer="muon", whole_tensors=names)
    with pytest.raises(ValueError, match="no stage fits"):
        choose_stage(model, 2, 9215, optimizer="muon", whole_tensors=names)
    # A frozen parameter is no optimizer's: named or not, the estimate is the same.
    model.layers[0].weight.requires_grad_(False)
    assert estimate_memory(model, 2, 1, whole_tensors=names) == estimate_memory(model, 2, 1, whole_tensors=names[1:])
    with pytest.raises(ValueError, match="whole_tensors names no parameter of the module: layers.9.weight"):
        estimate_memory(model, 2, 1, whole_tensors=["layers.9.weight"])
    with pytest.raises(ValueError, match="collection of parameter names"):
        estimate_communication(model, 2, 1, whole_tensors="layers.1.weight")
