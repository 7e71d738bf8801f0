"""Multi-rank test harness: run a function on N gloo ranks on CPU, reusing the ranks.

Public API:
- ``run_ranks(fn, world_size, *args, timeout=120.0, **kwargs) -> list`` runs
  ``fn(*args, **kwargs)`` on every rank of a persistent pool and returns the per-rank
  return values, index = rank.
- ``run_script(args, timeout, env=None, cwd=None) -> CompletedProcess`` runs a command
  (typically ``torchrun``) in its own process group and kills the whole group on timeout.
- ``free_port()``, ``kill_tree(pid)``, ``shutdown_pools()``; exceptions ``RankFailure``, ``RankTimeout``,
  ``ScriptTimeout``; ``CPU_ONLY_ENV``, the environment that keeps a script on the CPU.

[Note: rank pools]
Starting a rank costs a Python interpreter plus ``import torch`` (seconds on a small
machine), far more than most tests. So each world size gets one pool of spawned worker
processes whose default process group is initialised once; every ``run_ranks`` call sends
the task to all of them over pipes and collects the replies. A pool is only trusted
while every call on it succeeds: after any rank failure, death or timeout the process
group may hold half-finished collectives, so the pool is killed and the next call starts
a fresh one.

[Note: wire format]
Everything crossing a pipe is pickled with plain ``pickle`` and sent as bytes, not with
``Connection.send``: that uses multiprocessing's ForkingPickler, for which torch registers
reducers that move tensors through shared memory, tying a result to the lifetime of the
worker that produced it. The task is pickled twice, ``(sys.path, cwd, payload)`` around
the pickled ``(fn, args, kwargs)``, so a worker can adopt the parent's import path before
unpickling ``fn`` (test modules are imported by reference, from wherever pytest put them).

[Note: post-task barrier]
A rank reports RETURNED when ``fn`` returns, then enters ``dist.barrier()``, then sends
RESULT. The barrier means a successful call leaves every rank idle, so the next task
cannot meet leftovers of this one. It cannot mask an error: a rank whose ``fn`` raised
reports ERROR and never joins the barrier, and the parent then tears the pool down,
freeing any rank stuck in the barrier or in a collective with the failed rank. RETURNED
lets a timeout name the ranks that really hung, not the ones waiting for them.

[Note: start method]
Workers are started by multiprocessing's "forkserver", not "spawn". Both give a rank a
process that inherits nothing from the pytest process but sys.path and cwd: the fork
server is a fresh interpreter that only imports torch and never runs tests, threads or
process groups. The difference is cost. With spawn every rank pays ``import torch``
(about 3 s of CPU here; 6 s for a 4-rank pool on 2 cores, again after every failure);
a fork of the server, which has torch imported already, starts in milliseconds. Set
START_METHOD to "spawn" to get fully separate interpreters when chasing a suspected
fork problem.
"""

from __future__ import annotations

import atexit
import contextlib
import enum
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

__all__ = [
    "CPU_ONLY_ENV",
    "RankFailure",
    "RankTimeout",
    "ScriptTimeout",
    "free_port",
    "kill_tree",
    "run_ranks",
    "run_script",
    "shutdown_pools",
]

START_METHOD = "forkserver"
"""multiprocessing start method for the ranks; see [Note: start method]."""

# torch._dynamo too: building any torch optimizer imports it (torch.optim wraps
# Optimizer.__init__ in torch._disable_dynamo), several seconds of CPU each; preloading it in
# the fork server pays that once instead of once per rank of every pool.
_FORKSERVER_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]

GLOO_TIMEOUT_S = 60.0
"""Process-group timeout: a collective stuck on a missing peer errors after this long."""

STARTUP_TIMEOUT_S = 120.0
"""Budget for starting a pool; kept apart from the task timeout so a short ``timeout``
does not also have to cover spawning interpreters and importing torch."""

FAILURE_GRACE_S = 2.0
"""After one rank fails, how long ranks still inside ``fn`` get to report their own error."""

SHUTDOWN_TIMEOUT_S = 10.0
"""How long a clean shutdown waits for workers to exit before killing them."""

CPU_ONLY_ENV = {"CUDA_VISIBLE_DEVICES": ""}
"""Hides every GPU from a process, so a script that picks CUDA when it is available (the
recipes' ``--device auto``, torchrun jobs, tools) runs on the CPU with gloo even on a GPU
machine: there, a 2-rank torchrun job on a one-GPU machine would otherwise put both ranks on
NCCL and rank 1 would fail. ``run_script`` applies it unless ``env`` sets the variable."""

_POLL_S = 0.1  # longest single wait, so deadlines are checked often
_TAIL_CHARS = 4000  # output kept in a ScriptTimeout message


class RankFailure(AssertionError):
    """``fn`` raised, or a worker died, on one or more ranks.

    An AssertionError so pytest reports it as a test failure with the message in full.
    ``failures`` maps each failing rank to its formatted traceback or death notice.
    """

    def __init__(self, message: str, failures: dict[int, str]) -> None:
        super().__init__(message)
        self.failures = failures


class RankTimeout(TimeoutError):
    """A ``run_ranks`` call did not finish within its timeout.

    ``unfinished`` lists the ranks still inside ``fn``; ``failures`` holds any errors
    already received from other ranks.
    """

    def __init__(self, message: str, unfinished: list[int], failures: dict[int, str]) -> None:
        super().__init__(message)
        self.unfinished = unfinished
        self.failures = failures


class ScriptTimeout(TimeoutError):
    """A ``run_script`` command ran past its timeout; its process group was killed."""

    def __init__(self, message: str, stdout: str, stderr: str) -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


class _Command(enum.Enum):
    """Parent -> worker."""

    INIT = "init"  # body: the TCPStore port rank 0 is listening on
    TASK = "task"  # body: (sys.path, cwd, pickled (fn, args, kwargs))
    SHUTDOWN = "shutdown"


class _Reply(enum.Enum):
    """Worker -> parent."""

    PORT = "port"  # rank 0 only, body: the port its TCPStore bound
    READY = "ready"  # body: pid
    RETURNED = "returned"  # fn returned; the rank is entering the post-task barrier
    RESULT = "result"  # body: pickled return value
    ERROR = "error"  # body: formatted traceback


class _RankState(enum.Enum):
    """Where one rank is within the current call, as seen by the parent."""

    RUNNING = "still running fn"
    RETURNED = "returned from fn; waiting for the other ranks in the post-task barrier"
    DONE = "done"
    FAILED = "failed"


def _send(conn: Connection, tag: enum.Enum, body: Any = None) -> None:
    conn.send_bytes(pickle.dumps((tag, body)))  # see [Note: wire format]


def _recv(conn: Connection) -> tuple[Any, Any]:
    return pickle.loads(conn.recv_bytes())


# ---------------------------------------------------------------------------------------
# Worker side


def _rank_env(rank: int, world_size: int) -> dict[str, str]:
    """What torchrun would set, plus a clean CPU-only, single-thread environment."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        # Up to 4 ranks share 2 cores; more threads per rank only adds contention.
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        # The harness is gloo on CPU; a GPU setting inherited from the shell has no
        # business here.
        "CUDA_VISIBLE_DEVICES": "",
    }


def _worker_main(rank: int, world_size: int, conn: Connection) -> None:
    """Entry point of a spawned rank: set the environment, join the group, serve tasks."""
    # Under spawn, torch reads OMP_NUM_THREADS when first imported, so the environment
    # is fixed before the first torch import here (this module imports torch only inside
    # worker functions). Under forkserver torch is already loaded, and the explicit
    # set_num_threads below is what counts; CUDA reads its variables only on first use.
    for name in [n for n in os.environ if n.startswith("TORCHELASTIC_")]:
        del os.environ[name]  # stale if the parent itself runs under torchrun
    os.environ.update(_rank_env(rank, world_size))
    # Ctrl-C reaches the whole foreground process group; the parent owns the reaction
    # (it kills the pool), so a worker should not print its own KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        _join_process_group(rank, world_size, conn)
        _serve(conn)
    except (EOFError, OSError):
        pass  # the parent is gone or closed our pipe: nothing left to report to
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _join_process_group(rank: int, world_size: int, conn: Connection) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    timeout = timedelta(seconds=GLOO_TIMEOUT_S)
    try:
        if rank == 0:
            # Port 0 lets the OS pick a free port while binding it, so there is no race
            # with other test sessions between choosing a port and listening on it.
            store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
            port = store.port
            _send(conn, _Reply.PORT, port)
        else:
            command, port = _recv(conn)
            assert command is _Command.INIT, f"expected INIT, got {command}"
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timeout)
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    except Exception:
        _send(conn, _Reply.ERROR, traceback.format_exc())
        raise
    _send(conn, _Reply.READY, os.getpid())


def _serve(conn: Connection) -> None:
    import torch.distributed as dist

    while True:
        command, body = _recv(conn)
        if command is _Command.SHUTDOWN:
            return
        assert command is _Command.TASK, f"expected TASK or SHUTDOWN, got {command}"
        sys_path, cwd, payload = body
        sys.path[:] = sys_path
        os.chdir(cwd)
        importlib.invalidate_caches()  # modules may have been written since we started
        try:
            fn, args, kwargs = pickle.loads(payload)
            # Pickle here, not after the barrier, so an unpicklable return value is
            # reported as this rank's error.
            result = pickle.dumps(fn(*args, **kwargs))
        except BaseException as error:  # SystemExit from fn is a failure to report too
            _send(conn, _Reply.ERROR, _format_user_error(error))
            continue  # the parent tears the pool down; wait here to be killed
        _send(conn, _Reply.RETURNED)
        try:
            dist.barrier()  # see [Note: post-task barrier]
        except Exception:
            _send(conn, _Reply.ERROR, "post-task barrier failed:\n" + traceback.format_exc())
            continue
        _send(conn, _Reply.RESULT, result)


def _format_user_error(error: BaseException) -> str:
    """The traceback without its first frame, which is always ``_serve`` itself."""
    tb = error.__traceback__
    return "".join(traceback.format_exception(type(error), error, tb.tb_next if tb else None))


# ---------------------------------------------------------------------------------------
# Parent side


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection


@dataclass
class _Call:
    """Bookkeeping for one task across all ranks."""

    states: dict[int, _RankState]
    results: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)

    def ranks_in(self, *states: _RankState) -> list[int]:
        return [r for r, s in self.states.items() if s in states]

    def fail(self, rank: int, report: str) -> None:
        self.states[rank] = _RankState.FAILED
        # A rank can report an error and then die; keep both parts.
        earlier = self.failures.get(rank)
        self.failures[rank] = report if earlier is None else f"{earlier.rstrip()}\n\nthen: {report}"


class _Pool:
    """``world_size`` worker processes sharing one gloo process group.

    See [Note: rank pools].
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.workers: list[_Worker] = []
        context = _start_context()
        try:
            for rank in range(world_size):
                parent_conn, child_conn = context.Pipe(duplex=True)
                process = context.Process(
                    target=_worker_main,
                    args=(rank, world_size, child_conn),
                    name=f"harness-rank{rank}-of-{world_size}",
                    # Not daemonic: daemonic processes may not start children (DataLoader
                    # workers, say). Our atexit hook stops the pools instead.
                    daemon=False,
                )
                process.start()
                # Drop our copy of the child's end so its death reads as EOF on ours.
                child_conn.close()
                self.workers.append(_Worker(rank, process, parent_conn))
            self._handshake()
        except BaseException:
            self.kill()
            raise

    def _handshake(self) -> None:
        """Forward rank 0's store port to the others and wait until all have joined."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        ready: set[int] = set()
        failures: dict[int, str] = {}
        while len(ready) < self.world_size and not failures:
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.world_size)) - ready)
                raise RankTimeout(
                    f"starting {self.world_size} ranks took over {STARTUP_TIMEOUT_S:.0f} s; "
                    f"ranks {missing} never joined the process group",
                    missing,
                    failures,
                )
            pending = [r for r in range(self.world_size) if r not in ready]
            for rank, reply in self._events(pending, deadline):
                if reply is None:
                    failures.setdefault(rank, self._death_notice(rank))  # keep an ERROR
                    continue
                tag, body = reply
                if tag is _Reply.PORT:
                    for worker in self.workers[1:]:
                        try:
                            _send(worker.conn, _Command.INIT, body)
                        except OSError:
                            pass  # that worker died; the next _events reports it
                elif tag is _Reply.READY:
                    ready.add(rank)
                elif tag is _Reply.ERROR:
                    failures[rank] = body
        if failures:
            raise RankFailure(
                _format_failures(f"could not start {self.world_size} ranks", failures, {}),
                failures,
            )

    def run(self, task: bytes, timeout: float, label: str) -> list[Any]:
        """Run one pickled task on every rank; raise RankFailure or RankTimeout on trouble.

        ``label`` names the function in error messages.

        The caller must kill the pool after any exception from here.
        """
        __tracebackhide__ = True  # pytest: the report is the ranks' tracebacks, not ours
        call = _Call({r: _RankState.RUNNING for r in range(self.world_size)})
        message = pickle.dumps((_Command.TASK, (list(sys.path), os.getcwd(), task)))
        for worker in self.workers:
            try:
                worker.conn.send_bytes(message)
            except OSError:
                call.fail(worker.rank, self._death_notice(worker.rank))

        deadline = time.monotonic() + timeout
        first_failure = time.monotonic() if call.failures else None
        while active := call.ranks_in(_RankState.RUNNING, _RankState.RETURNED):
            now = time.monotonic()
            if first_failure is not None:
                # A failed rank never joins the barrier, so RETURNED ranks will wait
                # forever; only ranks still inside fn may yet have an error to report.
                running = call.ranks_in(_RankState.RUNNING)
                if not running or now >= first_failure + FAILURE_GRACE_S:
                    break
            if now >= deadline:
                unfinished = call.ranks_in(_RankState.RUNNING)
                raise RankTimeout(
                    _format_failures(
                        f"{label} timed out after {timeout:g} s on {self.world_size} ranks; "
                        f"ranks {unfinished} had not returned",
                        call.failures,
                        call.states,
                    ),
                    unfinished,
                    call.failures,
                )
            for rank, reply in self._events(active, deadline):
                if reply is None:
                    call.fail(rank, self._death_notice(rank))
                    continue
                tag, body = reply
                if tag is _Reply.RETURNED:
                    call.states[rank] = _RankState.RETURNED
                elif tag is _Reply.RESULT:
                    try:
                        call.results[rank] = pickle.loads(body)
                        call.states[rank] = _RankState.DONE
                    except Exception:
                        call.fail(rank, "could not unpickle the result:\n" + traceback.format_exc())
                elif tag is _Reply.ERROR:
                    call.fail(rank, body)
            if call.failures and first_failure is None:
                first_failure = time.monotonic()

        if call.failures:
            raise RankFailure(
                _format_failures(
                    f"{label} failed on {len(call.failures)} of {self.world_size} ranks",
                    call.failures,
                    call.states,
                ),
                call.failures,
            )
        return [call.results[r] for r in range(self.world_size)]

    def _events(self, ranks: list[int], deadline: float) -> list[tuple[int, tuple[Any, Any] | None]]:
        """Wait briefly for replies or deaths among ``ranks``.

        Returns ``(rank, (tag, body))`` per reply and ``(rank, None)`` once per worker
        found dead. Process sentinels are watched alongside the pipes so a death is seen
        at once, not at the deadline.
        """
        handles: dict[Any, int] = {}
        for rank in ranks:
            worker = self.workers[rank]
            handles[worker.conn] = rank
            handles[worker.process.sentinel] = rank
        slice_s = min(_POLL_S, max(0.0, deadline - time.monotonic()))
        ready = wait(list(handles), timeout=slice_s)
        events: list[tuple[int, tuple[Any, Any] | None]] = []
        for rank in sorted({handles[h] for h in ready}):
            worker = self.workers[rank]
            try:
                # Drain first: a worker may have replied just before it died.
                while worker.conn.poll():
                    events.append((rank, _recv(worker.conn)))
            except (EOFError, OSError):
                events.append((rank, None))
                continue
            if not worker.process.is_alive():
                events.append((rank, None))
        return events

    def _death_notice(self, rank: int) -> str:
        process = self.workers[rank].process
        process.join(timeout=1.0)  # the pipe can close a moment before the exit code is set
        code = process.exitcode
        if code is None:
            return "worker closed its pipe but is still alive"
        if code < 0:
            return f"worker process was killed by {signal.Signals(-code).name} (exit code {code})"
        return f"worker process exited unexpectedly with exit code {code} (its stderr may say why)"

    def close(self) -> None:
        """Ask every worker to leave the process group and exit; kill stragglers."""
        for worker in self.workers:
            try:
                _send(worker.conn, _Command.SHUTDOWN)
            except OSError:
                pass
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for worker in self.workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every worker now; used whenever the process group cannot be trusted."""
        for worker in self.workers:
            if worker.process.is_alive():
                worker.process.kill()
        for worker in self.workers:
            worker.process.join(timeout=5.0)
            worker.conn.close()
        self.workers = []


def _start_context() -> mp.context.BaseContext:
    context = mp.get_context(START_METHOD)
    if isinstance(context, mp.context.ForkServerContext):
        # Takes effect when the server first starts; ours is its only user in tests.
        context.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return context


def _format_failures(headline: str, failures: dict[int, str], states: dict[int, _RankState]) -> str:
    """Headline, then each failing rank's report, then what the other ranks were doing."""
    parts = [headline]
    for rank in sorted(failures):
        parts.append(f"--- rank {rank} ---\n{failures[rank].rstrip()}")
    hint = " (perhaps blocked in a collective with a failed rank)" if failures else ""
    others = [
        f"rank {rank}: {state.value}{hint if state is _RankState.RUNNING else ''}"
        for rank, state in sorted(states.items())
        if state in (_RankState.RUNNING, _RankState.RETURNED)
    ]
    if others:
        parts.append("--- unfinished ranks when the pool was torn down ---\n" + "\n".join(others))
    return "\n\n".join(parts)


_pools: dict[int, _Pool] = {}
_pools_lock = threading.Lock()  # one call at a time: a pool serves a single task


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return results by rank.

    Each rank already has the default process group initialised (rank r of
    ``world_size``) and the torchrun environment variables set. ``fn`` must be a
    module-level function and ``args``, ``kwargs`` and the return values must be
    picklable; ``fn`` cannot take a keyword named ``timeout``.

    Raises RankFailure if ``fn`` raised or a worker died on any rank, and RankTimeout if
    the call took longer than ``timeout`` seconds (pool start-up not counted). Either way
    the pool is killed and the next call starts a fresh one. See [Note: rank pools].
    """
    __tracebackhide__ = True  # pytest: the report is the ranks' tracebacks, not ours
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    try:
        task = pickle.dumps((fn, args, kwargs))
    except Exception as error:
        raise TypeError(
            f"run_ranks could not pickle the task for {fn!r}: {error}. "
            "fn must be a module-level function (not a lambda or nested function) and "
            "its arguments must be picklable."
        ) from error
    with _pools_lock:
        pool = _pools.get(world_size)
        if pool is None:
            pool = _pools[world_size] = _Pool(world_size)
        try:
            return pool.run(task, timeout, _describe(fn))
        except BaseException:
            # Includes a pytest-timeout or Ctrl-C arriving mid-call: the workers are
            # still busy with this task, so the pool cannot serve another one.
            del _pools[world_size]
            pool.kill()
            raise


def _describe(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None)
    return f"{fn.__module__}.{name}" if name else repr(fn)  # partials have no name


def shutdown_pools() -> None:
    """Stop every pool cleanly. Runs at interpreter exit and at pytest session end."""
    with _pools_lock:
        while _pools:
            _, pool = _pools.popitem()
            pool.close()


# Registered after multiprocessing's own exit hook, so it runs first (atexit is LIFO) and
# the workers have exited before multiprocessing joins its non-daemonic children.
atexit.register(shutdown_pools)


# ---------------------------------------------------------------------------------------
# Scripts


def free_port() -> int:
    """A localhost TCP port that was free a moment ago.

    Another process can take it before it is used; prefer binding port 0 where the
    consumer allows it.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_script(
    args: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run a command in its own process group, capturing stdout and stderr as text.

    ``env`` entries are added to a copy of the current environment, after ``CPU_ONLY_ENV``:
    the command runs on the CPU unless ``env`` names ``CUDA_VISIBLE_DEVICES`` itself (a test
    that wants the GPUs asks for them). On timeout the whole
    process group is killed, so no rank that torchrun started outlives the test, and
    ScriptTimeout is raised with the tail of the output. The exit code is not checked.
    """
    full_env = {**os.environ, **CPU_ONLY_ENV, **(env or {})}
    process = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        cwd=cwd,
        start_new_session=True,  # own process group (torchrun's ranks get sessions of their own)
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(process.pid)
        try:
            stdout, stderr = process.communicate(timeout=5.0)
        except subprocess.TimeoutExpired:  # a process outside the group holds the pipes
            stdout, stderr = "", ""
        raise ScriptTimeout(
            f"{' '.join(map(str, args))} timed out after {timeout:g} s; process group killed\n"
            f"--- stdout (tail) ---\n{stdout[-_TAIL_CHARS:]}\n"
            f"--- stderr (tail) ---\n{stderr[-_TAIL_CHARS:]}",
            stdout,
            stderr,
        ) from None
    except BaseException:
        kill_tree(process.pid)
        process.wait()
        raise
    _kill_group(process.pid)  # ranks orphaned by a crashed launcher would survive it
    return subprocess.CompletedProcess(args, process.returncode, stdout, stderr)


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc), found before anything is killed, since a
    killed parent's children are re-parented and can no longer be traced to it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                ppid = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def kill_tree(pid: int) -> None:
    """Kill ``pid``'s process group and every descendant: torchrun starts each rank in a new
    session, so killing the launcher's group alone would leave ranks running."""
    for child in _descendants(pid):
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _kill_group(pid)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already gone


def _set_environ(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@contextlib.contextmanager
def environment(**values: str | None) -> Iterator[None]:
    """The environment with ``values`` (None: unset) inside; as before outside (a pool's rank
    lives on into the next test)."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        _set_environ(values)
        yield
    finally:
        _set_environ(saved)
