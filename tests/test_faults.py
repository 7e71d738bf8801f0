"""Faults end the job in bounded time, lose no completed work, and misuse is defined.

- A rank that raises in forward, backward or step (under torchrun): every rank exits, the
  launcher exits non-zero soon after the fault -- the survivors do not sit out the collective
  timeout -- and torchrun's error summary names the failing rank and its exception.
- A rank SIGKILLed mid-step or mid-save (synchronous, or in the background of an
  asynchronous one): the job ends, and the last complete checkpoint verifies
  (``tools/inspect_ckpt.py --verify``) and loads bit-exactly.
- A rank that hangs (alive, not in the collective): with ``timeout_s`` set, the waiting rank
  raises after about that long instead of torch's 30 minutes (plain processes, no torchrun:
  only the process group created by shardpar.wrap from the environment bounds it).
- Elastic restart: ``torchrun --max-restarts 1`` running recipes/train_gpt.py with one worker
  SIGKILLed mid-run restarts, resumes from the latest checkpoint and ends with exactly the
  parameters and optimizer state of an uninterrupted run.
- Misuse at every stage: step() before any backward, two backwards without a step, wrapping
  twice, a plain torch optimizer built before wrap, requires_grad changed after wrap.

Starting ranks is the slow part (each torchrun job imports torch three times), so every
job is launched at once by one module fixture and the tests read their results.
"""

from __future__ import annotations

import copy
import json
import os
import re
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import shardpar
from shardpar import ShardedGradError
from shardpar.checkpoint.format import read_manifest
from shardpar.checkpoint.reader import CheckpointReader
from shardpar.checkpoint.save import TEST_CRASH_ENV
from shardpar.comm import collectives as C
from tests.support.harness import CPU_ONLY_ENV, free_port, run_ranks
from tests.support.models import MLPStack
from tests.support.parity import cap_mb, rank_slice

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "support" / "fault_script.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]

COLLECTIVE_TIMEOUT_S = 600.0
"""timeout_s of the fault jobs: far above END_BOUND_S, so a survivor that waited for the
collective timeout instead of being stopped fails the test."""
END_BOUND_S = 60.0
"""Fault -> launcher exit. Measured 8-9 s after an exception and about 1 s after a SIGKILL,
with every job of this file running at once on two loaded cores; the bound leaves room for
a slower machine."""
HANG_TIMEOUT_S = 10.0
"""timeout_s of the hang job: the waiting rank must raise after about this long."""
JOB_TIMEOUT_S = 400.0
"""Kill a job still running after this long (a hang is then reported, not waited out)."""

pytestmark = pytest.mark.timeout(900)  # the fixture's first test waits for every job

JOB_ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
    TEST_CRASH_ENV: "",
    **CPU_ONLY_ENV,
}  # CPU/gloo even with GPUs

RECIPE_STEPS, RECIPE_SAVE_EVERY, RECIPE_KILL_STEP = 12, 4, 6
RECIPE_ARGS = [
    "--model",
    "tiny",
    "--stage",
    "2",
    "--steps",
    str(RECIPE_STEPS),
    "--save-every",
    str(RECIPE_SAVE_EVERY),
    "--batch-size",
    "8",
    "--block-size",
    "32",
    "--warmup",
    "2",
    "--eval-every",
    "0",
    "--eval-iters",
    "1",
    "--log-every",
    "4",
    "--resume",
    "latest",
]


# --------------------------------------------------------------------------- running jobs


@dataclass
class Job:
    name: str
    out: Path
    returncode: int | None = None
    """The launcher's exit code (plain processes: rank 0's); None if it had to be killed."""
    output: str = ""
    ended: float = 0.0
    """time.time() when the launcher (rank 0) exited."""
    survivors: list[str] = field(default_factory=list)
    """Ranks still alive when the launcher exited (plain processes: all but rank 0)."""

    @property
    def fault(self) -> dict[str, Any]:
        path = self.out / "fault.json"
        assert path.exists(), f"{self.name}: the fault was never injected\n{self.tail()}"
        return json.loads(path.read_text())

    def tail(self, chars: int = 6000) -> str:
        return f"--- {self.name}: exit code {self.returncode} ---\n{self.output[-chars:]}"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    return {**env, **JOB_ENV}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its parent has not reaped it


def _pids(out: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in out.glob("pid-rank*")}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # our own session: the launcher and every rank it started
    except (ProcessLookupError, PermissionError):
        pass


def run_torchrun(name: str, out: Path, args: list[str], launcher: list[str] = TORCHRUN) -> Job:
    out.mkdir(parents=True, exist_ok=True)
    job = Job(name, out)
    with open(out / "output.log", "w") as log:
        process = subprocess.Popen(
            [*launcher, *args], stdout=log, stderr=subprocess.STDOUT, env=_env(), cwd=ROOT, start_new_session=True
        )
        try:
            job.returncode = process.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        job.ended = time.time()
        job.survivors = [rank for rank, pid in _pids(out).items() if _alive(pid)]
        _kill_group(process.pid)
        process.wait()
        # torchrun starts every worker in a session of its own, out of the launcher's group:
        # a worker left behind by a launcher that had to be killed is killed by its pid.
        for pid in _pids(out).values():
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    job.output = (out / "output.log").read_text(errors="replace")
    return job


def run_plain(name: str, out: Path, args: list[str], world_size: int = 2) -> Job:
    """Ranks as plain processes with the variables torchrun would set, no agent around them."""
    out.mkdir(parents=True, exist_ok=True)
    job = Job(name, out)
    port = str(free_port())
    processes = []
    try:
        for rank in range(world_size):
            env = {
                **_env(),
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            }
            with open(out / f"output-rank{rank}.log", "w") as log:
                processes.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), *args],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=ROOT,
                        start_new_session=True,
                    )
                )
        try:
            job.returncode = processes[0].wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
        job.ended = time.time()
        job.survivors = [f"rank {r}" for r, p in enumerate(processes) if p.poll() is None]
    finally:
        for process in processes:
            _kill_group(process.pid)
            process.wait()
    job.output = (out / "output-rank0.log").read_text(errors="replace")
    return job


def fault_args(out: Path, fault: str, stage: int, timeout_s: float = COLLECTIVE_TIMEOUT_S, **options: Any) -> list[str]:
    args = [
        str(SCRIPT),
        str(out),
        "--fault",
        fault,
        "--rank",
        "1",
        "--stage",
        str(stage),
        "--timeout-s",
        str(timeout_s),
    ]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    return args


def _recipe_in_harness(argv: list[str]) -> None:
    """recipes/train_gpt.py's main on a harness rank (the uninterrupted reference run). The
    harness owns the process group, so the recipe's final destroy_process_group is skipped."""
    import torch.distributed as dist

    from recipes import train_gpt

    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *args, **kwargs: None
    try:
        train_gpt.main(argv)
    finally:
        dist.destroy_process_group = destroy


EXCEPTION_JOBS = {"forward": 3, "backward": 0, "step": 2}
"""Fault -> the stage it runs at: the survivor then waits in a stage-3 all-gather in forward,
a stage-0 all-reduce in backward, a stage-2 all-gather after the step."""
KILL_JOBS = {"kill-step": 1, "kill-save": 3, "kill-save-async": 3}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("faults")
    launches: dict[str, Callable[[], Job]] = {}
    for fault, stage in EXCEPTION_JOBS.items():
        out = root / fault
        launches[fault] = lambda fault=fault, out=out, stage=stage: run_torchrun(
            fault, out, fault_args(out, fault, stage, steps=3, fault_step=1)
        )
    # Checkpoints at steps 2 and 4; kill-step dies in the third step, kill-save inside the save
    # of step 4: either way step-2 is the last complete checkpoint.
    launches["kill-step"] = lambda out=root / "kill-step": run_torchrun(
        "kill-step", out, fault_args(out, "kill-step", KILL_JOBS["kill-step"], steps=4, save_every=2, fault_step=2)
    )
    for name, async_save in (("kill-save", False), ("kill-save-async", True)):
        launches[name] = lambda out=root / name, name=name, async_save=async_save: run_torchrun(
            name,
            out,
            fault_args(
                out,
                "kill-save",
                KILL_JOBS[name],
                steps=4,
                save_every=2,
                fault_step=4,
                **({"async_save": True} if async_save else {}),
            ),
        )
    hang = root / "hang"
    launches["hang"] = lambda: run_plain(
        "hang",
        hang,
        [
            str(hang),
            "--fault",
            "hang",
            "--rank",
            "1",
            "--stage",
            "0",
            "--timeout-s",
            str(HANG_TIMEOUT_S),
            "--file-barrier",
        ],
    )
    restart = root / "restart"
    launches["restart"] = lambda: run_torchrun(
        "restart",
        restart,
        [
            "--max-restarts",
            "1",
            *fault_args(restart, "kill-step", 0, timeout_s=30, steps=3, fault_step=1, late_rank0_on_restart=3),
        ],
    )
    elastic = root / "elastic"
    launches["elastic"] = lambda: run_torchrun(
        "elastic",
        elastic,
        [
            "--max-restarts",
            "1",
            str(SCRIPT),
            "recipe",
            "--rank",
            "1",
            "--fault-step",
            str(RECIPE_KILL_STEP),
            "--out",
            str(elastic),
            "--",
            *RECIPE_ARGS,
            "--ckpt-dir",
            str(elastic / "ckpt"),
        ],
    )

    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        futures = {name: pool.submit(launch) for name, launch in launches.items()}
        # Meanwhile, in this process: the uninterrupted reference of the elastic run.
        reference = root / "reference"
        run_ranks(_recipe_in_harness, 2, [*RECIPE_ARGS, "--ckpt-dir", str(reference / "ckpt")], timeout=JOB_TIMEOUT_S)
        results: dict[str, Any] = {name: future.result() for name, future in futures.items()}
    results["reference"] = reference
    return results


def _summary(output: str) -> str:
    """torchrun's error summary (every failed rank; the root cause last)."""
    assert "Root Cause (first observed failure)" in output, output[-6000:]
    return output[output.rfind("Failures:") :] if "Failures:" in output else output


# [Note: which error is first]
# The failing rank's traceback reaches the console first: the others fail only once its
# process is gone (gloo: "Connection closed by peer") or are stopped by the agent. torchrun's
# summary lists every failed rank; its "Root Cause" is the one with the oldest error-file
# timestamp, in whole seconds, ties going to the lowest rank -- so on a fast machine rank 0's
# consequential error can be labelled the root cause. The tests therefore check that the
# first exception in the output is the injected one, and that the summary has rank 1's entry.


# --------------------------------------------------------------------------- a rank raises


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(EXCEPTION_JOBS))
def test_an_exception_on_one_rank_ends_the_job_soon_and_names_the_rank(jobs: dict[str, Any], fault: str) -> None:
    job: Job = jobs[fault]
    assert job.returncode not in (0, None), job.tail()
    assert not job.survivors, f"ranks outlived the launcher: {job.survivors}\n{job.tail()}"
    assert not (job.out / "done-rank0").exists(), "the surviving rank finished training alone"
    took = job.ended - job.fault["time"]
    assert took < END_BOUND_S < COLLECTIVE_TIMEOUT_S, f"the job ended {took:.1f} s after the fault\n{job.tail()}"
    message = f"InjectedFault: injected fault in {fault} on rank 1 at step 1"
    first = re.search(r"^(?:\[rank\d\]: )?(\w+(?:Error|Fault|Exception)): .*$", job.output, re.MULTILINE)
    assert first is not None and message in first.group(0), (
        f"the first error printed is not the injected one (see [Note: which error is first]): "
        f"{first and first.group(0)}\n{job.tail()}"
    )
    summary = _summary(job.output)
    entry = re.search(
        r"rank\s+: 1 \(local_rank: 1\)\n\s+exitcode\s+: 1 .*?traceback\s+: (.*?)(?:\n\[\d\]:|\n=+)", summary, re.DOTALL
    )
    assert entry is not None and message in entry.group(1), f"torchrun's summary has no entry for rank 1\n{job.tail()}"


# --------------------------------------------------------------------------- a rank is killed


def _inspect_verify(path: Path) -> int:
    """``python tools/inspect_ckpt.py PATH --verify``, run in this process (same code path)."""
    argv, path_before = sys.argv, list(sys.path)
    sys.argv = ["tools/inspect_ckpt.py", str(path), "--verify"]
    sys.path.insert(0, str(ROOT / "tools"))  # what `python tools/x.py` puts first
    try:
        runpy.run_path(str(ROOT / "tools" / "inspect_ckpt.py"), run_name="__main__")
    except SystemExit as exit_:
        return int(exit_.code or 0)
    finally:
        sys.argv, sys.path[:] = argv, path_before
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(KILL_JOBS))
def test_a_killed_rank_ends_the_job_and_the_last_checkpoint_verifies_and_loads(
    jobs: dict[str, Any], fault: str
) -> None:
    job: Job = jobs[fault]
    assert job.returncode not in (0, None), job.tail()
    assert not job.survivors, f"ranks outlived the launcher: {job.survivors}\n{job.tail()}"
    took = job.ended - job.fault["time"]
    assert took < END_BOUND_S, f"the job ended {took:.1f} s after the kill\n{job.tail()}"
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)\n\s+exitcode\s+: -9 ", _summary(job.output)), (
        f"torchrun's summary does not show rank 1 killed by SIGKILL\n{job.tail()}"
    )

    root = job.out / "ckpt"
    visible = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert visible == ["latest", "step-2"], f"{visible}: only the complete checkpoint may be visible"
    assert shardpar.latest_checkpoint(root) == root / "step-2"
    assert _inspect_verify(root / "step-2") == 0

    torch.manual_seed(1)  # other initial values: the load must overwrite them all
    module = MLPStack((16, 64, 64, 64, 4))
    model = shardpar.wrap(module, stage=0)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    assert shardpar.load_checkpoint(root / "step-2", model, opt) == {"step": 2}
    expected = load_file(str(job.out / "expected-step-2.safetensors"))
    loaded = model.full_state_dict()
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), f"{name} differs from what was saved at step 2"


# --------------------------------------------------------------------------- a rank hangs


@pytest.mark.slow
def test_a_hung_rank_makes_the_others_fail_after_timeout_s(jobs: dict[str, Any]) -> None:
    """No torchrun: rank 1 sleeps in forward, rank 0 waits in the gradient all-reduce of a
    process group shardpar.wrap created with timeout_s=10, and raises after about 10 s."""
    job: Job = jobs["hang"]
    assert job.returncode not in (0, None), job.tail()
    assert job.fault["rank"] == 1 and job.survivors == ["rank 1"], job.survivors
    took = job.ended - job.fault["time"]
    assert 0.8 * HANG_TIMEOUT_S < took < HANG_TIMEOUT_S + END_BOUND_S, f"rank 0 failed {took:.1f} s after the hang"
    assert "timed out" in job.output.lower() or "timeout" in job.output.lower(), job.tail()


def test_default_collective_timeout_is_well_under_torchs_30_minutes() -> None:
    assert shardpar.ShardConfig().timeout_s <= 300


def test_the_recipe_bounds_how_long_a_collective_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """recipes/train_gpt.py creates the process group itself (before shardpar.wrap would):
    without a timeout, gloo's default of 30 minutes is what a hung rank costs the others."""
    from recipes import common, train_gpt

    seen: dict[str, Any] = {}
    monkeypatch.setattr(common.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(common.dist, "init_process_group", lambda *args, **kwargs: seen.update(kwargs))
    common.init_distributed(common.DistEnv(rank=0, local_rank=0, world_size=2), torch.device("cpu"))
    timeout = seen.get("timeout")
    assert timeout is not None and timeout.total_seconds() <= shardpar.ShardConfig.timeout_s, (
        f"the recipe's process group waits {timeout or '30 minutes (gloo default)'} for a missing rank"
    )
    assert train_gpt.parse_args(["--timeout-s", "10"], common.DistEnv()).timeout_s == 10


# --------------------------------------------------------------------------- elastic restart


def _checkpoint_contents(path: Path) -> dict[str, Any]:
    """Every stored tensor (model and optimizer state, read through the manifest) plus the
    scalar state, hyperparameters and extra."""
    manifest = read_manifest(path)
    tensors = {}
    with CheckpointReader(manifest) as reader:
        for entry in manifest.entries():
            tensors[entry.name] = torch.empty(entry.numel, dtype=entry.dtype)
            reader.read(entry, 0, entry.numel, tensors[entry.name])
    record = manifest.optimizer
    return {
        "tensors": tensors,
        "scalar_state": record.scalar_state,
        "hyperparameters": [g["hyperparameters"] for g in record.param_groups],
        "extra": manifest.extra,
    }


@pytest.mark.slow
def test_elastic_restart_resumes_and_ends_like_an_uninterrupted_run(jobs: dict[str, Any]) -> None:
    job: Job = jobs["elastic"]
    assert job.returncode == 0, job.tail()
    assert job.fault["step"] == RECIPE_KILL_STEP, "attempt 0 should have lost rank 1 mid-run"
    assert {"pid-rank0-attempt1", "pid-rank1-attempt1"} <= set(_pids(job.out)), "torchrun did not restart"
    assert not job.survivors, job.survivors
    last = RECIPE_KILL_STEP // RECIPE_SAVE_EVERY * RECIPE_SAVE_EVERY
    resumed_line = re.search(r"resumed from .*$", job.output, re.MULTILINE)
    assert resumed_line is not None and f"step-{last:08d}" in resumed_line.group(0), job.tail()

    final = f"step-{RECIPE_STEPS:08d}"
    resumed = _checkpoint_contents(job.out / "ckpt" / final)
    reference = _checkpoint_contents(jobs["reference"] / "ckpt" / final)
    assert resumed["tensors"].keys() == reference["tensors"].keys()
    for name, expected in reference["tensors"].items():
        actual = resumed["tensors"][name]
        assert actual.dtype == expected.dtype
        assert torch.allclose(actual, expected, rtol=0, atol=1e-6), (
            f"{name}: max difference {(actual.double() - expected.double()).abs().max():.3g} from the uninterrupted run"
        )
    for part in ("scalar_state", "hyperparameters", "extra"):
        assert resumed[part] == reference[part], part


@pytest.mark.slow
def test_shardpar_creates_a_working_group_again_after_an_elastic_restart(jobs: dict[str, Any]) -> None:
    """No recipe: shardpar.wrap creates the process group from torchrun's environment in
    both attempts (rank 1 SIGKILLed in attempt 0; rank 0 of attempt 1 arrives 3 s after
    rank 1), and the restarted attempt must train to the end -- not connect to an address
    attempt 0 left in torchrun's agent store, nor wait in init for ranks that are gone (see
    [Note: stale addresses after an elastic restart] in tests/support/fault_script.py). timeout_s=30
    bounds such a wait."""
    job: Job = jobs["restart"]
    assert job.fault["fault"] == "kill-step"
    assert {"pid-rank0-attempt1", "pid-rank1-attempt1"} <= set(_pids(job.out)), f"no restart\n{job.tail()}"
    assert job.returncode == 0, f"the restarted attempt failed\n{job.tail()}"
    assert (job.out / "done-rank0").exists() and (job.out / "done-rank1").exists()


# --------------------------------------------------------------------------- misuse

SIZES = (8, 16, 16, 4)
STAGES = [0, 1, 2, 3]


def _options(stage: int) -> dict[str, Any]:
    """Several stage-3 units; several buckets at stages 0-2."""
    return {"wrap_policy": (nn.Linear,)} if stage == 3 else {"bucket_cap_mb": cap_mb(128)}


def _build(stage: int, seed: int = 0) -> tuple[nn.Module, shardpar.ShardedModule]:
    torch.manual_seed(seed)
    module = MLPStack(SIZES)
    return module, shardpar.wrap(module, stage=stage, **_options(stage))


def _batch(module: nn.Module, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's rows of global batch ``step``, and the global batch."""
    x, y = module.example(8, torch.Generator().manual_seed(step))
    rank, world_size = C.get_rank(), C.get_world_size()
    return rank_slice(x, rank, world_size), rank_slice(y, rank, world_size), x, y


def _train_step(module: nn.Module, model: Any, opt: Any, step: int) -> None:
    x, y, _, _ = _batch(module, step)
    module.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{what}: {name} changed"


def _optimizer_snapshot(opt: Any) -> list[dict[str, torch.Tensor]]:
    return [{k: v.clone() for k, v in opt.state_of(t).items()} for tensors in opt.pieces() for t in tensors]


def _step_without_backward(stage: int) -> None:
    module, model = _build(stage)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=0.1, weight_decay=0.5)
    before = model.full_state_dict()
    opt.step()  # no backward yet: like torch when every .grad is None, nothing happens
    _assert_same(model.full_state_dict(), before, "step() before any backward")
    assert not any(opt.state_of(t) for tensors in opt.pieces() for t in tensors), (
        "step() before any backward created optimizer state"
    )
    _train_step(module, model, opt, 0)
    after = model.full_state_dict()
    state = _optimizer_snapshot(opt)
    opt.step()  # zero_grad() since the last step, no backward: again nothing (no weight decay)
    _assert_same(model.full_state_dict(), after, "step() after zero_grad() without a backward")
    for now, then in zip(_optimizer_snapshot(opt), state):
        _assert_same(now, then, "optimizer state after a step without a backward")

    torch.manual_seed(0)  # torch itself, for the record
    reference = MLPStack(SIZES)
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.5)
    expected = copy.deepcopy(reference.state_dict())
    torch_opt.step()
    _assert_same(reference.state_dict(), expected, "torch's own step() with no gradients")


def _two_backwards(stage: int) -> None:
    torch.manual_seed(0)
    reference = MLPStack(SIZES)
    module, model = _build(stage)
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
    torch_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(2):
        for micro in range(2):  # two backwards, no step between them: gradients add up
            x, y, gx, gy = _batch(module, 10 * step + micro)
            module.loss(model(x), y).backward()
            reference.loss(reference(gx), gy).backward()
        opt.step()
        opt.zero_grad()
        torch_opt.step()
        torch_opt.zero_grad()
    actual, expected = model.full_state_dict(), reference.state_dict()
    for name, value in expected.items():
        assert torch.allclose(actual[name], value, rtol=1e-5, atol=1e-6), f"stage {stage}: {name}"


def _wrap_twice(stage: int) -> list[str]:
    module, model = _build(stage)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=0.1)
    messages = []
    for again in (model, model.module):  # the ShardedModule, or the module it wraps
        try:
            shardpar.wrap(again, stage=stage)
        except ValueError as error:
            messages.append(str(error))
        else:
            messages.append(f"no error for wrapping a {type(again).__name__} again")
    _train_step(module, model, opt, 0)  # every rank raised, none is left in a collective
    return messages


def _plain_optimizer_built_before_wrap(stage: int) -> None:
    torch.manual_seed(0)
    module = MLPStack(SIZES)
    plain = torch.optim.AdamW(module.parameters(), lr=0.1)
    model = shardpar.wrap(module, stage=stage, **_options(stage))
    assert [p for group in plain.param_groups for p in group["params"]] == list(model.parameters()), (
        "wrap replaced Parameter objects: an optimizer built before it would hold stale ones"
    )
    before = model.full_state_dict()
    if stage != 0:
        # Stages 1-3 hand reduced gradients only to shardpar.optimizer (the owned slices): a
        # plain optimizer's first step raises, naming what to build instead, and changes nothing.
        x, y, _, _ = _batch(module, 0)
        module.loss(model(x), y).backward()
        with pytest.raises(
            ShardedGradError,
            match=r"holds parameter '.*' of a model wrapped by shardpar, whose gradient it cannot see: at stage",
        ):
            plain.step()
        _assert_same(model.full_state_dict(), before, f"stage {stage}: a plain torch optimizer")
        assert not plain.state, "the plain optimizer found gradients"
        return
    for step in range(3):
        x, y, _, _ = _batch(module, step)
        module.loss(model(x), y).backward()
        plain.step()
        plain.zero_grad()
    _, reference = _build(0)
    reference_opt = shardpar.optimizer(reference, torch.optim.AdamW, lr=0.1)
    for step in range(3):
        _train_step(reference.module, reference, reference_opt, step)
    _assert_same(model.full_state_dict(), reference.full_state_dict(), "stage 0: plain torch AdamW vs shardpar's")


def _requires_grad_changed(stage: int) -> str:
    module, model = _build(stage)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=0.1)
    _train_step(module, model, opt, 0)
    module.layers[2].weight.requires_grad_(False)  # on every rank
    x, y, _, _ = _batch(module, 1)
    try:
        model(x)
    except RuntimeError as error:
        message = str(error)
    else:
        message = "no error"
    module.layers[2].weight.requires_grad_(True)
    _train_step(module, model, opt, 1)  # raised before any collective: nothing is stuck
    return message


@pytest.mark.parametrize("stage", STAGES)
def test_step_before_any_backward_changes_nothing(stage: int) -> None:
    run_ranks(_step_without_backward, 2, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_two_backwards_without_a_step_accumulate_like_torch(stage: int) -> None:
    run_ranks(_two_backwards, 2, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_wrapping_a_wrapped_model_raises_on_every_rank(stage: int) -> None:
    for rank, messages in enumerate(run_ranks(_wrap_twice, 2, stage)):
        for message in messages:
            assert "already wrapped" in message, f"rank {rank}: {message}"


@pytest.mark.parametrize("stage", STAGES)
def test_a_torch_optimizer_built_before_wrap(stage: int) -> None:
    """Stage 0 keeps the Parameter objects and makes .grad views of the reduced gradients, so
    the plain optimizer trains exactly like shardpar.optimizer; stages 1-3 need
    shardpar.optimizer, and a plain one raises at its first step (docs/reliability.md)."""
    run_ranks(_plain_optimizer_built_before_wrap, 2, stage)


@pytest.mark.parametrize("stage", STAGES)
def test_requires_grad_changed_after_wrap_raises_at_the_next_forward(stage: int) -> None:
    for rank, message in enumerate(run_ranks(_requires_grad_changed, 2, stage)):
        assert "layers.2.weight" in message and "requires_grad" in message, f"rank {rank}: {message}"
