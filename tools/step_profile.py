"""One shardpar configuration alone in its processes: CPU per step, and where it goes.

    torchrun --standalone --nproc_per_node 2 tools/step_profile.py --model mlp:large --stage 3
    torchrun --standalone --nproc_per_node 2 tools/step_profile.py --candidate ../old --model mlp:large --stage 3
    torchrun --standalone --nproc_per_node 2 tools/step_profile.py --model mlp:small --stage 3 --calls
    torchrun --standalone --nproc_per_node 2 tools/step_profile.py --model mlp:large --stage 3 --cycles
    torchrun --standalone --nproc_per_node 2 tools/step_profile.py --model gpt:large --stage 3 \
        --time core.gatherer:UnitGatherer.wait_for_gather --time engines.engine:Engine._on_grad_ready

``tools/bench.py`` times every configuration interleaved in one launch, which is what its
ratios need; this tool answers the follow-up question about one of them, with nothing else
in the process: wall and CPU time per step (the whole process, and its main thread per
phase), how often Python's garbage collector ran, Python function calls per step
(``--calls``: under cProfile, so the times printed with it are cProfile's, not the
configuration's), and the objects per step that only the cyclic garbage collector frees
(``--cycles``). ``--time MODULE:QUALNAME`` (repeatable; the module relative to the profiled
shardpar package) adds, per function, its calls, the calling thread's CPU time and minor page
faults per step, inclusive of what it calls. The model, batch, optimizer (AdamW), step and
allocator settings are the benchmark's (``--model`` takes its names); stage 3 uses its
blocks as units, and ``--wrap-option KEY=VALUE`` passes another ``shardpar.wrap`` option.
``--candidate PATH`` profiles the shardpar of another checkout instead of this one (loaded
as the benchmark's ``--candidate`` is), so two versions can be compared
by running the tool alternately for each. Rank 0 prints one line per figure; CPU and wall
figures are the mean over ``--steps`` timed steps after ``--warmup`` steps, each step
after a barrier, the slowest rank's.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import importlib
import io
import pstats
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

# This checkout's models, allocator settings and candidate loader: the benchmark's.
from benchkit import runners  # noqa: E402
from benchkit.memory import TIMING_MMAP_BYTES, set_allocator  # noqa: E402
from benchkit.models import parse_models  # noqa: E402
from benchkit.runners import init_group, parse_option  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp:large", help="one of tools/bench.py's models (default mlp:large)")
    parser.add_argument("--stage", type=int, default=3, choices=range(4))
    parser.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    parser.add_argument("--candidate", type=Path, help="profile this checkout's shardpar instead of this one's")
    parser.add_argument(
        "--wrap-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a shardpar.wrap option, as in tools/bench.py (repeatable)",
    )
    parser.add_argument("--calls", action="store_true", help="count Python calls per step under cProfile")
    parser.add_argument("--top", type=int, default=0, help="with --calls: print the N functions with most calls")
    parser.add_argument(
        "--sort",
        default="ncalls",
        choices=("ncalls", "tottime", "cumtime"),
        help="with --top: the order (default ncalls)",
    )
    parser.add_argument(
        "--only", default="", help="with --top: only functions whose file:line(name) contains this (e.g. shardpar/)"
    )
    parser.add_argument(
        "--cycles", action="store_true", help="count objects per step that only the cyclic garbage collector frees"
    )
    parser.add_argument(
        "--time",
        action="append",
        default=[],
        metavar="MODULE:QUALNAME",
        help="per-step calls, CPU ms and page faults of this shardpar function (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be >= 1 and --warmup >= 0")
    return args


def load_library(args: argparse.Namespace) -> Any:
    """This checkout's shardpar, or the ``--candidate`` checkout's."""
    if args.candidate is None:
        return runners.shardpar
    runners.load_candidate(args.candidate.resolve())
    return runners.LIBRARIES[runners.CANDIDATE]


def build(args: argparse.Namespace, library: Any) -> tuple[Any, Any, tuple[torch.Tensor, torch.Tensor], str]:
    spec = parse_models(args.model)[0]
    torch.manual_seed(0)
    options = {"wrap_policy": [spec.unit_class]} if args.stage == 3 else {}
    options.update(parse_option(text) for text in args.wrap_option)
    model = library.wrap(spec.build(), stage=args.stage, **options)
    optimizer = library.optimizer(model, torch.optim.AdamW, lr=1e-3)
    batch = spec.batch_for(torch.Generator().manual_seed(1 + dist.get_rank()))
    return model, optimizer, batch, Path(library.__file__).resolve().parent.parent.name


class FunctionTimer:
    """Wraps named functions of the profiled package to count, per call, the calling thread's
    CPU time and minor page faults (``getrusage(RUSAGE_THREAD)``; Linux)."""

    def __init__(self, package: str, targets: list[str]) -> None:
        self.targets = targets
        self.calls = dict.fromkeys(targets, 0)
        self.cpu_ns = dict.fromkeys(targets, 0)
        self.faults = dict.fromkeys(targets, 0)
        for target in targets:
            module_name, _, qualname = target.partition(":")
            owner: Any = importlib.import_module(f"{package}.{module_name}")
            *path, name = qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, name, self._wrap(getattr(owner, name), target))

    def _wrap(self, fn: Any, target: str) -> Any:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            cpu, faults = time.thread_time_ns(), resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls[target] += 1
                self.cpu_ns[target] += time.thread_time_ns() - cpu
                self.faults[target] += resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - faults

        return timed

    def reset(self) -> None:
        for counter in (self.calls, self.cpu_ns, self.faults):
            counter.update(dict.fromkeys(counter, 0))

    def per_step(self, steps: int) -> dict[str, float]:
        out = {}
        for target in self.targets:
            out[f"{target}: calls"] = self.calls[target] / steps
            out[f"{target}: CPU ms"] = self.cpu_ns[target] / 1e6 / steps
            out[f"{target}: page faults"] = self.faults[target] / steps
        return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    init_group()
    torch.set_num_threads(1)
    set_allocator(TIMING_MMAP_BYTES)  # the benchmark's timing-phase allocator
    library = load_library(args)
    # Wrapped before the model is built, so that hooks bound at construction call the wrappers.
    timer = FunctionTimer(library.__name__, args.time) if args.time else None
    model, optimizer, (inputs, targets), checkout = build(args, library)
    phases = {"forward": 0.0, "backward": 0.0, "step": 0.0}

    def step() -> None:
        dist.barrier()
        t0 = time.thread_time()
        loss = F.cross_entropy(model(inputs).flatten(0, -2), targets)
        t1 = time.thread_time()
        loss.backward()
        t2 = time.thread_time()
        optimizer.step()
        optimizer.zero_grad()
        t3 = time.thread_time()
        for phase, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2)):
            phases[phase] += seconds

    for _ in range(args.warmup):
        step()
    phases.update(dict.fromkeys(phases, 0.0))
    if timer is not None:
        timer.reset()
    profile = cProfile.Profile() if args.calls else None
    collections = [0]

    def count_collection(phase: str, info: dict) -> None:
        collections[0] += phase == "stop"

    gc.callbacks.append(count_collection)
    wall, cpu, main_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    if profile is not None:
        profile.enable()
    for _ in range(args.steps):
        step()
    if profile is not None:
        profile.disable()
    gc.callbacks.remove(count_collection)
    per_step = {
        "wall ms": (time.perf_counter() - wall) * 1e3 / args.steps,
        "process CPU ms": (time.process_time() - cpu) * 1e3 / args.steps,
        "main-thread CPU ms": (time.thread_time() - main_cpu) * 1e3 / args.steps,
        **{f"main-thread CPU ms, {phase}": seconds * 1e3 / args.steps for phase, seconds in phases.items()},
        "garbage collections (any generation)": collections[0] / args.steps,
        **(timer.per_step(args.steps) if timer is not None else {}),
    }
    if profile is not None:
        stats = pstats.Stats(profile, stream=io.StringIO())
        per_step["Python calls"] = stats.total_calls / args.steps  # type: ignore[attr-defined]
    if args.cycles:
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector would free is kept in gc.garbage
        for _ in range(args.steps):
            step()
        gc.collect()
        gc.set_debug(0)
        per_step["objects in reference cycles"] = len(gc.garbage) / args.steps
        gc.garbage.clear()
    slowest = [None] * dist.get_world_size()
    dist.all_gather_object(slowest, per_step)
    if dist.get_rank() == 0:
        print(
            f"{args.model} stage {args.stage}, shardpar of {checkout}, {dist.get_world_size()} rank(s), "
            f"{args.steps} steps; per step, the slowest rank's:"
        )
        for key in per_step:
            digits = 2 if key.endswith("CPU ms") else 1
            print(f"  {key}: {max(rank[key] for rank in slowest):.{digits}f}")
        if profile is not None and args.top:
            out = io.StringIO()
            restrictions = (args.only, args.top) if args.only else (args.top,)
            pstats.Stats(profile, stream=out).sort_stats(args.sort).print_stats(*restrictions)
            print(out.getvalue())
    model.engine.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
