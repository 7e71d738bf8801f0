"""The memory phase: each configuration alone in the process for ``MEMORY_STEPS`` steps, its
model state and its peak RSS (on CUDA: peak allocation) above what the process held before it
was built; and the glibc allocator settings of both phases.

[Note: allocator modes]
glibc serves big allocations by mmap and returns them at free; below its threshold memory
is reused from the heap. The memory phase sets the threshold to 64 KiB so every tensor's
pages come and go with it (exact RSS). That would make the timing phase pay page faults
for every activation every step, which no real run does: glibc's dynamic threshold climbs
to 32 MiB after the first frees. So the timing phase sets 32 MiB (and trim at 64 MiB)
explicitly, the steady state every configuration sees from its first step. The JSON summary
gives each configuration's minor page faults per timed step (``minor_faults``, the process's,
the slowest rank's median), which shows whether that holds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import gc

import torch
from torch import nn

from .measure import Measured, run_step, synchronize
from .models import ModelSpec
from .runners import build_runner

MIB = 2**20
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MEASURE_MMAP_BYTES = 64 * 1024
TIMING_MMAP_BYTES = 32 * MIB


def set_allocator(mmap_threshold: int) -> None:
    """glibc's malloc thresholds; see [Note: allocator modes]."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold)


def release_free_memory() -> None:
    """Give the pages of free heap chunks back to the OS (glibc ``malloc_trim``): malloc
    reuses free chunks before it mmaps, so without this a configuration could grow into
    memory an earlier one freed and its peak RSS would not show it."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def reset_peak_rss() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


MEMORY_STEPS = 2
"""Steps of the memory phase: the first allocates optimizer state, the second is steady."""


def measure_memory(config: str, spec: ModelSpec, base: nn.Module, batches, args: argparse.Namespace) -> Measured:
    """Build one configuration alone, train ``MEMORY_STEPS`` steps and take its memory; drop it.
    On CUDA the memory is the caching allocator's (see [Note: on CUDA] in __init__.py), in the
    rss_* fields."""
    set_allocator(MEASURE_MMAP_BYTES)
    release_free_memory()
    on_gpu = args.torch_device.type == "cuda"
    if on_gpu:
        synchronize(args.torch_device)
        torch.cuda.reset_peak_memory_stats(args.torch_device)
        exact, before = True, torch.cuda.memory_allocated(args.torch_device)
    else:
        exact = reset_peak_rss()
        before = current_rss()
    runner = build_runner(config, copy.deepcopy(base), spec, args)
    measured = Measured(rss_exact=exact)
    for i in range(MEMORY_STEPS - 1):
        run_step(runner, batches[i % len(batches)])
    run_step(
        runner,
        batches[(MEMORY_STEPS - 1) % len(batches)],
        before_zero=lambda: measured.state.update(runner.model_state()),
    )
    measured.rss_peak = torch.cuda.max_memory_allocated(args.torch_device) if on_gpu else peak_rss()
    measured.rss_increase = measured.rss_peak - before
    runner.close()
    return measured
