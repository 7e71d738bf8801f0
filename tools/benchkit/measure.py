"""One timed training step: its wall time and phases, the process's CPU and page faults, and
the engine's waits for collectives (see [Note: what is measured] and [Note: on CUDA] in
__init__.py); one untimed step with shardpar's Python calls counted ([Note: host columns]);
:class:`Measured` collects them, and the memory and communication figures, for one
configuration on one rank.

[Note: host columns]
Two figures say what the host spends on a step, for models whose compute is negligible (the
overhead model, [Note: the overhead model] in models.py) and any other:
- *host ms*: CPU time of the rank's main thread (``time.thread_time``) over the timed phases of
  a step (fwd+bwd, opt step, zero_grad), the median over the timed steps, the slowest rank's.
  Python, autograd's CPU work and the optimizer run there; gloo's communication threads do not
  (they are the brackets of *CPU ms/step*).
- *shardpar calls*: Python function calls per step into shardpar's code, counted in a
  separate step, untimed, under ``cProfile`` (which slows what it profiles): every call whose
  code object's file lies under a shardpar package of the process (this checkout's, and the
  ``--candidate``'s when one is loaded), recursive calls, generator resumptions and, on Python
  3.11, comprehensions included (cProfile counts each as a call: each costs the interpreter a
  frame). Per parameter tensor in brackets: what issue #44's targets count. The slowest
  rank's, i.e. the most calls. The peers are counted too: a process that built a stage 1-3
  engine runs shardpar's global optimizer step pre-hook (core/grad_placeholders.py, which refuses a
  torch optimizer over parameters whose gradients shardpar keeps) in every torch optimizer's
  step, theirs included. Calls are counted, not the loops inside them: a function looping in
  Python over every parameter counts once. Every configuration takes this step, right after
  its warm-up, so all of them still train on the same batches.
On CUDA the backward pass runs on autograd's device thread, not the main one: *host ms* leaves
out backward's CPU work there, and the calls are not counted (—), as a profiler of the main
thread would miss every gradient hook.
"""

from __future__ import annotations

import cProfile
import math
import resource
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

# Not in API.md: see [Note: engine internals] in comm_alone.py.
from shardpar.core.wait_clock import PHASES as WAIT_PHASES

from .runners import Runner

__all__ = ["WAIT_PHASES", "Measured", "count_calls", "run_step", "synchronize"]


@dataclass
class Measured:
    """What one rank measured for one configuration."""

    steps: list[float] = field(default_factory=list)  # seconds per timed step
    phases: list[tuple[float, float, float]] = field(default_factory=list)  # fwd+bwd, opt step, zero_grad
    cpu: list[float] = field(default_factory=list)  # CPU seconds per timed step, all threads of the process
    cpu_other: list[float] = field(default_factory=list)  # of which not the main thread (gloo's threads)
    minor_faults: list[int] = field(default_factory=list)  # minor page faults per timed step, whole process
    phase_cpu_main: list[tuple[float, float, float]] = field(default_factory=list)  # main-thread CPU per phase
    exposed: list[dict[str, float]] = field(default_factory=list)  # wait-clock seconds per phase, per step
    state: dict[str, int] = field(default_factory=dict)
    rss_increase: int = 0
    rss_peak: int = 0
    rss_exact: bool = True
    sent_bytes: float | None = None
    padding_bytes: float | None = None
    sent_by_op: dict[str, float] = field(default_factory=dict)
    sent_by_group: dict[str, dict[str, float]] = field(default_factory=dict)  # hybrid sharding: per group,
    # {"sent_bytes", "padding_sent_bytes"} per step (comm_stats()["by_group"])
    grad_alone_s: float | None = None
    gather_alone_s: float | None = None
    shardpar_calls: int | None = None  # Python calls into shardpar in the counted step ([Note: host columns])
    final_loss: float = math.nan


def _clock() -> tuple[float, float, float]:
    """(wall, CPU of the whole process, CPU of this thread) in seconds."""
    return time.perf_counter(), time.process_time(), time.thread_time()


def _minor_faults() -> int:
    """Minor page faults of the whole process so far: pages touched for the first time since
    the allocator got them from the OS, which a step pays for every buffer it allocates anew."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queue on CUDA (see [Note: on CUDA]); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _GPUMarks:
    """CUDA events at the phase boundaries of a step, on the current stream: a phase's GPU time
    without making the host wait (see [Note: on CUDA]). On the CPU, no events and no phases."""

    def __init__(self, device: torch.device) -> None:
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if device.type == "cuda" else []
        self.next = 0

    def mark(self) -> None:
        if self.events:
            self.events[self.next].record()
            self.next += 1

    def phases(self) -> tuple[float, float, float] | None:
        """fwd+bwd, opt step, zero_grad in seconds, once the step is synchronised."""
        if not self.events:
            return None
        e = self.events
        return e[0].elapsed_time(e[1]) / 1e3, e[1].elapsed_time(e[2]) / 1e3, e[3].elapsed_time(e[4]) / 1e3


def run_step(runner: Runner, batch, measured: Measured | None = None, before_zero: Callable | None = None) -> float:
    """One training step after a barrier; ``before_zero`` runs between the optimizer step
    and zero_grad, outside the timed phases."""
    dist.barrier()
    synchronize(runner.device)
    marks = _GPUMarks(runner.device)
    wait_clock = runner.wait_clock  # None: a peer
    if wait_clock is not None:
        wait_clock.reset()
    faults = _minor_faults()
    start = _clock()
    marks.mark()
    loss = runner.forward_backward(batch)
    after_backward = _clock()
    marks.mark()
    runner.step()
    after_step = _clock()
    marks.mark()
    if before_zero is not None:
        before_zero()
    before_zero_grad = _clock()
    marks.mark()
    runner.zero_grad()
    marks.mark()
    synchronize(runner.device)
    end = _clock()
    faults = _minor_faults() - faults
    if measured is not None:
        measured.minor_faults.append(faults)
        spans = [(start, after_backward), (after_backward, after_step), (before_zero_grad, end)]
        gpu_phases = marks.phases()
        measured.phases.append(gpu_phases or tuple(b[0] - a[0] for a, b in spans))
        measured.phase_cpu_main.append(tuple(b[2] - a[2] for a, b in spans))
        if gpu_phases is None:
            measured.steps.append(sum(measured.phases[-1]))
        else:  # the host ran ahead: the step is the wall time between the two synchronisations
            measured.steps.append(end[0] - start[0] - (before_zero_grad[0] - after_step[0]))
        cpu = sum(b[1] - a[1] for a, b in spans)
        measured.cpu.append(cpu)
        measured.cpu_other.append(cpu - sum(measured.phase_cpu_main[-1]))
        if wait_clock is not None:
            measured.exposed.append(dict(wait_clock.seconds))
    return float(loss)


def count_calls(runner: Runner, batch, packages: list[Path]) -> int | None:
    """One training step, untimed, under cProfile: the Python calls it made into code under
    any of the directories ``packages`` (see [Note: host columns]); on CUDA, where backward
    runs on another thread, the same step uncounted, and None."""
    dist.barrier()
    synchronize(runner.device)
    counting = runner.device.type == "cpu"
    profile = cProfile.Profile()
    if counting:
        profile.enable()
    try:
        runner.forward_backward(batch)
        runner.step()
        runner.zero_grad()
    finally:
        profile.disable()
    synchronize(runner.device)
    if not counting:
        return None
    inside = tuple(f"{package.resolve()}/" for package in packages)
    return sum(
        entry.callcount
        for entry in profile.getstats()  # type: ignore[attr-defined]
        if isinstance(entry.code, types.CodeType) and str(Path(entry.code.co_filename).resolve()).startswith(inside)
    )
