"""What a checkpoint save costs training, synchronous against ``async_save=True``.

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tools/bench_checkpoint.py --dir /tmp/ckpt-bench

An MLP stack of about 100M parameters (benchkit's ``MLPStack``, width 1440, 6 blocks) wrapped
at ``--stage`` with AdamW, trained on random batches. A rank writes its share of the
parameters and of the optimizer state, every element once at any stage: 12 bytes per
parameter over the world size. Measured, in this order (the first while the processes are
fresh):

1. memory: the peak RSS (VmHWM, reset through /proc/self/clear_refs) above what the process
   held before, over one save and its wait with nothing else running: synchronous, then
   asynchronous (the first asynchronous save allocates the host staging buffer, which stays
   for later saves); with glibc's allocator set as benchkit's memory phase sets it, and as
   its timing phase for what follows ([Note: allocator modes] in benchkit/memory.py);
2. ``--steps`` training steps with no save, for the step time;
3. ``--saves`` synchronous saves, each between two steps: the time each blocks training
   (the slowest rank's), and the CPU time it takes;
4. ``--saves`` asynchronous saves: the time the call blocks, the time until the checkpoint is
   visible, and the steps training takes meanwhile (every rank steps until every rank's save
   is done; the ranks agree on that with one tiny all-reduce per step);
5. thread or process: the file work of a save (write and hash the staged bytes, fsync, read
   back and hash) done ``--saves`` times in a thread, then in a process, with the step time
   meanwhile. Where both slow the step alike, what slows it is the machine's cores,
   memory bandwidth and disk, not the GIL, and a process would not help.

Rank 0 prints a Markdown table and writes ``--json`` if given. Saves go to ``--dir`` (one
directory per save, removed at the end).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchkit, however this file is run
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # shardpar from this checkout

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchkit.memory import (  # noqa: E402
    MEASURE_MMAP_BYTES,
    TIMING_MMAP_BYTES,
    current_rss,
    peak_rss,
    release_free_memory,
    reset_peak_rss,
    set_allocator,
)
from benchkit.models import MLPStack  # noqa: E402

import shardpar  # noqa: E402
from shardpar.checkpoint import async_save  # noqa: E402
from shardpar.checkpoint.files import sha256_file  # noqa: E402

MB = 1e6


def slowest(value: float) -> float:
    """The largest value over the ranks."""
    tensor = torch.tensor([value], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def everywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    return slowest(0.0 if flag else 1.0) == 0.0


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.module = MLPStack(args.width, args.blocks, classes=16)
        self.params = sum(p.numel() for p in self.module.parameters())
        self.model = shardpar.wrap(self.module, stage=args.stage)
        self.opt = shardpar.optimizer(self.model, torch.optim.AdamW, lr=1e-4)
        generator = torch.Generator().manual_seed(dist.get_rank() if dist.is_initialized() else 0)
        self.x = torch.randn(args.batch, args.width, generator=generator)
        self.y = torch.randint(0, 16, (args.batch,), generator=generator)

    def step(self) -> float:
        started = time.perf_counter()
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - started

    def save(self, path: Path, async_: bool) -> shardpar.checkpoint.SaveHandle:
        return shardpar.save_checkpoint(path, self.model, self.opt, extra={"bench": True}, async_save=async_)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def memory_phase(trainer: Trainer, root: Path) -> dict[str, float]:
    set_allocator(MEASURE_MMAP_BYTES)
    try:
        return _peaks(trainer, root)
    finally:
        set_allocator(TIMING_MMAP_BYTES)


def _peaks(trainer: Trainer, root: Path) -> dict[str, float]:
    out = {}
    for kind, async_ in (("sync", False), ("async", True)):
        barrier()
        release_free_memory()
        if not reset_peak_rss():
            return {}
        before = current_rss()
        trainer.save(root / f"memory-{kind}", async_).wait()
        out[f"{kind}_peak_mb"] = slowest((peak_rss() - before) / MB)
    out["staging_mb"] = slowest(async_save._STAGING.nbytes / MB)
    return out


def sync_phase(trainer: Trainer, root: Path, saves: int) -> dict[str, list[float]]:
    blocked, cpu = [], []
    for i in range(saves):
        trainer.step()
        barrier()
        wall, process = time.perf_counter(), time.process_time()
        trainer.save(root / f"sync-{i}", False)
        blocked.append(slowest(time.perf_counter() - wall))
        cpu.append(slowest(time.process_time() - process))
    return {"blocked_s": blocked, "cpu_s": cpu}


def async_phase(trainer: Trainer, root: Path, saves: int) -> dict[str, list[float]]:
    blocked, visible, during, steps_during = [], [], [], []
    for i in range(saves):
        trainer.step()
        barrier()
        started = time.perf_counter()
        handle = trainer.save(root / f"async-{i}", True)
        blocked.append(slowest(time.perf_counter() - started))
        steps = 0
        while not everywhere(handle.done()):  # every rank steps until every rank's save is done
            during.append(slowest(trainer.step()))
            steps += 1
        handle.wait()
        visible.append(slowest(time.perf_counter() - started))
        steps_during.append(steps)
    return {"blocked_s": blocked, "visible_s": visible, "step_during_s": during, "steps_during": steps_during}


def file_work(staged: torch.Tensor, path: Path) -> None:
    """What a save does with its file, on the staged bytes: write and hash, fsync, read back."""
    view = memoryview(staged.numpy()).cast("B")
    digest = hashlib.sha256()
    with open(path, "wb", buffering=0) as f:
        digest.update(view)
        f.write(view)
        os.fsync(f.fileno())
    sha256_file(path)
    path.unlink()


def file_worker(staged: torch.Tensor, jobs: Any, done: Any) -> None:
    """The process variant: file work on a shared-memory copy of the staged bytes, per job."""
    while (path := jobs.get()) is not None:
        file_work(staged, Path(path))
        done.put(path)


def thread_or_process(trainer: Trainer, root: Path, saves: int) -> dict[str, list[float]]:
    """Step times while the file work of a save runs in a thread, then in a process started
    once beforehand (spawned: a fork would make every page training writes a copy-on-write
    fault) that reads the staged bytes from shared memory, as a process-based saver would."""
    staged = async_save._STAGING._buffer
    context = torch.multiprocessing.get_context("spawn")
    jobs, finished = context.Queue(), context.Queue()
    worker = context.Process(target=file_worker, args=(staged.clone().share_memory_(), jobs, finished))
    worker.start()
    out: dict[str, list[float]] = {"thread": [], "process": []}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for kind in out:
        for i in range(saves):
            trainer.step()
            barrier()
            path = root / f"{kind}-{i}-rank{rank}"
            if kind == "thread":
                thread = threading.Thread(target=file_work, args=(staged, path))
                thread.start()
                done = lambda: not thread.is_alive()  # noqa: E731, B023 (called in this iteration)
            else:
                jobs.put(str(path))
                done = lambda: not finished.empty()  # noqa: E731
            while not everywhere(done()):
                out[kind].append(slowest(trainer.step()))
            if kind == "process":
                finished.get()
    jobs.put(None)
    worker.join()
    return out


def table(
    args: argparse.Namespace,
    params: int,
    written: float,
    memory: dict,
    base: list[float],
    sync: dict,
    async_: dict,
    contenders: dict,
) -> str:
    med = statistics.median
    step, step_during = med(base), med(async_["step_during_s"])
    sync_blocked, async_blocked = med(sync["blocked_s"]), med(async_["blocked_s"])
    lines = [
        f"Ψ = {params / 1e6:.1f}M parameters (MLP width {args.width}, {args.blocks} blocks), stage {args.stage}, "
        f"AdamW, world size {dist.get_world_size()}, CPU (gloo); each rank writes {written / MB:.0f} MB per save. "
        f"Medians over {args.saves} saves of each kind and {args.steps} steps without a save; times are the "
        "slowest rank's.",
        "",
        "| | synchronous | `async_save=True` |",
        "|---|---|---|",
        f"| time the save blocks training | {sync_blocked:.2f} s | {async_blocked:.3f} s "
        f"(**{100 * async_blocked / sync_blocked:.1f}%** of synchronous) |",
        f"| call to checkpoint visible | {sync_blocked:.2f} s | {med(async_['visible_s']):.2f} s "
        f"({med(async_['steps_during']):.0f} steps meanwhile) |",
        f"| CPU time of one save, per rank | {med(sync['cpu_s']):.2f} s | (the same work, in a thread) |",
        f"| step time (no save running: {step:.3f} s) | — | {step_during:.3f} s while the background writes "
        f"(**{100 * (step_during / step - 1):+.0f}%**) |",
    ]
    for kind, label in (("thread", "a thread"), ("process", "a process")):
        if contenders[kind]:
            during = med(contenders[kind])
            lines.append(
                f"| step time while the file work of a save runs in {label} | — | {during:.3f} s "
                f"({100 * (during / step - 1):+.0f}%) |"
            )
    if memory:
        lines.append(
            f"| peak host memory of one save, above the process's | {memory['sync_peak_mb']:.0f} MB | "
            f"{memory['async_peak_mb']:.0f} MB (staging buffer {memory['staging_mb']:.0f} MB, kept "
            f"for the next save; the rank writes {written / MB:.0f} MB) |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="where the checkpoints are written (then removed)")
    parser.add_argument("--stage", type=int, default=2, choices=range(4))
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32, help="rows per rank per step")
    parser.add_argument("--steps", type=int, default=8, help="steps timed without a save")
    parser.add_argument("--saves", type=int, default=3, help="saves of each kind")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    trainer = Trainer(args)
    rank = dist.get_rank() if dist.is_initialized() else 0
    root = args.dir / "bench"
    for _ in range(2):  # warm-up: optimizer state exists, allocator settled
        trainer.step()
    memory = memory_phase(trainer, root)
    base = [slowest(trainer.step()) for _ in range(args.steps)]
    sync = sync_phase(trainer, root, args.saves)
    async_ = async_phase(trainer, root, args.saves)
    contenders = thread_or_process(trainer, root, args.saves)
    written = slowest(max(f.stat().st_size for f in (root / "sync-0").glob(f"rank-{rank:05d}-*")))
    barrier()
    if rank == 0:
        print(table(args, trainer.params, written, memory, base, sync, async_, contenders), flush=True)
        if args.json is not None:
            args.json.write_text(
                json.dumps(
                    {
                        "memory": memory,
                        "step_s": base,
                        "sync": sync,
                        "async": async_,
                        "file_work": contenders,
                        "written_bytes": written,
                        "params": trainer.params,
                    },
                    indent=1,
                )
            )
        shutil.rmtree(root, ignore_errors=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
