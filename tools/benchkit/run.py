"""One model's benchmark: every configuration's memory alone, one by one, then all of them
built together, warmed up and timed in interleaved rounds (round r runs each configuration
``--steps-per-round`` times in an order rotated by r, so machine drift lands on all alike)."""

from __future__ import annotations

import copy
import gc
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from .comm_alone import collectives_alone_s
from .measure import Measured, count_calls, run_step
from .memory import TIMING_MMAP_BYTES, measure_memory, release_free_memory, set_allocator
from .models import SIZES, ModelSpec
from .runners import Runner, build_runner, shardpar_packages
from .stats import summarize


def _on(batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0].to(device), batch[1].to(device)


def warm_process(configs: list[str], args) -> None:
    """Pay one-time costs (lazy imports, gloo and autograd threads, allocator pools) on a
    tiny model first, so the first configuration's RSS increase is its own; once per kind of
    optimizers the models train with (``--models``' ``ModelSpec.optimizers``)."""
    for optimizers in dict.fromkeys(spec.optimizers for spec in args.model_specs):
        spec = ModelSpec("gpt", "warm-up", **SIZES["gpt"]["tiny"], optimizers=optimizers)
        base = spec.build()
        batch = _on(spec.batch_for(torch.Generator().manual_seed(0)), args.torch_device)
        for config in configs:
            runner = build_runner(config, copy.deepcopy(base), spec, args)
            for _ in range(2):
                run_step(runner, batch)
            runner.close()
    gc.collect()


def bench_model(spec: ModelSpec, configs: list[str], args) -> dict[str, Any]:
    """Every configuration on one model: memory alone one by one, then built together, warmed
    up and timed in interleaved rounds."""
    torch.manual_seed(args.seed)
    base = spec.build()
    psi = sum(p.numel() for p in base.parameters())
    tensors = len(list(base.parameters()))
    generator = torch.Generator().manual_seed(args.seed * 1000 + dist.get_rank())
    batches = [_on(spec.batch_for(generator), args.torch_device) for _ in range(4)]
    measured = {config: measure_memory(config, spec, base, batches, args) for config in configs}
    set_allocator(TIMING_MMAP_BYTES)
    # The memory runs leave the heap fragmented: the runners built first would otherwise get its
    # scattered free chunks and those built last fresh ones (an A/A launch read stage 2 4% slower
    # than the same code built after it; docs/benchmarks.md, #44's "entry hooks quiet" section).
    release_free_memory()
    runners: dict[str, Runner] = {}
    for config in configs:
        runner = runners[config] = build_runner(config, copy.deepcopy(base), spec, args)
        for i in range(args.warmup):
            run_step(runner, batches[i % len(batches)])
        # One more step, untimed, every configuration's: the shardpar calls column ([Note: host
        # columns] in measure.py).
        measured[config].shardpar_calls = count_calls(runner, batches[args.warmup % len(batches)], shardpar_packages())
    step_index = args.warmup + 1
    for r in range(args.rounds):
        order = configs[r % len(configs) :] + configs[: r % len(configs)]
        for config in order:
            runner, m = runners[config], measured[config]
            if runner.stage is not None:
                runner.model.reset_comm_stats()
            for s in range(args.steps_per_round):
                m.final_loss = run_step(runner, batches[(step_index + s) % len(batches)], m)
            if runner.stage is not None:
                accumulate_comm(m, runner.model.comm_stats(), args.steps_per_round)
        step_index += args.steps_per_round
    for config in configs:
        m = measured[config]
        m.grad_alone_s, m.gather_alone_s = collectives_alone_s(runners[config], args.comm_reps)
        runners[config].close()
    runners.clear()
    gc.collect()
    gathered: list[dict[str, Any]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, {c: asdict(m) for c, m in measured.items()})
    return summarize(spec, psi, tensors, configs, gathered, args)


def accumulate_comm(m: Measured, stats: dict[str, Any], steps: int) -> None:
    """Per-step bytes from one round's counters (every round moves the same bytes), and per
    group under hybrid sharding."""
    m.sent_bytes = stats["total"]["sent_bytes"] / steps
    m.padding_bytes = stats["total"]["padding_sent_bytes"] / steps
    m.sent_by_op = {op: v["sent_bytes"] / steps for op, v in stats.items() if op not in ("total", "by_group")}
    m.sent_by_group = {
        group: {key: value / steps for key, value in snapshot["total"].items()}
        for group, snapshot in stats.get("by_group", {}).items()
    }
