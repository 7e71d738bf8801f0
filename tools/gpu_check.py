"""Check shardpar on a GPU machine in one command, and write what it found as Markdown.

    python tools/gpu_check.py [--out docs/gpu.md]      # on a machine with one or more GPUs
    python tools/gpu_check.py --dry-run                # anywhere: the commands it would run

It runs, each in its own process under a timeout (at most 10 minutes in all on one GPU):

1. the GPU tests, ``pytest -m cuda tests/test_cuda.py`` (parity with plain torch over NCCL at
   world size 1 in fp32 and bf16, checkpoint round trips, and with 2 or more GPUs parity with
   DDP and FSDP2), apart from the two below;
2. the host-sync test: a steady-state step at every stage under
   ``torch.cuda.set_sync_debug_mode`` (syncs counted under "warn", then a step under "error");
3. the memory test: a steady step's peak ``torch.cuda.max_memory_allocated`` against
   ``shardpar.estimate_memory`` at every stage;
4. ``tools/bench.py --device cuda`` at world size 1 (the stages against plain torch), and with
   N >= 2 GPUs under torchrun at world size N (against DDP, ZeroRedundancyOptimizer, FSDP2).

The figures come from the tests themselves (``record_property`` in the JUnit XML each pytest
run writes) and from bench.py's JSON summary, so each figure in the report is given with the
exact command that produced it. The report replaces what lies between the two ``RESULTS_*``
markers of ``--out`` (docs/gpu.md keeps its hand-written part), or is the whole file when the
markers are absent; bench.py's full reports go next to it (``gpu-bench-world1.md``, ...).

Progress goes to stdout. Exit status: 0 when every check passed, 1 when one failed or timed
out (the report says which), 2 without a GPU (one line saying so) or on bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS_BEGIN = "<!-- gpu_check results: begin (written by tools/gpu_check.py) -->"
RESULTS_END = "<!-- gpu_check results: end -->"
BUDGET_S = 600
"""The whole run on one GPU; the checks' timeouts add up to at most this (see ``plan``)."""
MIB = 2**20
TEST_FILE = "tests/test_cuda.py"
SYNC_TESTS = "steady_state_step_never_syncs"
MEMORY_TESTS = "peak_memory_of_a_step"


@dataclass(frozen=True)
class Check:
    """One command of the run: what it is, how to run it, and where its figures land."""

    key: str
    title: str
    command: list[str]
    timeout_s: int
    artifact: Path
    """The JUnit XML (pytest) or JSON summary (bench.py) the figures are read from."""
    report: Path | None = None
    """bench.py's own Markdown report."""

    @property
    def shell(self) -> str:
        """The command as one would type it from the repository root."""
        return shlex.join(self.command).replace(shlex.quote(sys.executable), "python", 1)


@dataclass
class Outcome:
    check: Check
    returncode: int | None  # None: killed at the timeout
    seconds: float
    output: str = ""
    figures: Any = None

    @property
    def passed(self) -> bool:
        return self.returncode == 0


def plan(out: Path, work: Path, gpus: int) -> list[Check]:
    """The checks for a machine with ``gpus`` GPUs (world size N = gpus for the second
    benchmark, only with 2 or more)."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", TEST_FILE]
    bench_dir = out.parent

    def bench(world: int) -> list[str]:
        return [
            "tools/bench.py",
            "--device",
            "cuda",
            "--out",
            shown(bench_dir / f"gpu-bench-world{world}.md"),
            "--png",
            shown(bench_dir / f"gpu-bench-world{world}.png"),
            "--json",
            shown(work / f"bench-world{world}.json"),
        ]

    def junit(name: str) -> str:
        return f"--junitxml={shown(work / name)}"

    checks = [
        Check(
            "tests",
            "GPU tests: parity and checkpoints (pytest -m cuda)",
            [*pytest, "-k", f"not {SYNC_TESTS} and not {MEMORY_TESTS}", junit("tests.xml")],
            240,
            work / "tests.xml",
        ),
        Check(
            "syncs",
            "Host syncs in a steady-state step",
            [*pytest, "-k", SYNC_TESTS, junit("syncs.xml")],
            70,
            work / "syncs.xml",
        ),
        Check(
            "memory",
            "Peak memory of a step against the planner",
            [*pytest, "-k", MEMORY_TESTS, junit("memory.xml")],
            70,
            work / "memory.xml",
        ),
        Check(
            "bench1",
            "Benchmark on CUDA, world size 1 (against plain torch)",
            [sys.executable, *bench(1)],
            110,
            work / "bench-world1.json",
            bench_dir / "gpu-bench-world1.md",
        ),
    ]
    if gpus >= 2:
        checks.append(
            Check(
                f"bench{gpus}",
                f"Benchmark on CUDA/NCCL, world size {gpus} (against DDP, ZeRO, FSDP2)",
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node",
                    str(gpus),
                    *bench(gpus),
                ],
                110,
                work / f"bench-world{gpus}.json",
                bench_dir / f"gpu-bench-world{gpus}.md",
            )
        )
    assert sum(c.timeout_s for c in checks) <= BUDGET_S
    return checks


def shown(path: Path) -> str:
    """``path`` relative to the repository root (where the commands run) when it is inside it,
    so that a command in the report reads as one types it there."""
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


# --------------------------------------------------------------------------- running


def run(check: Check) -> Outcome:
    """Run one check in its own session; on timeout kill the whole group (torchrun's ranks too)."""
    start = time.monotonic()
    process = subprocess.Popen(
        check.command,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        output, _ = process.communicate(timeout=check.timeout_s)
        code: int | None = process.returncode
    except subprocess.TimeoutExpired:
        with_group_killed(process)
        output, _ = process.communicate()
        code = None
    return Outcome(check, code, time.monotonic() - start, output or "")


def with_group_killed(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------- reading figures


@dataclass
class TestResult:
    name: str
    outcome: str  # passed, failed, error, skipped
    seconds: float
    message: str = ""
    properties: dict[str, str] = field(default_factory=dict)


def read_junit(path: Path) -> list[TestResult]:
    """Every test case of a pytest ``--junitxml`` file, with its ``record_property`` figures."""
    results = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "failed" if tag == "failure" else tag
                message = next(iter((element.get("message") or element.text or "").strip().splitlines()), "")
                break
        properties = {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        results.append(TestResult(case.get("name", "?"), outcome, float(case.get("time") or 0), message, properties))
    return results


def read_figures(outcome: Outcome) -> Any:
    """The check's figures from its artifact, or None when it wrote none (it crashed early)."""
    path = outcome.check.artifact
    if not path.exists():
        return None
    if path.suffix == ".xml":
        return read_junit(path)
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- the report


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _number(value: str, fmt: str) -> str:
    try:
        return format(float(value), fmt)
    except ValueError:
        return value


def tests_section(outcome: Outcome) -> list[str]:
    tests: list[TestResult] = outcome.figures or []
    counts = {k: sum(t.outcome == k for t in tests) for k in ("passed", "failed", "error", "skipped")}
    lines = [
        ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no test ran",
        "",
        "| test | outcome | seconds | figures |",
        "|---|---|---:|---|",
    ]
    for test in tests:
        figures = ", ".join(f"{k} = {_number(v, '.3g')}" for k, v in test.properties.items())
        outcome_text = test.outcome + (f": {test.message}" if test.message else "")
        lines.append(f"| `{test.name}` | {_cell(outcome_text)} | {test.seconds:.1f} | {_cell(figures) or '—'} |")
    return lines


def memory_section(outcome: Outcome) -> list[str]:
    tests: list[TestResult] = outcome.figures or []
    lines = ["| test | measured peak MiB | planner MiB | measured / planner | within 10% |", "|---|---:|---:|---:|---|"]
    for test in tests:
        p = test.properties
        if "peak_bytes" not in p:
            lines.append(f"| `{test.name}` | — | — | — | {_cell(test.outcome + ': ' + test.message)} |")
            continue
        ratio = float(p["ratio"])
        lines.append(
            f"| `{test.name}` | {int(p['peak_bytes']) / MIB:.1f} | {int(p['planned_bytes']) / MIB:.1f} "
            f"| {ratio:.3f} | {'yes' if abs(ratio - 1) <= 0.10 else '**no**'} |"
        )
    return lines


def syncs_section(outcome: Outcome) -> list[str]:
    tests: list[TestResult] = outcome.figures or []
    lines = ['| test | host syncs under "warn" | outcome (the next step under "error") |', "|---|---:|---|"]
    for test in tests:
        syncs = test.properties.get("host_syncs", "—")
        lines.append(
            f"| `{test.name}` | {syncs} | {_cell(test.outcome + (': ' + test.message if test.message else ''))} |"
        )
    return lines


def bench_section(outcome: Outcome) -> list[str]:
    data = outcome.figures
    if not data:
        return []
    lines = []
    for result in data["results"]:
        lines += [
            f"**{result['model']}** ({result['description']}, Ψ = {result['params']:,}), world size {result['world']}:",
            "",
            "| config | median step ms | vs peer | peak CUDA allocated increase MiB (max over ranks) "
            "| model state / ZeRO formula |",
            "|---|---:|---|---:|---:|",
        ]
        for config, row in result["configs"].items():
            vs = f"{row['vs_peer']:.2f}× {row['peer']}" if "vs_peer" in row else "—"
            state = max(row["model_state"]) / row["formula"]
            lines.append(
                f"| {config} | {row['step_s']['median'] * 1e3:.2f} | {vs} | {max(row['rss_increase']) / MIB:.1f} "
                f"| {state:.3f} |"
            )
        lines.append("")
    if outcome.check.report is not None:
        lines.append(f"bench.py's full report: [{outcome.check.report.name}]({outcome.check.report.name}).")
    return lines


SECTIONS = {"tests": tests_section, "syncs": syncs_section, "memory": memory_section}


def environment() -> dict[str, str]:
    import torch

    props = torch.cuda.get_device_properties(0)
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else "?"
    commit = _git("rev-parse", "--short", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return {
        "device": f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible; compute capability "
        f"{props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB)",
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
        "python": platform.python_version(),
        "commit": (commit or "unknown") + (" with uncommitted changes" if dirty else ""),
    }


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def render(outcomes: list[Outcome], env: dict[str, str], command: str, seconds: float) -> str:
    """The results as Markdown: environment, one summary row per check, then each check's figures."""
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    lines = [
        f"Generated by `{command}` on {date}, in {seconds:.0f} s.",
        "",
        f"- Device: {env['device']}",
        f"- torch {env['torch']}, CUDA {env['cuda']}, NCCL {env['nccl']}, Python {env['python']}",
        f"- shardpar at commit {env['commit']}",
        "",
        "| check | result | seconds |",
        "|---|---|---:|",
    ]
    for o in outcomes:
        result = (
            "passed" if o.passed else ("**timed out**" if o.returncode is None else f"**failed** (exit {o.returncode})")
        )
        lines.append(f"| {o.check.title} | {result} | {o.seconds:.0f} |")
    for o in outcomes:
        lines += ["", f"### {o.check.title}", "", "```", o.check.shell, "```", ""]
        if o.figures is None:
            lines += [
                "It wrote no figures. The end of its output:",
                "",
                "```",
                *o.output.strip().splitlines()[-30:],
                "```",
            ]
            continue
        section = SECTIONS.get(o.check.key, bench_section)(o)
        lines += section
        if not o.passed and o.check.key.startswith("bench"):
            lines += ["", "```", *o.output.strip().splitlines()[-30:], "```"]
    return "\n".join(lines) + "\n"


def write_report(path: Path, body: str) -> None:
    """Put ``body`` between the markers of ``path`` (its other text kept), or make ``path``
    the markers and ``body`` alone when it has none."""
    block = f"{RESULTS_BEGIN}\n{body}{RESULTS_END}"
    text = path.read_text() if path.exists() else ""
    if RESULTS_BEGIN in text and RESULTS_END in text.split(RESULTS_BEGIN, 1)[1]:
        head, rest = text.split(RESULTS_BEGIN, 1)
        tail = rest.split(RESULTS_END, 1)[1]
        text = head + block + tail
    else:
        text = f"# shardpar on a GPU: tools/gpu_check.py\n\n{block}\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "docs" / "gpu.md",
        help="the Markdown report (its text outside the results markers is kept)",
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="JUnit XML and JSON files (default: a temporary one)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands and their timeouts, run nothing")
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs to plan for (default: torch.cuda.device_count()); a world-size-N benchmark runs with N >= 2",
    )
    args = parser.parse_args(argv)
    if args.gpus is not None and args.gpus < 0:
        parser.error("--gpus must be 0 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    gpus = args.gpus if args.gpus is not None else (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    work = args.work_dir or Path(tempfile.gettempdir()) / f"gpu_check-{os.getpid()}"  # made only for a real run
    out = args.out if args.out.is_absolute() else Path.cwd() / args.out
    checks = plan(out, work, gpus)
    if args.dry_run:
        for check in checks:
            print(f"{check.shell}    # {check.title}; timeout {check.timeout_s} s")
        if gpus < 2:
            print(
                f"# with 2 or more GPUs also: torchrun at world size N of tools/bench.py --device cuda ({gpus} planned for)"
            )
        return 0
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); run it on a GPU machine, "
            "or with --dry-run to list its commands",
            file=sys.stderr,
        )
        return 2
    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    env = environment()
    print(
        f"[gpu_check] {env['device']}; torch {env['torch']}, CUDA {env['cuda']}; {len(checks)} checks, "
        f"at most {sum(c.timeout_s for c in checks)} s",
        flush=True,
    )
    outcomes = []
    for index, check in enumerate(checks, 1):
        print(f"[gpu_check] {index}/{len(checks)} {check.title}: {check.shell}", flush=True)
        outcome = run(check)
        outcome.figures = read_figures(outcome)
        outcomes.append(outcome)
        state = "passed" if outcome.passed else ("timed out" if outcome.returncode is None else "FAILED")
        last = outcome.output.strip().splitlines()[-1:] or [""]
        print(f"[gpu_check] {index}/{len(checks)} {state} in {outcome.seconds:.0f} s: {last[0]}", flush=True)
    command = shlex.join(["python", "tools/gpu_check.py", *(sys.argv[1:] if argv is None else argv)])
    write_report(out, render(outcomes, env, command, time.monotonic() - started))
    failed = [o.check.title for o in outcomes if not o.passed]
    print(
        f"[gpu_check] wrote {out}; " + (f"failed: {', '.join(failed)}" if failed else "every check passed"), flush=True
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
