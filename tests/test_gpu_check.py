"""tools/gpu_check.py on a machine without a GPU: what can be checked of it here.

- ``--dry-run`` lists every command it would run, with its timeout, within the 10-minute
  budget, and runs nothing;
- its three pytest commands split ``pytest -m cuda tests/test_cuda.py`` between them: each
  selects some tests, no test twice, none left out (so a test added to test_cuda.py is run);
- without a GPU it exits 2 with one line saying so (the GPUs are hidden from it, so this also
  holds on a GPU machine);
- its report is rendered from real artifacts made here on the CPU (a JUnit XML of the CPU
  twins of the GPU tests, with their ``record_property`` figures, and a bench.py JSON summary),
  and written between the markers of an existing page, keeping the rest of it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.harness import run_script

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import gpu_check  # noqa: E402  (tools/ is not a package)

GPU_CHECK = [sys.executable, str(ROOT / "tools" / "gpu_check.py")]


def test_dry_run_lists_every_command_and_runs_nothing(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    result = run_script([*GPU_CHECK, "--dry-run", "--gpus", "2", "--out", str(out)], timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 5, lines
    assert sum("-m pytest -q -p no:cacheprovider -m cuda tests/test_cuda.py" in line for line in lines) == 3
    assert sum("tools/bench.py --device cuda" in line for line in lines) == 2
    assert "torch.distributed.run --standalone --nproc_per_node 2 tools/bench.py" in lines[-1]
    timeouts = [int(line.rsplit("timeout ", 1)[1].split()[0]) for line in lines]
    assert sum(timeouts) <= 600, timeouts
    assert not out.exists() and not list(tmp_path.iterdir())
    one_gpu = run_script([*GPU_CHECK, "--dry-run", "--gpus", "1"], timeout=120, cwd=ROOT)
    assert one_gpu.returncode == 0 and "nproc_per_node" not in one_gpu.stdout.split("#", 1)[0]


def _collected(args: list[str]) -> set[str]:
    result = run_script([sys.executable, "-m", "pytest", "--collect-only", "-q", *args], timeout=120, cwd=ROOT)
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: nothing collected
    return {line for line in result.stdout.splitlines() if "::" in line}


def test_the_pytest_commands_split_the_cuda_tests_between_them(tmp_path: Path) -> None:
    checks = [c for c in gpu_check.plan(tmp_path / "gpu.md", tmp_path, gpus=1) if "pytest" in c.command]
    assert len(checks) == 3
    everything = _collected(["-p", "no:cacheprovider", "-m", "cuda", "tests/test_cuda.py"])
    assert len(everything) > 20, everything
    parts = []
    for check in checks:
        args = check.command[check.command.index("pytest") + 1 :]
        parts.append(_collected([a for a in args if a != "-q" and not a.startswith("--junitxml")]))
        assert parts[-1], f"{check.title}: selects no test"
    assert sum(len(p) for p in parts) == len(set().union(*parts)), "a test is run twice"
    assert set().union(*parts) == everything, f"left out: {everything - set().union(*parts)}"
    assert all("never_syncs" in t for t in parts[1]) and all("peak_memory" in t for t in parts[2])


def test_without_a_gpu_it_exits_with_one_line(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    result = run_script([*GPU_CHECK, "--out", str(out)], timeout=120, cwd=ROOT)  # run_script hides the GPUs
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); run it on a GPU machine, "
        "or with --dry-run to list its commands"
    ]
    assert not out.exists()


@pytest.fixture(scope="module")
def cpu_artifacts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A JUnit XML of two CPU twins of the GPU tests and a bench.py JSON summary, made here."""
    tmp = tmp_path_factory.mktemp("artifacts")
    twins = [f"tests/test_cuda.py::test_fp32_at_world_size_1_matches_plain_torch[cpu-gloo-stage{s}]" for s in (0, 3)]
    tests = run_script(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *twins, f"--junitxml={tmp / 'tests.xml'}"],
        timeout=240,
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert tests.returncode == 0, tests.stdout[-3000:]
    bench = run_script(
        [
            sys.executable,
            "tools/bench.py",
            "--models",
            "mlp:tiny",
            "--configs",
            "stage0,stage3,torch",
            "--warmup",
            "1",
            "--rounds",
            "1",
            "--steps-per-round",
            "2",
            "--comm-reps",
            "1",
            "--out",
            str(tmp / "bench.md"),
            "--json",
            str(tmp / "bench.json"),
        ],
        timeout=240,
        cwd=ROOT,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert bench.returncode == 0, bench.stderr[-3000:]
    return tmp / "tests.xml", tmp / "bench.json"


ENV = {
    "device": "NVIDIA Example (1 visible)",
    "torch": "2.x",
    "cuda": "12.x",
    "nccl": "2.x",
    "python": "3.x",
    "commit": "abc1234",
}
"""The machine description is the only made-up input: there is no GPU here to describe."""


def test_report_from_real_artifacts_replaces_only_the_results(tmp_path: Path, cpu_artifacts: tuple[Path, Path]) -> None:
    xml, bench_json = cpu_artifacts
    checks = {c.key: c for c in gpu_check.plan(tmp_path / "gpu.md", tmp_path, gpus=1)}
    tests = gpu_check.Outcome(checks["tests"], 0, 12.0, figures=gpu_check.read_junit(xml))
    assert [t.outcome for t in tests.figures] == ["passed", "passed"]
    errors = [float(t.properties["max_rel_error"]) for t in tests.figures]
    assert all(0 <= e <= 1e-5 for e in errors), errors
    bench = gpu_check.Outcome(checks["bench1"], 0, 30.0, figures=json.loads(bench_json.read_text()))
    crashed = gpu_check.Outcome(checks["memory"], None, 70.0, output="line 1\nKilled at the timeout")
    text = gpu_check.render([tests, bench, crashed], ENV, "python tools/gpu_check.py", 112.0)

    assert "| GPU tests: parity and checkpoints (pytest -m cuda) | passed | 12 |" in text
    assert "| Peak memory of a step against the planner | **timed out** | 70 |" in text
    assert "2 passed" in text and "max_rel_error = " in text
    for check in (tests, bench, crashed):
        assert f"```\n{check.check.shell}\n```" in text  # each figure under the command that made it
    assert "| stage3 |" in text and "× torch" in text and "gpu-bench-world1.md" in text
    assert "It wrote no figures" in text and "Killed at the timeout" in text

    page = tmp_path / "gpu.md"
    page.write_text(f"# GPU\n\nhand-written\n\n{gpu_check.RESULTS_BEGIN}\npending\n{gpu_check.RESULTS_END}\n\nafter\n")
    gpu_check.write_report(page, text)
    written = page.read_text()
    assert written.startswith("# GPU\n\nhand-written\n\n") and written.endswith(f"{gpu_check.RESULTS_END}\n\nafter\n")
    assert "pending" not in written and text in written


def test_memory_and_sync_rows() -> None:
    """How the two GPU-only figures read in the report (they cannot be produced here)."""
    memory = gpu_check.TestResult(
        "test_peak[0]",
        "passed",
        1.0,
        properties={"peak_bytes": str(150 * 2**20), "planned_bytes": str(148 * 2**20), "ratio": str(150 / 148)},
    )
    over = gpu_check.TestResult(
        "test_peak[2]",
        "failed",
        1.0,
        "AssertionError: stage 2 ...",
        {"peak_bytes": str(200 * 2**20), "planned_bytes": str(160 * 2**20), "ratio": "1.25"},
    )
    crashed = gpu_check.TestResult("test_peak[3]", "error", 1.0, "RuntimeError: CUDA out of memory")
    rows = gpu_check.memory_section(gpu_check.Outcome(None, 1, 3.0, figures=[memory, over, crashed]))  # type: ignore[arg-type]
    assert rows[2:] == [
        "| `test_peak[0]` | 150.0 | 148.0 | 1.014 | yes |",
        "| `test_peak[2]` | 200.0 | 160.0 | 1.250 | **no** |",
        "| `test_peak[3]` | — | — | — | error: RuntimeError: CUDA out of memory |",
    ]
    synced = gpu_check.TestResult(
        "test_sync[1-fp32]", "failed", 1.0, "AssertionError: stage 1: 2 host syncs", {"host_syncs": "2"}
    )
    rows = gpu_check.syncs_section(gpu_check.Outcome(None, 1, 3.0, figures=[synced]))  # type: ignore[arg-type]
    assert rows[2:] == ["| `test_sync[1-fp32]` | 2 | failed: AssertionError: stage 1: 2 host syncs |"]


def test_docs_gpu_md_has_the_results_markers() -> None:
    """A GPU run writes between them, keeping the page's explanation (docs/gpu.md)."""
    text = (ROOT / "docs" / "gpu.md").read_text()
    assert text.count(gpu_check.RESULTS_BEGIN) == 1 and text.count(gpu_check.RESULTS_END) == 1
    assert text.index(gpu_check.RESULTS_BEGIN) < text.index(gpu_check.RESULTS_END)
