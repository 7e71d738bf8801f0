"""The report: the Markdown page (the machine, the run, the tables of every model, the targets
and limits at world size N, and the hand-written part below ``KEEP_MARKER`` kept as it was),
the chart beside it, and what the machine and the command were."""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .optimizers import ADAMW_OPTIONS, MUON_ADAMW, MUON_OPTIONS
from .runners import DISTMUON, PLAIN
from .tables import (
    exposure_table,
    group_bytes_table,
    has_hybrid,
    hybrid_table,
    limits_section,
    memory_table,
    targets_section,
    timing_table,
)

KEEP_MARKER = "<!-- everything below this line is written by hand; tools/bench.py keeps it -->"


def machine(device: torch.device) -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads_per_rank": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        **(gpu_info(device) if device.type == "cuda" else {}),
    }


def gpu_info(device: torch.device) -> dict[str, Any]:
    """The GPU a rank runs on, and the CUDA and NCCL it runs with (CUDA runs only)."""
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "gpu": torch.cuda.get_device_name(device),
        "gpus_visible": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
    }


def command_line(world: int) -> str:
    args = shlex.join(["tools/bench.py", *sys.argv[1:]])
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        return f"torchrun --standalone --nproc_per_node {world} {args}"
    return f"python {args}"


COLUMNS = (
    "Columns. *median step*, *IQR*, *min–max*: wall time of forward + backward + optimizer step + zero_grad, "
    "the slowest rank's, over the timed steps. *vs peer*: median over the matching peer's median (stage 0 vs "
    "DDP, stages 1–2 vs DDP + ZeroRedundancyOptimizer, stage 3 vs FSDP2). *fwd+bwd*, *opt step*, *zero_grad*: "
    "median wall time of each phase. *CPU ms/step*: CPU time of the whole rank process per step (in brackets: "
    "of its threads other than the main one, i.e. gloo's communication threads); on a loaded machine this is "
    "steadier than wall time. *host ms/step*: CPU time of the main thread over the same phases, the median (what "
    "Python, autograd and the optimizer cost the host). *shardpar calls/step*: Python function calls into "
    "shardpar's code in one more step, untimed, under cProfile, the slowest rank's; per parameter tensor in "
    "brackets; the peers' are shardpar's global optimizer step pre-hook, which runs in every torch optimizer's "
    "step once a stage 1–3 engine exists (see [Note: host columns] in tools/benchkit/measure.py). "
    "Exposed communication (second table): what the rank's main thread waited for collectives during the step "
    "(`engine.wait_clock`, reset before every step), per phase: *forward* (parameter all-gathers completed in "
    "forward: stages 1–2's post-step gathers, stage 3's unit gathers), *backward gathers* (stage 3's gathers "
    "in backward), *backward reductions* (gradient collectives) and *step* (what `step()` and zero_grad "
    "waited for, e.g. a post-step gather still in flight); each the median over the timed steps, the slowest "
    "rank's; *exposed* the median of the step's total (so not always the sum of the phases), *exposed / step* "
    "its share of the median step. *grads alone*, *gathers alone*: the same collectives (shardpar's functions, "
    "same sizes and dtypes: one per gradient bucket; one all-gather per bucket at stages 1–2, per unit group "
    "and pass at stage 3) timed with nothing else running; *comm alone* their sum; *hidden* = 1 − exposed / comm "
    "alone, clamped to [0, 1]. The peers wait inside torch (DDP's C++ reducer, ZeroRedundancyOptimizer's "
    "broadcasts, FSDP2's hooks), where the benchmark cannot time their waits without changing them: their "
    "cells show —. *Model state*: params + grads "
    "+ optimizer state as the engine accounts it (`memory_stats()`; for the peers the tensors they hold, local "
    "shards for FSDP2) against docs/design.md's ZeRO formula (peers: the stage they match; k·Ψ of optimizer "
    "state: AdamW's 8 bytes an element, Muon's 4). *Optimizer state*: of that, the optimizers' state tensors, "
    "the most any rank holds (every `shardpar.optimizer`'s at the stages). *Peak RSS increase*: "
    "VmHWM minus RSS before building, with the configuration alone in the process for 2 steps (see [Note: what "
    "is measured] in tools/benchkit/__init__.py). *Sent*: `comm_stats()` per step, padding shown apart, against "
    "`shardpar.estimate_communication`."
)
CUDA_COLUMNS = (
    "On CUDA (see [Note: on CUDA] in tools/benchkit/__init__.py): every step runs between two "
    "`torch.cuda.synchronize()`, so its "
    "time includes the GPU work it queued; *fwd+bwd*, *opt step*, *zero_grad* are GPU time between CUDA events "
    "on the current stream; *peak CUDA allocated increase*: `torch.cuda.max_memory_allocated` over the "
    "configuration's 2 steps above what was allocated before it was built; the wait clock counts only the "
    "host's waits, so a step that never synchronises shows none. Backward runs on autograd's device thread: "
    "*host ms* leaves out its CPU work and the shardpar calls are not counted (—). At world size 1, *torch* is plain torch "
    "(the model and AdamW, no wrapper), every stage's peer."
)

HYBRID_COLUMNS = (
    "Hybrid sharding (see [Note: hybrid configurations] in tools/benchkit/runners.py): *stageN-gG* is "
    "`shardpar.wrap(model, stage=N, shard_group_size=G)`, state sharded over groups of G consecutive ranks and "
    "replicated across the R = N/G groups; *hsdp-gG* is FSDP2's HSDP on the same layout, `fully_shard` with "
    '`mesh=init_device_mesh(device, (R, G), mesh_dim_names=("replicate", "shard"))`, the peer of stage 3 '
    "(*vs peer* and *vs HSDP*); stages 1–2 have none. *vs full sharding*: median over the same configuration "
    "without G (stageN; fsdp2 for hsdp-gG). The ZeRO formula takes G for N. *Bytes per group*: `comm_stats()"
    '["by_group"]` per step, the mean over ranks (a rank\'s all-reduce across replicas carries its own slice, '
    "so its padding, and with it the payload, can differ between ranks; the mean is exact), against "
    "`estimate_communication(..., shard_group_size=G).by_group`, the closed forms of docs/design.md; full "
    "sharding's stages as one group of every rank. *grads alone* under hybrid sharding: each bucket's "
    "reduce-scatter on its shard group, then, once it is done, the all-reduce of the owned slice across "
    "replicas (see [Note: hybrid sharding alone] in tools/benchkit/comm_alone.py)."
)


def write_report(path: Path, results: list[dict[str, Any]], info: dict[str, Any], args, png: Path | None) -> None:
    kept = ""
    if path.exists():
        text = path.read_text()
        if KEEP_MARKER in text:
            kept = text.split(KEEP_MARKER, 1)[1]
    world = results[0]["world"]
    muon_models = [result["model"] for result in results if result.get("optimizers") == MUON_ADAMW]
    lines = [
        "# Benchmarks: shardpar stages 0–3 against torch DDP, ZeroRedundancyOptimizer and FSDP2",
        "",
        "Generated by `tools/bench.py` from one run of:",
        "",
        "```",
        info["command"],
        "```",
        "",
        (
            f"- Machine: {info['cpu']}, `nproc` = {info['nproc']}; {world} rank(s), {info['threads_per_rank']} "
            f"intra-op thread(s) per rank, backend {info['backend']}"
        ),
        *(
            [
                f"- GPU: {info['gpu']} ({info['gpus_visible']} visible), one per rank (`cuda:LOCAL_RANK`); "
                f"CUDA {info['cuda']}, NCCL {info['nccl']}"
            ]
            if "gpu" in info
            else []
        ),
        f"- torch {info['torch']}, Python {info['python']}; run started {info['date']}, took {info['elapsed_s']:.0f} s",
        (
            f"- Load average (1/5/15 min): {info['load_start']} at start, {info['load_end']} at end "
            "(other processes on the machine slow every configuration; interleaving spreads that evenly)"
        ),
        (
            f"- Per configuration: {args.warmup} warm-up steps (excluded), then {args.rounds} interleaved rounds × "
            f"{args.steps_per_round} timed steps; AdamW lr 1e-3, fp32; shardpar.wrap options: "
            f"{args.wrap_options or 'defaults'} (+ the blocks as stage-3 units)"
        ),
        *(
            [
                f"- {', '.join(muon_models)}: `torch.optim.Muon` ({_options(MUON_OPTIONS)}) over the blocks' "
                f"matrices and AdamW ({_options(ADAMW_OPTIONS)}) over the embedding and the head, two optimizers "
                "in every configuration (two `shardpar.optimizer` calls at the stages)"
            ]
            if muon_models
            else []
        ),
        (
            "- Peers: `DistributedDataParallel` (defaults), DDP + `ZeroRedundancyOptimizer(AdamW)` (defaults), "
            "`fully_shard` (FSDP2) on every block then the root; shardpar stage 3 uses the same blocks as units"
        ),
        *(
            [
                f"- `{DISTMUON}`: a DistMuon-style peer (nanochat's DistMuon and DistAdamW over torch's Muon and "
                "AdamW: whole matrices owned round-robin by size, their gradients reduce-scattered to the owner, "
                "stepped there and all-gathered; ZeRO-1 AdamW; tools/benchkit/distmuon.py)"
            ]
            if any(DISTMUON in result["configs"] for result in results)
            else []
        ),
        *(
            [f"- Plain torch (`{PLAIN}`): the model and AdamW, no wrapper; every stage's peer at world size 1"]
            if any(PLAIN in result["configs"] for result in results)
            else []
        ),
        "",
        COLUMNS,
        *(["", CUDA_COLUMNS] if "gpu" in info else []),
        *(["", HYBRID_COLUMNS] if any(has_hybrid(result) for result in results) else []),
        "",
    ]
    if png is not None:
        lines += [f"![step time per configuration]({png.name})", ""]
    for result in results:
        lines += [f"## {result['model']}: {result['description']}, Ψ = {result['params']:,} parameters", ""]
        peak = "CUDA allocated" if "gpu" in info else "RSS"
        lines += timing_table(result) + [""] + exposure_table(result) + [""] + memory_table(result, peak) + [""]
        if has_hybrid(result):
            lines += [f"### {result['model']}: hybrid sharding", ""] + hybrid_table(result) + [""]
            lines += ["Bytes per group:", ""] + group_bytes_table(result) + [""]
        losses = {c: r["final_loss"] for c, r in result["configs"].items()}
        spread = max(losses.values()) - min(losses.values())
        lines += [
            f"Final loss after the same steps, all configurations: {min(losses.values()):.5f}–"
            f"{max(losses.values()):.5f} (spread {spread:.1e}; same data and updates everywhere).",
            "",
        ]
    if world > 1:
        lines += [f"## Targets (world size {world}, {info['backend']})", ""] + targets_section(results) + [""]
        limits = limits_section(results, info["nproc"])
        lines += limits + ([""] if limits else [])
    lines += [KEEP_MARKER]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + (kept if kept else "\n"))


def _options(options: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in options.items())


def write_chart(path: Path, results: list[dict[str, Any]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), squeeze=False)
    for ax, result in zip(axes[0], results):
        names = list(result["configs"])
        med = [result["configs"][c]["step_s"]["median"] * 1e3 for c in names]
        low = [m - result["configs"][c]["step_s"]["p25"] * 1e3 for m, c in zip(med, names)]
        high = [result["configs"][c]["step_s"]["p75"] * 1e3 - m for m, c in zip(med, names)]
        colors = ["tab:blue" if c.startswith("stage") else "tab:gray" for c in names]
        ax.bar(names, med, yerr=[low, high], color=colors, capsize=3, label="median step (IQR)")
        cpu = [result["configs"][c]["cpu_s"] * 1e3 for c in names]
        ax.plot(names, cpu, "k_", markersize=16, mew=2, label="CPU ms/step")
        ax.set_title(f"{result['model']} (Ψ={result['params'] / 1e6:.1f}M, N={result['world']})", fontsize=9)
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=7)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
