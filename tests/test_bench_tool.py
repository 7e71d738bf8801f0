"""tools/bench.py end to end at a tiny size under torchrun (as ``python -m torch.distributed.run``,
which is what the ``torchrun`` script runs): it runs every configuration and
writes its report. A smoke test only: no timing is asserted (timings are the report's job,
and they are noise on a shared 2-core machine), only what holds whatever the machine does:
exposed waits are where the stage has collectives to wait for, and hidden is in [0, 1]; the
host's main-thread CPU is part of the process's; the count of shardpar's Python calls is the
one an independent profile function makes of the same step."""

from __future__ import annotations

import json
import os
import re
import sys
from argparse import Namespace
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.harness import run_ranks, run_script

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ["stage0", "stage1", "stage2", "stage3", "ddp", "ddp+zero", "fsdp2"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str]:
    out = tmp_path_factory.mktemp("bench")
    (out / "bench.md").write_text(
        "old table\n<!-- everything below this line is written by hand; "
        "tools/bench.py keeps it -->\nhand-written analysis\n"
    )
    options = ["--models", "mlp:tiny,gpt:tiny", "--steps-per-round", "2", "--png", str(out / "bench.png")]
    for option in ("bucket_cap_mb=0.01", "prefetch_units=0", "align_for_bandwidth=True"):
        options += ["--candidate-option", option]
    log = _run_bench(2, out, "bench", options, timeout=240)
    return out, json.loads((out / "bench.json").read_text()), log


def _run_bench(ranks: int, out: Path, stem: str, options: list[str], timeout: int) -> str:
    """tools/bench.py at its quickest (one warm-up step, one round, one repetition of the
    isolated collectives) on ``ranks`` processes (1: plain python), writing ``out/stem.md``
    and ``out/stem.json``; ``options`` the test's own. Returns the log; fails on an error."""
    launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    quick = ["--warmup", "1", "--rounds", "1", "--comm-reps", "1"]
    files = ["--out", str(out / f"{stem}.md"), "--json", str(out / f"{stem}.json")]
    command = [sys.executable, *launcher, str(ROOT / "tools" / "bench.py"), *options, *quick, *files]
    result = run_script(command, timeout=timeout, env={"OMP_NUM_THREADS": "1"}, cwd=ROOT)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    return log


def test_report_has_every_configuration_and_keeps_the_hand_written_part(report) -> None:
    out, _, _ = report
    text = (out / "bench.md").read_text()
    assert "torchrun --standalone --nproc_per_node 2 tools/bench.py --models mlp:tiny,gpt:tiny" in text
    for model in ("mlp:tiny", "gpt:tiny"):
        assert f"## {model}" in text
    for config in CONFIGS:
        assert f"| {config} |" in text
    for stage in range(4):  # the A/B rows: same stages with the --candidate-option
        assert f"| stage{stage}-cand |" in text and f"× stage{stage}" in text
    assert "old table" not in text
    assert text.rstrip().endswith("hand-written analysis")
    assert "model name" not in text and "`nproc` =" in text
    assert "Bytes per group" not in text and "hybrid sharding" not in text  # only when a hybrid configuration ran


def test_bytes_and_model_state_match_the_closed_forms(report) -> None:
    _, data, _ = report
    for result in data["results"]:
        assert result["world"] == 2
        for config in CONFIGS:
            row = result["configs"][config]
            assert row["step_s"]["median"] > 0
            assert isinstance(row["minor_faults"], (int, float)) and row["minor_faults"] >= 0, config
            assert max(row["model_state"]) == pytest.approx(row["formula"], rel=0.10)
            if config.startswith("stage"):
                assert max(row["sent_bytes"]) == pytest.approx(row["closed_form_bytes"], rel=0.01)
                assert 0.0 <= row["hidden"] <= 1.0
        # Every stage, dense (gloo's default) and aligned for NCCL (the -cand rows: parameters at
        # multiples of 64 elements, buckets of lcm(2, 128)): payload and padding are the planner's.
        for stage in range(4):
            for config in (f"stage{stage}", f"stage{stage}-cand"):
                row = result["configs"][config]
                assert row["sent_bytes"] == [pytest.approx(row["closed_form_bytes"])] * 2, config
                assert row["padding_bytes"] == [pytest.approx(row["closed_form_padding_bytes"])] * 2, config
        losses = [row["final_loss"] for row in result["configs"].values()]
        assert max(losses) - min(losses) < 1e-3, "configurations did not train the same model"


def _tensors(model: str) -> int:
    sys.path.insert(0, str(ROOT / "tools"))
    from benchkit.models import parse_models

    return len(list(parse_models(model)[0].build().parameters()))


def _check_host_columns(result: dict[str, Any], text: str) -> None:
    """One model's host columns in the JSON summary and in the report's timing table: main-thread
    CPU within the process's, the shardpar call counts of every rank, and the table's cells
    showing them."""
    assert result["tensors"] == _tensors(result["model"]), result["model"]
    table = text.split(f"## {result['model']}", 1)[1].split("| config | forward", 1)[0]
    assert "| CPU ms/step (comm threads) | host ms/step | shardpar calls/step (per tensor) |" in table
    peers = [row for config, row in result["configs"].items() if not config.startswith("stage")]
    for config, row in result["configs"].items():
        assert 0 < row["host_s"] <= row["cpu_s"] + 5e-4, (config, row["host_s"], row["cpu_s"])
        calls = row["shardpar_calls"]
        assert len(calls) == result["world"] and all(isinstance(c, int) for c in calls), (config, calls)
        if config.startswith("stage"):
            # A wrapped step runs shardpar's hooks and step: calls on every rank, more than any peer's
            # (which reach shardpar only through its global optimizer pre-hook).
            assert min(calls) > 0 and all(min(calls) > max(peer["shardpar_calls"]) for peer in peers), (config, calls)
        cells = re.search(rf"^\| {re.escape(config)} \|.*\| ([\d.]+) \| ([\d,]+) \(([\d.]+)\) \|$", table, re.M)
        assert cells is not None, (config, table)
        assert float(cells[1]) == pytest.approx(row["host_s"] * 1e3, abs=0.051)
        assert int(cells[2].replace(",", "")) == max(calls)
        assert float(cells[3]) == pytest.approx(max(calls) / result["tensors"], abs=0.051)


def test_host_columns_are_reported_for_every_configuration(report) -> None:
    out, data, _ = report
    text = (out / "bench.md").read_text()
    assert "*host ms/step*" in text and "*shardpar calls/step*" in text
    for result in data["results"]:
        _check_host_columns(result, text)


def _count_a_step_both_ways(config: str) -> dict[str, int | None]:
    """On each rank: ``config`` on overhead:4, warmed up; then one step counted by the bench's
    ``count_calls`` and the next by a profile function of our own (every "call" event whose
    code lies in shardpar), and, for plain torch, the calls into torch itself."""
    import sys

    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "tools"))
    from benchkit.measure import count_calls, run_step
    from benchkit.models import parse_models
    from benchkit.runners import build_runner, shardpar_packages

    spec = parse_models("overhead:4")[0]
    torch.manual_seed(0)
    runner = build_runner(config, spec.build(), spec, Namespace(torch_device=torch.device("cpu"), wrap_options={}))
    batch = spec.batch_for(torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):  # the bench's own warm-up (stage 3's staging pool has served every bucket by then)
        run_step(runner, batch)
    packages = shardpar_packages()
    inside = tuple(f"{package}/" for package in packages)
    counted = count_calls(runner, batch, packages)
    by_hand = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal by_hand
        by_hand += event == "call" and str(Path(frame.f_code.co_filename).resolve()).startswith(inside)

    sys.setprofile(profile)
    try:
        runner.forward_backward(batch)
        runner.step()
        runner.zero_grad()
    finally:
        sys.setprofile(None)
    torch_calls = count_calls(runner, batch, [Path(torch.__file__).parent]) if config == "torch" else None
    runner.close()
    return {"counted": counted, "by_hand": by_hand, "torch_calls": torch_calls}


@pytest.mark.parametrize("config", ["stage0", "stage3", "torch"])
def test_shardpar_calls_are_what_a_profile_function_counts(config: str) -> None:
    """The calls column counts shardpar's Python calls exactly, at world size 2 where the
    issue's per-tensor figures are measured: a wrapped step's count on every rank equals a
    ``sys.setprofile`` count of the next step (the steps are alike after warm-up) and is at least
    one gradient hook per parameter tensor; plain torch's step reaches shardpar in fewer calls
    than it has tensors (only through shardpar's global optimizer pre-hook, if a stage 1-3
    engine was built in the process), while the same counter finds its calls into torch."""
    tensors = _tensors("overhead:4")
    for rank, counts in enumerate(run_ranks(_count_a_step_both_ways, 2, config, timeout=120)):
        assert counts["counted"] == counts["by_hand"], (rank, counts)
        if config == "torch":
            assert counts["counted"] < tensors and counts["torch_calls"] > tensors, (rank, counts)
        else:
            assert counts["counted"] >= tensors, (rank, counts)


PHASES = ("forward", "backward_gather", "backward", "step")


def test_exposed_communication_is_reported_for_every_stage(report) -> None:
    _, data, _ = report
    for result in data["results"]:
        for config, row in result["configs"].items():
            if not config.startswith("stage"):
                assert "exposed_s" not in row and "hidden" not in row, f"{config}: the peers' waits are not measured"
                continue
            stage = int(config.removesuffix("-cand")[-1])
            exposed = row["exposed_s"]
            assert set(exposed) == set(PHASES)
            assert all(seconds >= 0 for seconds in exposed.values()), (config, exposed)
            assert row["exposed_total_s"] >= 0
            assert row["exposed_total_s"] <= 1.01 * row["step_s"]["max"], f"{config}: waited longer than a step"
            assert exposed["backward"] > 0, f"{config}: every step waits for gradients"
            if stage < 3:  # stages 0-2 gather nothing in backward; stage 0 nothing at all
                assert exposed["backward_gather"] == 0.0
            if stage == 0:
                assert exposed["forward"] == 0.0 and row["gather_alone_s"] == 0.0
            else:
                assert row["gather_alone_s"] > 0
            assert row["grad_alone_s"] > 0
            assert row["comm_alone_s"] == pytest.approx(row["grad_alone_s"] + row["gather_alone_s"])
            assert 0.0 <= row["hidden"] <= 1.0
            expected = min(1.0, max(0.0, 1 - row["exposed_total_s"] / row["comm_alone_s"]))
            assert row["hidden"] == pytest.approx(expected)
        # stage3-cand runs with prefetch_units=0: every unit gather is waited for in forward
        # and in backward, so both phases waited, whatever the machine's speed.
        cand = result["configs"]["stage3-cand"]["exposed_s"]
        assert cand["forward"] > 0 and cand["backward_gather"] > 0, cand


def test_report_has_the_exposure_table_and_the_limits_section(report) -> None:
    out, data, _ = report
    text = (out / "bench.md").read_text().split("<!-- everything below", 1)[0]
    assert "| config | forward ms | backward gathers ms | backward reductions ms | step ms | exposed ms" in text
    for peer in ("ddp", "ddp+zero", "fsdp2"):
        assert f"| {peer} | — | — | — | — | — | — | — | — | — | — |" in text
    assert "their cells show —" in text
    section = text.split("## What limits the ratios on ", 1)[1]
    assert section.startswith(f"{data['machine']['nproc']} cores")
    for model in ("mlp:tiny", "gpt:tiny"):
        for stage in range(4):
            assert f"| {model} | stage{stage} |" in section
    for stage in range(4):
        assert f"- **stage{stage}**: waiting was " in section
    for leftover in ("{", "}", "nan", "None", "TODO"):
        assert leftover not in section, leftover


def test_step_profile_prints_each_figure_per_step() -> None:
    """tools/step_profile.py at world size 1 on the tiny model: every figure it promises,
    with the Python-call count and the reference-cycle count present and sane, and a timed
    function (``--time``) called once per parameter per step, as the reducer's count of each
    arrival at stage 3 is (the gradient hook asks it first)."""
    import subprocess

    timed = "core.reducer:GradientReducer.arrived_staged"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "step_profile.py"),
            "--model",
            "mlp:tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--calls",
            "--cycles",
            "--time",
            timed,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    figures = dict(line.strip().rsplit(": ", 1) for line in result.stdout.splitlines()[1:] if ": " in line)
    assert set(figures) == {
        "wall ms",
        "process CPU ms",
        "main-thread CPU ms",
        "main-thread CPU ms, forward",
        "main-thread CPU ms, backward",
        "main-thread CPU ms, step",
        "Python calls",
        "garbage collections (any generation)",
        "objects in reference cycles",
        f"{timed}: calls",
        f"{timed}: CPU ms",
        f"{timed}: page faults",
    }, figures
    assert "mlp:tiny stage 3, shardpar of" in result.stdout.splitlines()[0]
    assert float(figures["Python calls"]) > 100 and float(figures["objects in reference cycles"]) == 0.0
    sys.path.insert(0, str(ROOT / "tools"))
    from benchkit.models import parse_models

    params = len(list(parse_models("mlp:tiny")[0].build().parameters()))
    assert float(figures[f"{timed}: calls"]) == params, (figures, params)
    assert float(figures[f"{timed}: CPU ms"]) > 0 and float(figures[f"{timed}: page faults"]) >= 0


def test_plain_torch_is_every_stages_peer_at_world_size_1(tmp_path: Path) -> None:
    """``--configs ...,torch`` (the default at world size 1 with ``--device cuda``): each stage is
    compared with plain torch, no time target is claimed against it, and it trains the same
    model. Run here on the CPU, where the same code path picks the peer."""
    options = ["--models", "mlp:tiny,overhead:4", "--configs", "stage0,stage1,stage2,stage3,torch"]
    _run_bench(1, tmp_path, "b", options + ["--steps-per-round", "2"], timeout=180)
    results = json.loads((tmp_path / "b.json").read_text())["results"]
    text = (tmp_path / "b.md").read_text()
    for result in results:
        configs = result["configs"]
        assert [configs[f"stage{s}"]["peer"] for s in range(4)] == ["torch"] * 4
        assert configs["torch"]["model_state"] == [pytest.approx(configs["torch"]["formula"], rel=0.01)]
        for stage in range(4):
            assert abs(configs[f"stage{stage}"]["final_loss"] - configs["torch"]["final_loss"]) < 1e-3, stage
        _check_host_columns(result, text)
    assert [r["model"] for r in results] == ["mlp:tiny", "overhead:4"]
    assert results[1]["description"] == (
        "overhead stack, 4 blocks of two Linear(64, 64) and a LayerNorm, 26 parameter tensors, batch 2 rows/rank"
    )
    assert "× torch" in text and "target" not in text.split("## mlp:tiny", 1)[1].split("| config | forward")[0]
    assert "Plain torch (`torch`)" in text


def test_device_and_config_errors_are_one_line() -> None:
    """``--device cuda`` without a GPU (run_script hides them, so also on a GPU machine), and
    plain torch at world size 2, are refused before anything runs."""
    bench = [sys.executable, str(ROOT / "tools" / "bench.py"), "--models", "mlp:tiny"]
    no_gpu = run_script([*bench, "--device", "cuda"], timeout=120, cwd=ROOT)
    assert no_gpu.returncode != 0 and no_gpu.stderr.strip().splitlines() == [
        "error: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)"
    ], no_gpu.stderr
    plain_n = run_script([*bench, "--configs", "stage0,torch"], timeout=120, cwd=ROOT, env={"WORLD_SIZE": "2"})
    assert plain_n.returncode != 0 and "runs at world size 1 only" in plain_n.stderr, plain_n.stderr
    bad_g = run_script(
        [*bench, "--configs", "stage0-g2,stage3-g3,stage3-g2"], timeout=120, cwd=ROOT, env={"WORLD_SIZE": "4"}
    )
    assert bad_g.returncode != 0 and bad_g.stderr.strip().splitlines() == [
        "error: --configs: stage0-g2: stage 0 ignores shard_group_size (every rank holds everything); name stage1-3; "
        "stage3-g3: G = 3 must divide the world size 4 and lie strictly between 1 and it (G = 4 is full sharding, "
        "G = 1 shards nothing)"
    ], bad_g.stderr


def test_hybrid_sharding_at_world_size_4_bytes_per_group_equal_the_closed_forms(tmp_path: Path) -> None:
    """``--configs stage2-g2,stage3,stage3-g2,hsdp-g2`` at 4 ranks (2 replicas × shard groups of 2):
    every rank's bytes per group in the JSON summary equal the closed forms of docs/design.md
    (Ψ·4·(G-1)/G each for stage 2's reduce-scatter and gather within the group, 2(Ψ/G)·4·(R-1)/R
    across replicas) and the planner's ``by_group``, to the byte; the HSDP peer holds FSDP2's
    shards of G and trains the same model; the report has the hybrid and bytes-per-group tables."""
    options = ["--models", "mlp:tiny", "--configs", "stage2-g2,stage3,stage3-g2,hsdp-g2", "--steps-per-round", "1"]
    _run_bench(4, tmp_path, "b", options, timeout=240)
    configs = json.loads((tmp_path / "b.json").read_text())["results"][0]["configs"]
    import shardpar

    sys.path.insert(0, str(ROOT / "tools"))
    from benchkit.models import parse_models

    spec = parse_models("mlp:tiny")[0]
    psi = sum(p.numel() for p in spec.build().parameters())
    stage2 = configs["stage2-g2"]["by_group"]
    assert stage2["shard_group"]["sent_bytes"] == [2 * psi * 4 * (1 / 2)] * 4  # reduce-scatter + all-gather in G
    assert stage2["replica_group"]["sent_bytes"] == [2 * (psi / 2) * 4 * (1 / 2)] * 4  # the owned slice across R
    for config, stage in (("stage2-g2", 2), ("stage3-g2", 3)):
        row = configs[config]
        closed = shardpar.estimate_communication(
            spec.build(), 4, stage, shard_group_size=2, wrap_policy=[spec.unit_class] if stage == 3 else None
        ).by_group
        assert set(row["by_group"]) == set(closed) == {"shard_group", "replica_group", "all_ranks"}, config
        for group, measured in row["by_group"].items():
            expected = closed[group]["total"]
            assert row["closed_form_by_group"][group] == expected, (config, group)
            # Every rank to the byte, payload + padding (a replica slice holds its own share of the
            # padding); the payload's mean over the ranks exactly.
            sent = [s + p for s, p in zip(measured["sent_bytes"], measured["padding_sent_bytes"])]
            assert sent == [expected["sent_bytes"] + expected["padding_sent_bytes"]] * 4, (config, group, measured)
            assert sum(measured["sent_bytes"]) / 4 == expected["sent_bytes"], (config, group, measured)
        assert row["grad_alone_s"] > 0 and row["gather_alone_s"] > 0 and 0.0 <= row["hidden"] <= 1.0, config
        assert max(row["model_state"]) == pytest.approx(row["formula"], rel=0.01), config
    assert "by_group" not in configs["stage3"] and "closed_form_by_group" not in configs["stage3"]
    assert configs["stage3-g2"]["peer"] == "hsdp-g2" and "vs_full" in configs["stage3-g2"]
    assert "peer" not in configs["stage2-g2"], "stage 2 has no HSDP peer"
    hsdp = configs["hsdp-g2"]
    assert hsdp["formula"] == 16 * psi / 2 and max(hsdp["model_state"]) == pytest.approx(hsdp["formula"], rel=0.01)
    assert abs(hsdp["final_loss"] - configs["stage3-g2"]["final_loss"]) < 1e-3
    text = (tmp_path / "b.md").read_text()
    assert "### mlp:tiny: hybrid sharding" in text and "Bytes per group:" in text
    assert "| stage3-g2 | 2 × 2 |" in text and "| hsdp-g2 | 2 × 2 |" in text
    assert "| stage3-g2 | across replicas | 2 |" in text and "| stage3 | all ranks (full sharding) | 4 |" in text
    assert " ✗" not in text.split("Bytes per group:", 1)[1].split("Final loss", 1)[0]


def test_overhead_model_is_the_issues_shape() -> None:
    """``--models overhead`` is issue #44's model: 64 blocks of two Linear(64, 64) and a
    LayerNorm, 386 parameter tensors, batch 2; stage 3 and FSDP2 shard it by block."""
    sys.path.insert(0, str(ROOT / "tools"))
    from benchkit.models import OverheadBlock, parse_models

    [spec] = parse_models("overhead")
    assert spec.name == "overhead:64" and spec.unit_class is OverheadBlock
    model = spec.build()
    assert len(list(model.parameters())) == 386
    blocks = [m for m in model.modules() if isinstance(m, OverheadBlock)]
    assert len(blocks) == 64
    for block in blocks:
        kinds = [(type(m).__name__, tuple(p.shape for p in m.parameters())) for m in block.children()]
        assert sorted(kinds) == [
            ("LayerNorm", ((64,), (64,))),
            ("Linear", ((64, 64), (64,))),
            ("Linear", ((64, 64), (64,))),
        ], kinds
    inputs, targets = spec.batch_for(torch.Generator().manual_seed(0))
    assert inputs.shape == (2, 64) and targets.shape == (2,) and model(inputs).shape == (2, 64)


def _timed_row(median_s: float, peer: str | None = None, peer_s: float | None = None) -> dict[str, Any]:
    """A configuration's row as the benchmark's statistics make it, with only its times."""
    row: dict[str, Any] = {
        "step_s": {"median": median_s, "p25": median_s, "p75": median_s, "min": median_s, "max": median_s},
        "phase_s": {"fwd_bwd": median_s / 2, "opt": median_s / 2, "zero": 0.0},
        "cpu_s": median_s,
        "cpu_other_s": 0.0,
        "host_s": median_s,
        "model_state": [1.0],
        "formula": 1.0,
    }
    if peer is not None and peer_s is not None:
        row["peer"], row["vs_peer"] = peer, median_s / peer_s
    return row


def test_overhead_model_is_held_to_issue_44s_targets() -> None:
    """On the overhead model the report marks #44's targets (world 1: over plain torch's step,
    stage 0 even where DDP ran and is its peer; world 2: stage 0 over DDP's), not #16's; the
    other models keep #16's."""
    sys.path.insert(0, str(ROOT / "tools"))
    from benchkit.tables import host_share_target, targets_section, timing_table

    world1 = {
        "model": "overhead:4",
        "world": 1,
        "tensors": 26,
        "configs": {
            "stage0": _timed_row(0.0104, "ddp", 0.0110),  # 1.04x torch: met, though 0.95x ddp is #16's line
            "stage1": _timed_row(0.0111, "torch", 0.0100),  # 1.11x torch: missed
            "stage3": _timed_row(0.0125, "torch", 0.0100),  # 1.25x: met, at the limit
            "ddp": _timed_row(0.0110),
            "torch": _timed_row(0.0100),
        },
    }
    assert host_share_target(world1, "stage0") == (1.05, "torch", pytest.approx(1.04))
    assert host_share_target(world1, "stage2") is None  # did not run
    table = "\n".join(timing_table(world1))
    assert "| stage0 | 10.4 |" in table and "0.95× ddp (1.04× torch) ✓" in table, table
    assert "1.11× torch ✗ (target ≤ 1.10× torch)" in table and "1.25× torch ✓" in table, table
    assert "0.95)" not in table  # #16's stage-0 target is not this model's
    world2 = {
        "model": "overhead:4",
        "world": 2,
        "configs": {"stage0": _timed_row(0.0202, "ddp", 0.0200), "ddp": _timed_row(0.0200)},
    }
    rows = targets_section([world1, world2])
    assert "| overhead:4 | stage0 ≤ 1.05× torch (#44) | 1.04× | yes |" in rows, rows
    assert "| overhead:4 | stage1 ≤ 1.10× torch (#44) | 1.11× | **no** |" in rows, rows
    assert "| overhead:4 | stage0 ≤ 1.00× ddp (#44) | 1.01× | **no** |" in rows, rows
    assert not [line for line in rows if "0.95" in line], rows
    mlp = {**world2, "model": "mlp:tiny"}
    assert host_share_target(mlp, "stage0") is None
    assert "| mlp:tiny | stage0 ≤ 0.95× ddp | 1.01× | **no** |" in targets_section([mlp])


def test_muon_benchmark_holds_half_the_optimizer_state_in_the_distmuon_peer(tmp_path: Path) -> None:
    """Issue #43's launch at its quickest: ``--models nanochat:tiny --configs distmuon,stage0,ddp``
    at world size 2, every configuration with Muon over the blocks' matrices and AdamW over the
    embedding and head (stage 0: two ``shardpar.optimizer`` calls). All three train bit for bit
    the same model; stage 0 and DDP hold all of both optimizers' state on every rank (4 bytes an
    element of Muon's momentum, 8 of AdamW's moments, a 4-byte step per AdamW tensor), the peer
    at most half of it plus one matrix and AdamW's padding; the report's memory table has the
    optimizer-state column."""
    options = ["--models", "nanochat:tiny", "--configs", "distmuon,stage0,ddp", "--steps-per-round", "2"]
    _run_bench(2, tmp_path, "b", options, timeout=180)
    [result] = json.loads((tmp_path / "b.json").read_text())["results"]
    configs = result["configs"]
    sys.path.insert(0, str(ROOT / "tools"))
    from benchkit.models import parse_models

    model = parse_models("nanochat:tiny")[0].build()
    matrices = [p.numel() for p in model.muon_params()]
    adamw = [p.numel() for p in model.adamw_params()]
    whole = 4 * sum(matrices) + 8 * sum(adamw) + 4 * len(adamw)
    assert result["optimizers"] == "muon+adamw"
    assert configs["stage0"]["optimizer_state"] == configs["ddp"]["optimizer_state"] == [whole] * 2
    peer = configs["distmuon"]["optimizer_state"]
    assert max(peer) < max(configs["stage0"]["optimizer_state"]), (peer, whole)
    assert max(peer) <= (4 * sum(matrices) + 8 * sum(adamw)) / 2 + 4 * max(matrices) + 8 + 4, (peer, whole)
    assert configs["distmuon"]["final_loss"] == configs["stage0"]["final_loss"] == configs["ddp"]["final_loss"]
    for row in configs.values():
        assert max(row["model_state"]) == pytest.approx(row["formula"], rel=0.10)
    text = (tmp_path / "b.md").read_text()
    assert "| optimizer state MiB (max over ranks) |" in text
    for config in ("distmuon", "stage0", "ddp"):
        assert f"| {config} |" in text
    assert "`torch.optim.Muon`" in text and "- `distmuon`: a DistMuon-style peer" in text


def test_muon_models_refuse_the_adamw_only_peers() -> None:
    """ZeroRedundancyOptimizer and FSDP2 run AdamW only here, and the DistMuon peer Muon: a
    model and a configuration that do not train alike are refused before anything runs."""
    bench = [sys.executable, str(ROOT / "tools" / "bench.py")]
    refused = run_script(
        [*bench, "--models", "nanochat:tiny", "--configs", "stage0,ddp+zero,fsdp2"], timeout=120, cwd=ROOT
    )
    assert refused.returncode != 0 and refused.stderr.strip().splitlines() == [
        "error: --configs: nanochat:tiny: ddp+zero trains with AdamW only, not Muon + AdamW; name distmuon, ddp or "
        "the stages; nanochat:tiny: fsdp2 trains with AdamW only, not Muon + AdamW; name distmuon, ddp or the stages"
    ], refused.stderr
    peer = run_script([*bench, "--models", "mlp:tiny", "--configs", "distmuon"], timeout=120, cwd=ROOT)
    assert peer.returncode != 0 and "distmuon trains with Muon + AdamW" in peer.stderr, peer.stderr


def test_host_floor_measures_every_variant_and_refuses_one_that_changes_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tools/host_floor.py: every variant's gradients are checked against plain torch's before
    anything is timed, and each hook variant counts one call per parameter; a variant whose
    views are not zeroed first (so autograd adds onto stale values), or whose blocks are not
    filled from their shards when gathered, is refused, naming the parameter, rather than timed."""
    sys.path.insert(0, str(ROOT / "tools"))
    import host_floor

    host_floor.main(["--model", "overhead:4", "--rounds", "4", "--warmup", "1", "--json", str(tmp_path / "f.json")])
    figures = json.loads((tmp_path / "f.json").read_text())
    assert figures["tensors"] == _tensors("overhead:4") == 26
    assert list(figures["variants"]) == list(host_floor.VARIANTS)
    assert figures["variants"]["plain"]["over_plain_ms"] == 0.0
    assert figures["variants"]["plain"]["forward_backward_over_plain_ms"] == 0.0
    for row in figures["variants"].values():
        assert row["q1_ms"] <= row["median_ms"] <= row["q3_ms"], row
        assert row["forward_backward_ms"] > row["median_ms"], row  # the forward is in it too

    # The units variant's backward gathers each block again before its nodes read the
    # parameters: a gather that leaves other values than the shard's is refused.
    gather = host_floor.UnitGathers.gather

    def storage_back_not_filled(unit: host_floor.UnitGathers) -> None:
        gather(unit)
        unit.full.fill_(0.5)

    with monkeypatch.context() as patch:
        patch.setattr(host_floor.UnitGathers, "gather", storage_back_not_filled)
        with pytest.raises(SystemExit, match=r"variant units: the gradient of 'blocks\.0\.norm\.weight' differs"):
            host_floor.main(["--model", "overhead:4", "--rounds", "1", "--warmup", "0"])

    def stale_views(variant: host_floor.Variant) -> None:
        if "views" in variant.name:
            variant.buffer.fill_(1.0)  # not zeroed: every gradient lands on a stale 1.0
            for param, view in zip(variant.params, variant.views):
                param.grad = view

    monkeypatch.setattr(host_floor.Variant, "before_backward", stale_views)
    with pytest.raises(SystemExit, match=r"variant views: the gradient of 'blocks\.0\.norm\.weight' differs"):
        host_floor.main(["--model", "overhead:4", "--rounds", "1", "--warmup", "0"])


def test_host_floor_guarded_units_keep_the_guarantees_they_price() -> None:
    """tools/host_floor.py's guarded-units variant keeps what it stands for, not only its cost:
    between uses a block's parameter raises on an operation (its class) and past the class has
    no storage (a view of the freed buffer), every parameter that got a gradient is marked used, a block's
    gradients reach its gradient shard, and a gather whose tag is not the expected one stops."""
    sys.path.insert(0, str(ROOT / "tools"))
    import host_floor
    from benchkit.models import parse_models

    (spec,) = parse_models("overhead:4")
    variant = host_floor.Variant("guarded-units", spec.build(), spec.unit_class)
    loss = host_floor.make_loss(spec, variant.model, spec.batch_for(torch.Generator().manual_seed(0)))
    loss().backward()
    assert list(variant.used) == [1] * len(variant.params) == [1] * 26
    tags_only = host_floor.Variant("guarded-units", spec.build(), spec.unit_class, ("tags",))
    assert tags_only.units[0].tags and not tags_only.units[0].guards and not tags_only.units[0].reduce_scatter
    assert type(tags_only.units[0].params[0]) is nn.Parameter and not any(tags_only.used)
    unit = variant.units[0]
    weight = unit.params[0]
    with pytest.raises(RuntimeError, match="read a sharded parameter"):
        weight.sum()
    with torch._C.DisableTorchFunctionSubclass():  # past the class: no storage to read
        assert weight.untyped_storage().nbytes() == 0 and weight.numel() > 0  # its metadata stay
    assert weight.grad is None  # its gradient went to the flat buffer, and on into the gradient shard
    assert torch.equal(unit.grad_shard, unit.grad_flat) and unit.grad_flat.abs().sum() > 0

    unit.tag_sequence = torch.zeros(1, dtype=torch.int64)  # this rank's tag is not what the gather carries
    with pytest.raises(RuntimeError, match="ranks out of step"):
        loss()
