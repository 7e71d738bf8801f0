"""Asynchronous saves (issue 35): ``save_checkpoint(..., async_save=True)`` writes what the
model held at the call, while training goes on, the same bytes as a synchronous save; one
save at a time; a background error is raised on every rank; a script that exits without
waiting still gets its checkpoint, or a non-zero exit naming the error.

Kill-during-save, corruption and full-disk tests run for both kinds of save where they
live (test_checkpoint_crash.py, test_checkpoint_errors.py, test_checkpoint_attacks.py,
test_faults.py). Background writes are held back here until training has changed every
parameter, so a save that wrote live memory instead of its copy would differ.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import shardpar
from shardpar.checkpoint import io as checkpoint_io
from shardpar.checkpoint.files import write_failure
from shardpar.checkpoint.format import MANIFEST, MANIFEST_DIGEST
from shardpar.comm import collectives as C
from tests.support.checkpoint_helpers import K, assert_equal_states, build, train
from tests.support.harness import CPU_ONLY_ENV, run_script
from tests.support.parity import run

ROOT = Path(__file__).resolve().parent.parent
EXIT_SCRIPT = ROOT / "tests" / "support" / "async_exit_script.py"


@contextlib.contextmanager
def writes_held(gate: threading.Event | None = None, fail_on_rank: int | None = None) -> Iterator[None]:
    """Background writes of rank files wait for ``gate``; with ``fail_on_rank``, that rank's
    disk is full. Undone on leaving: the harness reuses its ranks."""
    write = checkpoint_io.SafetensorsWriter.write

    def held(self: checkpoint_io.SafetensorsWriter, tensor: torch.Tensor) -> None:
        if gate is not None:
            assert gate.wait(60), "the gate was never opened"
        if C.get_rank() == fail_on_rank:
            raise write_failure(self.path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        write(self, tensor)

    checkpoint_io.SafetensorsWriter.write = held
    try:
        yield
    finally:
        checkpoint_io.SafetensorsWriter.write = write


def save_now_and_after_training(stage: int, mixed_precision: str | None, root: str) -> bool:
    """Rank function: a synchronous save at step K, an asynchronous one of the same state
    whose writes wait until two more steps changed every parameter and optimizer state."""
    module, model, opt = build(stage, options={"mixed_precision": mixed_precision})
    train(module, model, opt, 0, K)
    shardpar.save_checkpoint(f"{root}/sync", model, opt, extra={"step": K})
    gate = threading.Event()
    with writes_held(gate):
        handle = shardpar.save_checkpoint(f"{root}/async", model, opt, extra={"step": K}, async_save=True)
        train(module, model, opt, K, K + 2)  # in-place updates of everything the save holds
        still_writing = not handle.done()
        gate.set()
        handle.wait()
    return still_writing


@pytest.mark.parametrize("stage, mixed_precision", [(0, None), (1, None), (2, "bf16"), (3, None)])
def test_an_async_save_holds_the_values_of_the_call_bit_for_bit(
    tmp_path: Path, stage: int, mixed_precision: str | None
) -> None:
    still_writing = run(save_now_and_after_training, 2, stage, mixed_precision, str(tmp_path))
    assert all(still_writing), "the save finished before training went on: nothing was tested"
    sync, done = tmp_path / "sync", tmp_path / "async"
    files = sorted(p.name for p in sync.iterdir())
    assert sorted(p.name for p in done.iterdir()) == files and len(files) == 3
    for name in files:
        if name != MANIFEST:
            assert (done / name).read_bytes() == (sync / name).read_bytes(), f"{name} differs"
    manifests = [json.loads((d / MANIFEST).read_text()) for d in (sync, done)]
    for manifest in manifests:
        del manifest["created_unix"], manifest[MANIFEST_DIGEST]
    assert manifests[0] == manifests[1]
    assert (tmp_path / "latest").read_text().strip() == "async"


def one_at_a_time(root: str) -> dict[str, object]:
    """Rank function: a second save waits for the first; a failed save's error comes out of
    the next save on every rank, which then works again."""
    module, model, opt = build(1)
    train(module, model, opt, 0, 1)
    gate = threading.Event()
    with writes_held(gate):
        first = shardpar.save_checkpoint(f"{root}/first", model, opt, extra={"step": 1}, async_save=True)
        opener = threading.Timer(1.0, gate.set)
        opener.start()
        started = time.monotonic()
        second = shardpar.save_checkpoint(f"{root}/second", model, opt, extra={"step": 1}, async_save=True)
        waited = time.monotonic() - started
        first_done_then = first.done() and os.path.isfile(f"{root}/first/{MANIFEST}")
        opener.join()
    second.wait()
    with writes_held(fail_on_rank=1):
        failing = shardpar.save_checkpoint(f"{root}/third", model, opt, extra={"step": 1}, async_save=True)
        while not failing.done():  # the call returned; its error waits for the next one
            time.sleep(0.01)
    try:
        shardpar.save_checkpoint(f"{root}/fourth", model, opt, extra={"step": 2})
        raised = None
    except shardpar.CheckpointError as error:
        raised = str(error)
    shardpar.save_checkpoint(f"{root}/fourth", model, opt, extra={"step": 2}, async_save=True).wait()
    return {"waited": waited, "first_done_then": first_done_then, "raised": raised}


def test_a_save_waits_for_the_one_in_progress_and_raises_its_error(tmp_path: Path) -> None:
    outcomes = run(one_at_a_time, 2, str(tmp_path))
    for rank, outcome in enumerate(outcomes):
        assert outcome["waited"] >= 0.9, f"rank {rank}: the second save did not wait for the first: {outcome}"
        assert outcome["first_done_then"], f"rank {rank}: the first save was not complete when the second began"
        raised = outcome["raised"]
        assert raised is not None, f"rank {rank}: the failed save's error was never raised"
        assert "failed on rank 1" in raised and "rank-00001-of-00002.safetensors" in raised, raised
        assert "the disk is full" in raised and str(tmp_path / "third") in raised, raised
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first", "fourth", "latest", "second"]
    assert shardpar.latest_checkpoint(tmp_path) == tmp_path / "fourth"


def exchanges(prefix: str) -> dict[str, object]:
    """Rank function: a complete exchange through the store leaves none of its data keys; then
    rank 1 falls silent (its heartbeat stops, as when its process dies) and rank 0 names it."""
    from shardpar.comm import store_exchange

    rank, store = C.get_rank(), store_exchange.default_store()
    complete = store_exchange.StoreExchange(store, f"{prefix}/complete", rank, 2, timeout_s=60)
    gathered = [complete.all_gather(f"{step} from {rank}", f"step {step}") for step in range(2)]
    complete.close("the end")
    C.barrier()  # both ranks closed theirs
    left = [
        key for key in (f"{prefix}/complete/{s}/rank-{r}" for s in range(2) for r in range(2)) if store.check([key])
    ]
    silent_after, store_exchange.SILENT_AFTER_S = store_exchange.SILENT_AFTER_S, 2.0
    try:
        exchange = store_exchange.StoreExchange(store, f"{prefix}/silent", rank, 2, timeout_s=60)
        if rank == 1:
            exchange._stop()
            return {"gathered": gathered, "left": left}
        started = time.monotonic()
        with pytest.raises(shardpar.RanksOutOfStep) as info:
            exchange.all_gather("", "save_checkpoint (writing files)")
        exchange.close("the end")
        return {"gathered": gathered, "left": left, "took": time.monotonic() - started, "error": str(info.value)}
    finally:
        store_exchange.SILENT_AFTER_S = silent_after


def test_the_store_exchange_cleans_up_and_names_a_rank_that_died(tmp_path: Path) -> None:
    outcomes = run(exchanges, 2, f"test/{tmp_path.name}")
    for outcome in outcomes:
        assert outcome["gathered"] == [["0 from 0", "0 from 1"], ["1 from 0", "1 from 1"]]
        assert outcome["left"] == [], f"keys left in the store: {outcome['left']}"
    error = outcomes[0]["error"]
    assert "save_checkpoint (writing files): rank(s) 1 gave no sign of life for 2 s" in error, error
    assert outcomes[0]["took"] < 6, f"named after {outcomes[0]['took']:.1f} s, not within seconds"


@pytest.fixture(scope="module")
def exits(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess]]:
    """Scripts that save asynchronously and exit without waiting: two ranks that also destroy
    their process group first (the save must still commit), and one process whose save fails."""
    root = tmp_path_factory.mktemp("exit")
    env = {"OMP_NUM_THREADS": "1", **CPU_ONLY_ENV}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    commands = {
        "complete": [*torchrun, str(EXIT_SCRIPT), str(root / "complete")],
        "fails": [sys.executable, str(EXIT_SCRIPT), str(root / "fails"), "--full-disk"],
    }
    results = {}
    with contextlib.ExitStack() as stack:
        from concurrent.futures import ThreadPoolExecutor

        pool = stack.enter_context(ThreadPoolExecutor(len(commands)))
        futures = {
            name: pool.submit(run_script, command, timeout=180, env=env, cwd=ROOT) for name, command in commands.items()
        }
        results = {name: (root / name, future.result()) for name, future in futures.items()}
    return results


def test_exit_with_a_pending_save_finishes_it(exits) -> None:
    out, result = exits["complete"]
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-3000:]
    assert log.count("exiting with the save still writing") == 2, log[-3000:]
    assert shardpar.latest_checkpoint(out) == out / "step-2"
    _, model, opt = build(0, seed=5)
    assert shardpar.load_checkpoint(out / "step-2", model, opt) == {"step": 2}
    assert_equal_states(model.full_state_dict(), load_file(str(out / "expected.safetensors")), "step-2")


def test_exit_with_a_failed_save_reports_it_and_exits_non_zero(exits) -> None:
    out, result = exits["fails"]
    assert result.returncode == 1, result.stdout + result.stderr
    assert "exiting with the save still writing" in result.stdout, result.stdout
    reported = [line for line in result.stderr.splitlines() if "shardpar:" in line]
    assert len(reported) == 1, result.stderr
    assert reported[0].startswith("[rank0] shardpar: the asynchronous save_checkpoint to ") and "step-2" in reported[0]
    assert "rank-00000-of-00001.safetensors" in reported[0] and "the disk is full" in reported[0], reported[0]
    assert "failed on rank 0" in reported[0] and "without waiting" in reported[0], reported[0]
    assert shardpar.latest_checkpoint(out) is None and not (out / "step-2").exists()
