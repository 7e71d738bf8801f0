"""Tests of the multi-rank harness itself: results, reuse, failures, timeouts, deaths."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.support.harness import (
    RankFailure,
    RankTimeout,
    ScriptTimeout,
    free_port,
    run_ranks,
    run_script,
    shutdown_pools,
)

# ---------------------------------------------------------------------------------------
# Functions run on the ranks (module level: workers import them by reference)


def _rank_and_sum(scale: int, *, offset: int = 0) -> tuple[int, int, int]:
    value = torch.tensor([float(scale * (dist.get_rank() + 1) + offset)])
    dist.all_reduce(value)
    return dist.get_rank(), dist.get_world_size(), int(value.item())


def _pid() -> int:
    return os.getpid()


def _environment() -> dict[str, str | int]:
    names = [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
        "CUDA_VISIBLE_DEVICES",
    ]
    return {**{n: os.environ[n] for n in names}, "threads": torch.get_num_threads()}


def _raise_on_rank_1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom from the second rank")
    return dist.get_rank()


def _hang_on_rank_0() -> int:
    if dist.get_rank() == 0:
        time.sleep(3600)
    return dist.get_rank()


def _exit_on_rank_1() -> int:
    if dist.get_rank() == 1:
        os._exit(3)
    return dist.get_rank()


# ---------------------------------------------------------------------------------------
# run_ranks


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_come_back_indexed_by_rank(world_size: int) -> None:
    results = run_ranks(_rank_and_sum, world_size, 10, offset=1)
    # sum over r of 10 * (r + 1) + 1
    expected_sum = 10 * world_size * (world_size + 1) // 2 + world_size
    assert results == [(r, world_size, expected_sum) for r in range(world_size)]


def test_ranks_see_the_torchrun_environment() -> None:
    env = run_ranks(_environment, 2)
    for rank, seen in enumerate(env):
        assert seen["RANK"] == seen["LOCAL_RANK"] == str(rank)
        assert seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "2"
        assert seen["OMP_NUM_THREADS"] == "1" and seen["threads"] == 1
        assert seen["CUDA_VISIBLE_DEVICES"] == ""
    assert env[0]["MASTER_PORT"] == env[1]["MASTER_PORT"]


def test_workers_are_reused_across_calls() -> None:
    first = run_ranks(_pid, 2)
    second = run_ranks(_pid, 2)
    assert first == second
    assert len(set(first)) == 2 and os.getpid() not in first


def test_exception_on_one_rank_names_it_with_traceback() -> None:
    old_pids = run_ranks(_pid, 2)
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_rank_1, 2)
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: boom from the second rank" in message
    assert "Traceback (most recent call last)" in message
    assert "_raise_on_rank_1" in message  # the frame that raised
    assert set(info.value.failures) == {1}
    _assert_fresh_pool_works(old_pids)


def test_hung_rank_times_out_and_is_named() -> None:
    old_pids = run_ranks(_pid, 2)
    start = time.monotonic()
    with pytest.raises(RankTimeout) as info:
        run_ranks(_hang_on_rank_0, 2, timeout=5)
    elapsed = time.monotonic() - start
    assert 5 <= elapsed < 10
    assert info.value.unfinished == [0]
    assert "rank 0" in str(info.value)
    _assert_fresh_pool_works(old_pids)


def test_dead_worker_is_reported_promptly_with_exit_code() -> None:
    old_pids = run_ranks(_pid, 2)
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_exit_on_rank_1, 2, timeout=60)
    assert time.monotonic() - start < 10  # seen through the process sentinel, not the timeout
    assert set(info.value.failures) == {1}
    assert "rank 1" in str(info.value) and "exit code 3" in str(info.value)
    _assert_fresh_pool_works(old_pids)


def test_unpicklable_function_is_rejected_before_dispatch() -> None:
    with pytest.raises(TypeError, match="module-level function"):
        run_ranks(lambda: 0, 2)


def test_shutdown_stops_workers_without_killing_them() -> None:
    pids = run_ranks(_pid, 3)
    start = time.monotonic()
    shutdown_pools()
    # Well under SHUTDOWN_TIMEOUT_S: the workers left on request, nobody was killed.
    assert time.monotonic() - start < 5
    assert not any(_is_running(pid) for pid in pids)
    assert run_ranks(_rank_and_sum, 3, 1) == [(r, 3, 6) for r in range(3)]


def _assert_fresh_pool_works(old_pids: list[int]) -> None:
    new_pids = run_ranks(_pid, 2)
    assert not set(new_pids) & set(old_pids), "the failed pool should have been replaced"
    assert run_ranks(_rank_and_sum, 2, 1) == [(0, 2, 3), (1, 2, 3)]


# ---------------------------------------------------------------------------------------
# run_script and free_port


def test_run_script_captures_output() -> None:
    done = run_script(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
        timeout=30,
        env={"HARNESS_TEST": "1"},
    )
    assert done.returncode == 0
    assert done.stdout == "out\n" and done.stderr == "err\n"


def test_run_script_hides_the_gpus_unless_asked() -> None:
    # torchrun jobs in tests run on CPU/gloo even on a GPU machine (CPU_ONLY_ENV); a test that
    # names CUDA_VISIBLE_DEVICES itself gets what it names.
    show = [sys.executable, "-c", "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"]
    assert run_script(show, timeout=30).stdout == "''\n"
    assert run_script(show, timeout=30, env={"CUDA_VISIBLE_DEVICES": "0"}).stdout == "'0'\n"


def test_run_script_timeout_kills_the_process_group() -> None:
    # The child starts a grandchild, as torchrun starts ranks; both must die.
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(ScriptTimeout) as info:
        run_script([sys.executable, "-c", script], timeout=2)
    grandchild = int(info.value.stdout.split()[0])
    assert str(grandchild) in str(info.value)
    assert not _is_running(grandchild)


def _is_running(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (its reaping is out of our hands)."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return False
        except FileNotFoundError:
            return False
        time.sleep(0.1)
    return True


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
