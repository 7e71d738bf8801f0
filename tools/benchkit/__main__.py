"""shardpar stages 0-3 against torch DDP, DDP + ZeroRedundancyOptimizer and FSDP2, in one run.

The command line of ``tools/bench.py`` (the documented command; ``python -m tools.benchkit``
from the repository root runs the same): parse, join or make the process group, benchmark
every model, write the report on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from . import ROOT
from .models import parse_models
from .report import command_line, machine, write_chart, write_report
from .run import bench_model, warm_process
from .runners import (
    ALL_CONFIGS,
    CANDIDATE,
    HYBRID_CONFIGS,
    KNOWN_CONFIGS,
    PLAIN,
    config_problem,
    default_configs,
    init_group,
    load_candidate,
    optimizers_problem,
    parse_option,
    stage_of,
)
from .tables import exposure_table, timing_table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models",
        default="mlp:small,mlp:large,gpt:small,gpt:large",
        help="comma-separated KIND:SIZE, kinds mlp and gpt, sizes tiny, small, large; overhead "
        "(overhead:64, the default size, or overhead:4; see [Note: the overhead model] in benchkit/models.py); "
        "and nanochat:tiny or nanochat:small, trained with Muon + AdamW (with --configs distmuon,ddp and the "
        "stages; see [Note: Muon configurations] in benchkit/runners.py)",
    )
    parser.add_argument(
        "--configs",
        default=None,
        help=f"subset of {','.join(KNOWN_CONFIGS)} and the hybrid {','.join(HYBRID_CONFIGS)} "
        f"(G a divisor of the world size, e.g. stage3-g2,hsdp-g2) (default: {','.join(ALL_CONFIGS)}; "
        f"with --device cuda at world size 1 the stages and {PLAIN})",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo (default); cuda: cuda:LOCAL_RANK and NCCL (see [Note: on CUDA])",
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--comm-reps", type=int, default=5, help="repetitions of the isolated collectives")
    parser.add_argument(
        "--wrap-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a shardpar.wrap option for every stage, e.g. bucket_cap_mb=4 (value: a Python literal)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument(
        "--png",
        type=Path,
        default=None,
        help="chart (written only when matplotlib is importable; default: --out with .png)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the raw summary here")
    parser.add_argument(
        "--candidate",
        type=Path,
        default=None,
        help="another checkout whose shardpar also runs, as stageN-cand (A/B a patch)",
    )
    parser.add_argument(
        "--candidate-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a wrap option for the stageN-cand runs only (with or without --candidate)",
    )
    args = parser.parse_args(argv)
    if args.png is None:
        args.png = args.out.with_suffix(".png")
    args.model_specs = parse_models(args.models)
    args.wrap_options = dict(parse_option(text) for text in args.wrap_option)
    args.candidate_options = dict(parse_option(text) for text in args.candidate_option)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; a plain python run is one rank
    if args.configs is None:
        args.config_list = default_configs(args.device, world)
    else:
        args.config_list = [c.strip() for c in args.configs.split(",")]
    problems = [problem for c in args.config_list if (problem := config_problem(c, world))]
    problems += [
        f"{spec.name}: {problem}"
        for spec in args.model_specs
        for c in args.config_list
        if (problem := optimizers_problem(c, spec.optimizers))
    ]
    if problems:
        raise SystemExit(f"error: --configs: {'; '.join(problems)}")
    if args.warmup < 1 or args.rounds < 1 or args.steps_per_round < 1:
        raise SystemExit("error: --warmup, --rounds and --steps-per-round must be at least 1")
    if PLAIN in args.config_list and world > 1:
        raise SystemExit(
            f"error: --configs {PLAIN}: plain torch averages no gradients, so it runs at world size 1 only"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if args.candidate is not None:
        load_candidate(args.candidate)
    if args.candidate is not None or args.candidate_options:
        args.config_list += [c + CANDIDATE for c in args.config_list if stage_of(c) is not None]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.torch_device = init_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    info = {
        **machine(args.torch_device),
        "command": command_line(world),
        "load_start": "{:.2f} / {:.2f} / {:.2f}".format(*os.getloadavg()),
    }
    started = time.perf_counter()
    warm_process(args.config_list, args)
    results = []
    for spec in args.model_specs:
        if rank == 0:
            print(f"[bench] {spec.name}: {spec.describe()}", flush=True)
        results.append(bench_model(spec, args.config_list, args))
        if rank == 0:
            for line in timing_table(results[-1]) + exposure_table(results[-1]):
                print(line, flush=True)
    info["elapsed_s"] = time.perf_counter() - started
    info["load_end"] = "{:.2f} / {:.2f} / {:.2f}".format(*os.getloadavg())
    if rank == 0:
        png = args.png if args.png and write_chart(args.png, results) else None
        write_report(args.out, results, info, args, png)
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "results": results}, indent=1))
        print(f"[bench] wrote {args.out}" + (f" and {png}" if png else " (no chart: matplotlib not importable)"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
