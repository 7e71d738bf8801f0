"""A long run stays flat: after warm-up nothing grows with the number of steps.

Each stage trains a small MLP on two ranks for a few hundred steps of the ordinary loop plus
everything that allocates on the side: gradient accumulation under ``no_sync`` every fifth
step, a ``torch.no_grad()`` forward every tenth, ``clip_grad_norm_`` every step, a checkpoint
saved over the same path every 40 steps and loaded back every 80. Every 40 steps (same point
of every cycle, after a collection) each rank records

- its resident set size (``VmRSS`` of /proc/self/status) and open file descriptors,
- the engine's ``memory_stats()`` (params, grads, optimizer state, staging/workspace),
- the hooks shardpar registered (``engine.hook_handles``, forward hooks on modules,
  post-accumulate-grad hooks on parameters),
- how many ``torch.Tensor`` objects and objects in all the garbage collector tracks.

From the second sample on (the first checkpoint save and load are warm-up) the engine's
memory, the hooks and the descriptors must be exactly equal, the tensor and object counts
within a handful, and RSS within ``RSS_SLACK`` -- where one leaked gradient, activation
set or autograd graph per step would add megabytes. ``SHARDPAR_LONG_RUN_STEPS=3000`` runs the
issue's few-thousand-step version by hand.
"""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks
from tests.support.models import MLPStack
from tests.support.parity import cap_mb

STEPS = int(os.environ.get("SHARDPAR_LONG_RUN_STEPS", "200"))
SAMPLE_EVERY = 40
SIZES = (32, 128, 128, 8)  # 21k parameters
BATCH = 64  # activations of one step: ~100 KB, so a graph kept per step shows in RSS
RSS_SLACK = 3 * 2**20
"""Allowed RSS growth after warm-up: allocator noise is well under 1 MB here, while leaking
one step's gradients (84 KB) or activations for the 120 measured steps adds 10 MB or more."""
OBJECT_SLACK = 20
"""Python objects the garbage collector tracks may differ by a few (logging, caches)."""
TENSOR_SLACK = 8
"""Live tensors may differ by a few between samples (stage 2 keeps a free list of staging
buffers whose length depends on the last backward); one leaked per step would add 40."""


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _sample(step: int, module: nn.Module, model: shardpar.ShardedModule) -> dict[str, Any]:
    gc.collect()
    objects = gc.get_objects()
    stats = {k: v for k, v in model.memory_stats().items() if not k.startswith("peak_")}
    return {
        "step": step,
        "rss": _status("VmRSS"),
        "fds": len(os.listdir("/proc/self/fd")),
        "memory_stats": stats,
        "hook_handles": len(model.engine.hook_handles),
        "module_hooks": sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in module.modules()
        ),
        "param_hooks": sum(
            len(getattr(p, "_post_accumulate_grad_hooks", None) or {}) + len(p._backward_hooks or {})
            for p in module.parameters()
        ),
        "tensors": sum(1 for o in objects if isinstance(o, torch.Tensor)),
        "objects": len(objects),
    }


def _long_run(stage: int, steps: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    rank = C.get_rank()
    module = MLPStack(SIZES)
    options = {"wrap_policy": (nn.Linear,)} if stage == 3 else {"bucket_cap_mb": cap_mb(8192)}
    model = shardpar.wrap(module, stage=stage, **options)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01)
    # One directory for the whole job (rank 0 makes it, everyone learns its name).
    tmp = tempfile.mkdtemp(prefix="shardpar-long-run-") if rank == 0 else None
    ckpt = Path(C.all_gather_objects(tmp)[0]) / "ckpt"
    samples = []
    try:
        for step in range(steps):
            x, y = module.example(BATCH, torch.Generator().manual_seed(step * 2 + rank))
            if step % 5 == 4:  # accumulate over two micro-batches
                with model.no_sync():
                    module.loss(model(x[: BATCH // 2]), y[: BATCH // 2]).backward()
                module.loss(model(x[BATCH // 2 :]), y[BATCH // 2 :]).backward()
            else:
                module.loss(model(x), y).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            if step % 10 == 9:
                with torch.no_grad():
                    model(x)
            done = step + 1
            if done % SAMPLE_EVERY == 0:
                shardpar.save_checkpoint(ckpt, model, opt, extra={"step": done})
                if done % (2 * SAMPLE_EVERY) == 0:
                    assert shardpar.load_checkpoint(ckpt, model, opt) == {"step": done}
                samples.append(_sample(done, module, model))
    finally:
        C.barrier()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return samples


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_memory_hooks_and_objects_stay_flat_over_a_long_run(stage: int) -> None:
    assert STEPS >= 3 * SAMPLE_EVERY, "need a warm-up sample and two to compare"
    for rank, samples in enumerate(run_ranks(_long_run, 2, stage, STEPS, timeout=600)):
        baseline, *later = samples[1:]  # samples[0]: the first save happened just before it
        where = f"stage {stage}, rank {rank}"
        for sample in later:
            at = f"{where}, step {sample['step']} vs step {baseline['step']}"
            for key in ("memory_stats", "hook_handles", "module_hooks", "param_hooks", "fds"):
                assert sample[key] == baseline[key], f"{at}: {key} {baseline[key]} -> {sample[key]}"
            assert sample["tensors"] - baseline["tensors"] <= TENSOR_SLACK, (
                f"{at}: live tensors {baseline['tensors']} -> {sample['tensors']}"
            )
            assert abs(sample["objects"] - baseline["objects"]) <= OBJECT_SLACK, (
                f"{at}: gc-tracked objects {baseline['objects']} -> {sample['objects']}"
            )
            assert sample["rss"] - baseline["rss"] <= RSS_SLACK, (
                f"{at}: RSS grew by {(sample['rss'] - baseline['rss']) / 2**20:.1f} MiB "
                f"({[round(s['rss'] / 2**20, 1) for s in samples]} MiB at steps {[s['step'] for s in samples]})"
            )
