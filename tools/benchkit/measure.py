"""One timed training step: its wall time and phases, the process's CPU and page faults, and
the engine's waits for collectives (see [Note: what is measured] and [Note: on CUDA] in
__init__.py); :class:`Measured` collects them, and the memory and communication figures, for
one configuration on one rank."""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# Not in API.md: see [Note: engine internals] in comm_alone.py.
from shardpar.core.wait_clock import PHASES as WAIT_PHASES

from .runners import Runner

__all__ = ["WAIT_PHASES", "Measured", "run_step", "synchronize"]


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
