"""recipes/train_gpt.py end to end, launched as a user launches it (``python`` for one process,
``python -m torch.distributed.run`` for two ranks): exit codes, what is printed and by which rank,
falling loss, kill-and-resume to the same parameters (with background saves and keep-last
rotation, against a run saving synchronously), resuming at another world size,
``--stage auto``, ``--optimizer muon`` (two optimizers: at stage 2 as at stage 0, a checkpoint
each, resumed at stage 3), the Hugging Face model, and one-line errors for bad input.

Every run imports torch and builds an optimizer (which imports torch._dynamo): seconds of CPU
before the first step. So the runs that the selected tests need are all started together by one
module fixture, in threads, and run in parallel; each test then waits for and checks its own.
Elastic restarts (torchrun --max-restarts) and rank failures are tests/test_faults.py's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import shardpar
from tests.support.harness import CPU_ONLY_ENV, run_script

ROOT = Path(__file__).resolve().parent.parent
RECIPE = str(ROOT / "recipes" / "train_gpt.py")
PYTHON = [sys.executable]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# Tiny model, short warmup so that a few steps visibly lower the loss, the loss reduced and shown
# every step, evaluation only at the end.
BASE = [
    "--model",
    "tiny",
    "--block-size",
    "32",
    "--batch-size",
    "16",
    "--warmup",
    "2",
    "--log-every",
    "1",
    "--eval-every",
    "0",
    "--eval-iters",
    "2",
]
K = 10
"""Steps between checkpoints in the resume runs (2K steps in all). The kill must land between
the first checkpoint and the end of the run, so those K steps are the window a poll has to hit."""
ENV = {"OMP_NUM_THREADS": "1", **CPU_ONLY_ENV}  # ranks share 2 cores (no oversubscription); CPU/gloo even with GPUs
TIMEOUT_S = 300.0  # per run; generous because all runs share a loaded machine

SUMMARY = re.compile(
    r"^done: (?P<steps>\d+) steps, world (?P<world>\d+), stage (?P<stage>\d) \| "
    r"train loss (?P<first>\S+) -> (?P<last>\S+) \| val loss (?P<val>\S+) \|",
    re.MULTILINE,
)
LOG_RECORD = re.compile(r"^\[rank(?P<rank>\d+)\] \S+ (?P<level>[A-Z]+) ", re.MULTILINE)
# tqdm's first render of a bar, before any step: no rate and no postfix yet. One per bar.
BAR_START = re.compile(r"train:[^\r\n]*\?it/s\]")


# --------------------------------------------------------------------------- the runs


def resumable(ckpt_dir: Path) -> list[str]:
    """The same flags for the uninterrupted run and for both attempts of the killed one."""
    return [
        "--steps",
        str(2 * K),
        "--save-every",
        str(K),
        "--ckpt-dir",
        str(ckpt_dir),
        "--resume",
        "latest",
        "--stage",
        "2",
    ]


ASYNC_ROTATING = ["--async-save", "--keep-last", "1"]
"""How the killed run saves: in the background, keeping the newest checkpoint only. Its
checkpoints must equal the uninterrupted run's, saved synchronously."""


def recipe(launcher: list[str], *args: str | Path, script: str = RECIPE) -> subprocess.CompletedProcess[str]:
    return run_script([*launcher, script, *map(str, args)], TIMEOUT_S, env=ENV, cwd=ROOT)


def run_ws2(tmp: Path) -> subprocess.CompletedProcess[str]:
    """Two ranks, stage 2, 2K steps with a checkpoint every K; the ckpt dir exists and is empty."""
    ckpt = tmp / "ws2-ckpt"
    ckpt.mkdir()
    return recipe(TORCHRUN, *BASE, *resumable(ckpt))


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants alive now (from /proc), parents first."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the name may hold spaces
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile
        children.setdefault(ppid, []).append(int(stat.parent.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a launcher and every rank it started, as a lost node would end them.

    torchrun starts each worker in a session of its own, so killing the launcher's process group
    leaves the ranks running (orphaned, still writing checkpoints): kill every process of the tree.
    """
    tree = process_tree(process.pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    deadline = time.monotonic() + 10.0
    while any(Path(f"/proc/{pid}").exists() and not _zombie(pid) for pid in tree[1:]):
        assert time.monotonic() < deadline, f"processes {tree[1:]} survived SIGKILL"
        time.sleep(0.01)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True  # gone


def run_killed_and_resumed(tmp: Path) -> dict[str, Any]:
    """The ws2 command, SIGKILLed (launcher and ranks) once its first checkpoint is complete,
    then started again with the same command."""
    ckpt = tmp / "killed-ckpt"
    args = [*TORCHRUN, RECIPE, *BASE, *resumable(ckpt), *ASYNC_ROTATING]
    log_path = tmp / "killed.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, **ENV},
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while (first := shardpar.latest_checkpoint(ckpt)) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"no checkpoint before the run ended (exit {process.returncode}):\n" + log_path.read_text()
                )
            time.sleep(0.01)
    finally:
        kill_tree(process)
    finished_anyway = (ckpt / f"step-{2 * K:08d}").exists()
    resumed = recipe(TORCHRUN, *BASE, *resumable(ckpt), *ASYNC_ROTATING)
    return {
        "ckpt": ckpt,
        "first": first,
        "finished_anyway": finished_anyway,
        "killed_log": log_path.read_text(),
        "resumed": resumed,
    }


def wait_for_first_checkpoint(ckpt: Path, runs: Runs, writer: str) -> None:
    """Until the run ``writer`` has completed its first checkpoint in ``ckpt``, or ended."""
    while shardpar.latest_checkpoint(ckpt) is None:
        if runs.futures[writer].done():
            break  # ended without a checkpoint: the resume after this reports it
        time.sleep(0.05)


def run_ws1_auto_from_ws2(tmp: Path, runs: Runs) -> subprocess.CompletedProcess[str]:
    """One process at the stage ``--stage auto`` picks (0: at world size 1 every stage needs the
    same memory, and the lowest wins), continuing the two-rank stage-2 run from its step-K
    checkpoint as soon as that is complete."""
    ckpt = tmp / "ws2-ckpt"
    wait_for_first_checkpoint(ckpt, runs, "ws2")
    return recipe(
        PYTHON,
        *BASE,
        "--steps",
        str(2 * K),
        "--stage",
        "auto",
        "--memory-budget",
        "2MB",
        "--resume",
        ckpt / f"step-{K:08d}",
    )


M = 4
"""Steps between the checkpoints of the ``--optimizer muon`` runs (2M steps in all)."""
MUON = ["--optimizer", "muon", "--steps", str(2 * M), "--clip", "0"]
"""Without clipping: the clip's global norm is summed in another order at stage 2 than at stage
0, which moves the losses' sixth digit (measured: 4e-6 after 8 steps); without it the runs agree
bit for bit, as the summary's digits show."""


def run_muon(stage: int) -> Callable[[Path], subprocess.CompletedProcess[str]]:
    """Two ranks, Muon + AdamW; at stage 2 with a checkpoint every M steps."""

    def run(tmp: Path) -> subprocess.CompletedProcess[str]:
        saving = ["--save-every", str(M), "--ckpt-dir", str(tmp / "muon-ckpt")] if stage == 2 else []
        return recipe(TORCHRUN, *BASE, *MUON, "--stage", str(stage), *saving)

    return run


def run_muon_stage3_from_stage2(tmp: Path, runs: Runs) -> subprocess.CompletedProcess[str]:
    """Two ranks at stage 3, continuing the stage-2 Muon run from its step-M checkpoints."""
    ckpt = tmp / "muon-ckpt"
    wait_for_first_checkpoint(ckpt, runs, "muon-stage2")
    return recipe(TORCHRUN, *BASE, *MUON, "--stage", "3", "--resume", ckpt / f"step-{M:08d}")


# A user's script around the recipe: it raises a warning and logs one on rank 1 only, once the
# recipe's logging is set up (build runs after it), then trains as train_gpt.py would.
RANK1_WARNING_DRIVER = """\
import logging, os, sys, warnings
sys.path.insert(0, {root!r})
from recipes import train_gpt, trainer

build = trainer.build

def build_and_warn(*args, **kwargs):
    if os.environ["RANK"] == "1":
        warnings.warn("python warning from rank 1")
        logging.getLogger("user").warning("logged warning from rank 1")
    return build(*args, **kwargs)

trainer.build = build_and_warn
train_gpt.main()
"""


def run_hf_llama(tmp: Path) -> subprocess.CompletedProcess[str]:
    """transformers' Llama (tied embeddings) at stage 3 on two ranks, through the warning driver."""
    driver = tmp / "train_gpt_rank1_warning.py"
    driver.write_text(RANK1_WARNING_DRIVER.format(root=str(ROOT)))
    return recipe(TORCHRUN, "--model", "hf-llama", *BASE[2:], "--steps", "6", "--stage", "3", script=str(driver))


def run_auto_too_small(tmp: Path) -> subprocess.CompletedProcess[str]:
    return recipe(PYTHON, *BASE, "--steps", "8", "--stage", "auto", "--memory-budget", "1KB")


def run_bad(*args: str) -> Callable[[Path], subprocess.CompletedProcess[str]]:
    def run(tmp: Path) -> subprocess.CompletedProcess[str]:
        (tmp / "empty").mkdir(exist_ok=True)
        return recipe(PYTHON, *BASE, *(a.format(tmp=tmp) for a in args))

    return run


BAD_INPUT = {
    "unknown-flag": (["--learning-rate", "1e-3"], "unrecognized arguments: --learning-rate"),
    "resume-no-checkpoint": (["--resume", "{tmp}/empty"], "no checkpoint"),
    "resume-latest-no-ckpt-dir": (["--resume", "latest"], "--resume latest needs --ckpt-dir"),
    "keep-last-without-saves": (["--keep-last", "2"], "--keep-last needs --save-every"),
    # run_script hides the GPUs (CPU_ONLY_ENV), so this holds on a GPU machine too.
    "device-cuda-without-gpu": (["--device", "cuda"], "--device cuda: no CUDA device is visible"),
}

SCENARIOS: dict[str, Callable[..., Any]] = {
    "ws2": run_ws2,
    "killed-and-resumed": run_killed_and_resumed,
    "ws1-auto-from-ws2": run_ws1_auto_from_ws2,
    "muon-stage0": run_muon(0),
    "muon-stage2": run_muon(2),
    "muon-stage3-from-stage2": run_muon_stage3_from_stage2,
    "hf-llama": run_hf_llama,
    "auto-too-small": run_auto_too_small,
    **{f"bad-{name}": run_bad(*args) for name, (args, _) in BAD_INPUT.items()},
}
RESUMES = {"ws1-auto-from-ws2": "ws2", "muon-stage3-from-stage2": "muon-stage2"}
"""The scenarios that resume another's checkpoint, and that other: started first, and handed
the runs to wait on it."""


class Runs:
    """The scenarios' outcomes, each computed once in its own thread."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.pool = ThreadPoolExecutor(max_workers=len(SCENARIOS), thread_name_prefix="recipe-run")
        self.futures: dict[str, Future] = {}

    def start(self, name: str) -> None:
        if name not in self.futures:
            fn = SCENARIOS[name]
            if name in RESUMES:
                self.start(RESUMES[name])
            extra = (self,) if name in RESUMES else ()
            self.futures[name] = self.pool.submit(fn, self.tmp, *extra)

    def get(self, name: str) -> Any:
        self.start(name)
        return self.futures[name].result()


def uses(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Name the scenarios a test reads, so the fixture starts them before the first test waits."""

    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        fn.recipe_runs = names  # type: ignore[attr-defined]
        return fn

    return mark


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    runs = Runs(tmp_path_factory.mktemp("recipe"))
    module = sys.modules[__name__]
    for item in request.session.items:
        if getattr(item, "module", None) is module:
            for name in getattr(item.function, "recipe_runs", ()):
                runs.start(name)
    yield runs
    runs.pool.shutdown(wait=True)  # each run ends by itself or at its timeout, group killed


# --------------------------------------------------------------------------- checks


def output(result: subprocess.CompletedProcess[str]) -> str:
    return (
        f"$ {' '.join(map(str, result.args))}\nexit {result.returncode}\n--- stdout ---\n{result.stdout}\n"
        f"--- stderr ---\n{result.stderr}"
    )


def trained(result: subprocess.CompletedProcess[str], world: int, stage: int | None = None) -> dict[str, float]:
    """Exit 0, exactly one summary line for the expected world size (and stage), a falling loss;
    returns the summary's numbers."""
    assert result.returncode == 0, output(result)
    combined = result.stdout + result.stderr
    assert combined.count("done: ") == 1, "the summary must be printed once (by rank 0):\n" + output(result)
    match = SUMMARY.search(result.stdout)
    assert match, "no summary line on stdout:\n" + output(result)
    assert int(match["world"]) == world, match[0]
    if stage is not None:
        assert int(match["stage"]) == stage, match[0]
    numbers = {k: float(match[k]) for k in ("first", "last", "val")} | {"stage": int(match["stage"])}
    assert numbers["first"] > numbers["last"], f"the loss did not fall: {match[0]}"
    assert "Traceback" not in combined, output(result)
    return numbers


def only_rank0_chatters(result: subprocess.CompletedProcess[str]) -> None:
    """One progress bar; rank 0 logs at INFO; other ranks' records only at WARNING and above."""
    bars = BAR_START.findall(result.stderr)
    assert len(bars) == 1, f"{len(bars)} progress bars started, expected rank 0's only:\n" + output(result)
    records = [(int(m["rank"]), m["level"]) for m in LOG_RECORD.finditer(result.stderr)]
    assert (0, "INFO") in records, "rank 0 logged nothing at INFO:\n" + output(result)
    chatty = [r for r in records if r[0] != 0 and r[1] not in ("WARNING", "ERROR", "CRITICAL")]
    assert not chatty, f"ranks other than 0 logged below WARNING: {chatty}\n" + output(result)


def one_error_line(result: subprocess.CompletedProcess[str], *expected: str, alone: bool = True) -> str:
    """A non-zero exit, no traceback, exactly one `error:` line on stderr that contains
    ``expected``; with ``alone``, nothing else on stderr either."""
    assert result.returncode != 0, output(result)
    assert "Traceback" not in result.stdout + result.stderr, output(result)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1, "expected one `error:` line:\n" + output(result)
    if alone:
        assert lines == errors, "expected nothing but the error line on stderr:\n" + output(result)
    for text in expected:
        assert text in errors[0], f"{text!r} not in {errors[0]!r}"
    return errors[0]


def checkpoint_contents(path: Path) -> dict[str, Any]:
    """Every tensor of every file (model and optimizer state), the optimizer section and the extra."""
    manifest = json.loads((path / "shardpar.json").read_text())
    tensors = {
        f"{file.name}/{key}": tensor
        for file in sorted(path.glob("*.safetensors"))
        for key, tensor in load_file(file).items()
    }
    return {
        "tensors": tensors,
        "optimizer": manifest["optimizer"],
        "extra": manifest["extra"],
        "layout": (manifest["world_size"], manifest["stage"]),
    }


# --------------------------------------------------------------------------- tests


@uses("ws2", "ws1-auto-from-ws2")
def test_world_size_1_trains_at_the_stage_auto_picks(runs: Runs) -> None:
    # One run (a resumed one) serves this test and the world-size test below: each costs seconds.
    result = runs.get("ws1-auto-from-ws2")
    trained(result, world=1, stage=0)
    assert "stage 0 (--stage auto: the lowest that fits 2MB per rank)" in result.stderr, output(result)
    only_rank0_chatters(result)


@uses("ws2")
def test_world_size_2_prints_once_from_rank_0(runs: Runs) -> None:
    result = runs.get("ws2")
    trained(result, world=2, stage=2)
    only_rank0_chatters(result)
    # --resume latest on an existing, empty --ckpt-dir starts from scratch.
    assert "starting from scratch" in result.stderr, output(result)
    # The final checkpoint is written (--save-every divides --steps).
    ckpt = runs.tmp / "ws2-ckpt"
    assert shardpar.latest_checkpoint(ckpt) == ckpt / f"step-{2 * K:08d}"
    assert (ckpt / f"step-{K:08d}" / "shardpar.json").is_file()


@uses("hf-llama")
def test_hf_llama_trains_at_stage_3_and_rank_1_warnings_reach_the_user(runs: Runs) -> None:
    pytest.importorskip("transformers")
    result = runs.get("hf-llama")
    trained(result, world=2, stage=3)
    only_rank0_chatters(result)
    for text in ("python warning from rank 1", "logged warning from rank 1"):
        # (A Python warning's record also quotes the source line, untagged: not counted.)
        records = [line for line in result.stderr.splitlines() if text in line and line.startswith("[rank")]
        assert len(records) == 1 and records[0].startswith("[rank1] ") and " WARNING " in records[0], (
            f"{text!r} must reach the user once, tagged [rank1]:\n" + output(result)
        )


@uses("ws2", "killed-and-resumed")
def test_killed_run_resumed_with_the_same_command_ends_with_identical_checkpoint(runs: Runs) -> None:
    reference = runs.get("ws2")
    outcome = runs.get("killed-and-resumed")
    assert outcome["first"].name == f"step-{K:08d}", outcome["first"]
    assert not outcome["finished_anyway"], (
        f"the run finished before the kill landed (K={K} steps were too quick to poll): " + outcome["killed_log"]
    )
    resumed = outcome["resumed"]
    assert f"resumed from {outcome['ckpt'] / f'step-{K:08d}'} at step {K}" in resumed.stderr, output(resumed)
    expected, got = trained(reference, world=2, stage=2), trained(resumed, world=2, stage=2)
    assert (got["last"], got["val"]) == (expected["last"], expected["val"]), (expected, got)

    final = f"step-{2 * K:08d}"
    assert sorted(p.name for p in outcome["ckpt"].iterdir() if not p.name.startswith(".")) == ["latest", final], (
        "--keep-last 1 keeps the newest checkpoint only"
    )
    want = checkpoint_contents(runs.tmp / "ws2-ckpt" / final)
    have = checkpoint_contents(outcome["ckpt"] / final)
    assert have["layout"] == want["layout"] == (2, 2)
    assert have["extra"] == want["extra"] == {"step": 2 * K}
    assert have["optimizer"] == want["optimizer"]
    assert sorted(have["tensors"]) == sorted(want["tensors"]) and want["tensors"]
    different = [k for k, t in want["tensors"].items() if not torch.equal(t, have["tensors"][k])]
    assert not different, f"tensors differ after kill and resume: {different}"


@uses("ws2", "ws1-auto-from-ws2")
def test_resume_at_another_world_size_and_stage_gives_the_same_loss(runs: Runs) -> None:
    expected = trained(runs.get("ws2"), world=2, stage=2)
    result = runs.get("ws1-auto-from-ws2")
    got = trained(result, world=1, stage=0)
    assert f"at step {K}" in result.stderr, output(result)
    for key in ("last", "val"):
        assert abs(got[key] - expected[key]) <= 1e-6 * abs(expected[key]), (key, expected, got)


@uses("muon-stage0", "muon-stage2", "muon-stage3-from-stage2")
def test_muon_trains_at_stage_2_as_at_stage_0_and_resumes_from_a_checkpoint_per_optimizer(runs: Runs) -> None:
    """``--optimizer muon``: torch's Muon over the blocks' matrices, AdamW over the rest. At
    stage 2 each matrix is owned whole by one rank, and the run prints stage 0's (DDP's) losses.
    Each optimizer's state is in a checkpoint of its own, Muon's momentum once, by the matrix's
    owner, as one piece; resumed from them at stage 3, the run ends as the uninterrupted one."""
    expected = trained(runs.get("muon-stage0"), world=2, stage=0)
    owned = trained(runs.get("muon-stage2"), world=2, stage=2)
    assert {**owned, "stage": 0} == expected, (expected, owned)

    from recipes.gpt import tiny_gpt

    names = {name: p.numel() for name, p in tiny_gpt().named_parameters()}
    matrices = [name for name in names if name.startswith("blocks.") and name.endswith(".weight") and "ln_" not in name]
    assert len(matrices) == 8, matrices  # 2 blocks: qkv, attention proj, fc, mlp proj
    step = f"step-{M:08d}"
    muon = checkpoint_contents(runs.tmp / "muon-ckpt" / step)["optimizer"]
    adamw = checkpoint_contents(runs.tmp / "muon-ckpt" / "adamw" / step)["optimizer"]
    assert (muon["class"], adamw["class"]) == ("torch.optim.Muon", "torch.optim.adamw.AdamW")
    assert [n for g in muon["param_groups"] for n in g["params"]] == matrices
    assert sorted(n for g in adamw["param_groups"] for n in g["params"]) == sorted(set(names) - set(matrices))
    writers = set()
    for name in matrices:
        pieces = muon["state"][name]["momentum_buffer"]["pieces"]
        assert [(p["start"], p["end"]) for p in pieces] == [(0, names[name])], (name, pieces)
        writers.add(pieces[0]["file"])
    assert len(writers) == 2, f"one rank owns every matrix: {writers}"

    resumed = runs.get("muon-stage3-from-stage2")
    got = trained(resumed, world=2, stage=3)
    assert f"resumed from {runs.tmp / 'muon-ckpt' / step} at step {M}" in resumed.stderr, output(resumed)
    assert (got["last"], got["val"]) == (owned["last"], owned["val"]), (owned, got)


@uses("auto-too-small")
def test_memory_budget_no_stage_fits_is_one_error_line(runs: Runs) -> None:
    # Rank 0's INFO records may precede it; the error itself is one line.
    one_error_line(runs.get("auto-too-small"), "--memory-budget 1KB", "no stage fits", alone=False)


@uses(*(f"bad-{name}" for name in BAD_INPUT))
@pytest.mark.parametrize("name", list(BAD_INPUT))
def test_bad_input_is_one_error_line(runs: Runs, name: str) -> None:
    one_error_line(runs.get(f"bad-{name}"), BAD_INPUT[name][1])


def test_device_flag_pins_the_cpu_and_names_a_rank_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--device cpu`` hides the GPUs from the process (so a meta-built model cannot land on
    one either) and gives the CPU; ``auto``/``cuda`` with more local ranks than GPUs (two ranks
    on a one-GPU machine) is one error naming both counts, not a failure inside NCCL."""
    from recipes import cli, common

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cli.pin_device("auto")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    cli.pin_device("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    assert common.setup_device(common.DistEnv(rank=1, local_rank=1, world_size=2), "cpu") == torch.device("cpu")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for choice in ("auto", "cuda"):
        with pytest.raises(
            common.RecipeError,
            match=f"--device {choice}: local rank 1 needs a GPU of its own "
            r"but only 1 CUDA device\(s\) are visible",
        ):
            common.setup_device(common.DistEnv(rank=1, local_rank=1, world_size=2), choice)


def test_the_corpus_does_not_depend_on_what_was_imported_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A library imported before the recipe may add methods to standard classes (transformers
    adds ``logging.Logger.warning_advice``); the training text, and so every run's data, must
    stay the same."""
    import logging

    from recipes import data

    data.build_corpus.cache_clear()
    pristine = data.build_corpus()

    def warning_advice(self, *args, **kwargs) -> None:
        """A method another library added to logging.Logger."""

    warning_advice.__module__ = "some.library"
    monkeypatch.setattr(logging.Logger, "warning_advice", warning_advice, raising=False)
    data.build_corpus.cache_clear()
    try:
        assert data.build_corpus() == pristine
    finally:
        data.build_corpus.cache_clear()


def test_the_corpus_does_not_depend_on_logging_capturing_warnings() -> None:
    """The recipes call ``logging.captureWarnings(True)``, which replaces
    ``warnings.showwarning`` with logging's function: its docstring must stay in the text, so a
    plain process (a test, a notebook) gets the batches the recipes train on."""
    import logging
    import warnings

    from recipes import data

    data.build_corpus.cache_clear()
    logging.captureWarnings(False)
    pristine = data.build_corpus()
    data.build_corpus.cache_clear()
    logging.captureWarnings(True)
    try:
        assert warnings.showwarning.__module__ == "logging"
        assert data.build_corpus() == pristine
    finally:
        logging.captureWarnings(False)
        data.build_corpus.cache_clear()
