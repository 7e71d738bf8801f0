"""Per-rank memory and per-step communication of every ZeRO stage, before you have the GPUs.

    python tools/estimate.py --params 7B --world-size 8 --world-size 64 \\
        --mixed-precision bf16 --bandwidth 25 --latency 10 --budget 80GB
    python tools/estimate.py --model recipes.gpt:small_gpt --world-size 2

Prints one row per world size and stage (memory in GiB = 2^30 bytes, communication in
GB = 10^9 bytes, matching GB/s) and marks the stage ``wrap(stage="auto",
memory_budget=...)`` would pick. The numbers are shardpar.planner's model; see
docs/planner.md. Exits non-zero with one ``error: ...`` line on bad input.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402

from shardpar.planner import (  # noqa: E402
    OPTIMIZER_STATE_BYTES,
    estimate_communication,
    estimate_memory,
    format_both,
    format_bytes,
    parse_bytes,
    parse_count,
)
from shardpar.planner.shapes import STAGES  # noqa: E402


def _build_model(spec: str) -> torch.nn.Module:
    """``package.module:factory`` -> ``factory()``, built on the meta device (no memory)."""
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name:
        raise ValueError(f"--model {spec!r} must look like recipes.MODULE:FACTORY")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or whatever the module raised while importing
        raise ValueError(f"--model: cannot import {module_name!r} ({type(error).__name__}: {error})") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"--model: {module_name!r} has no factory {factory_name!r}")
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:
        raise ValueError(f"--model: {spec}() failed on the meta device ({type(error).__name__}: {error})") from None
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model: {spec}() returned {type(model).__name__}, not an nn.Module")
    return model


def estimate(args: argparse.Namespace) -> int:
    """Print the table for ``args``; return the exit code."""
    model: Any = _build_model(args.model) if args.model else parse_count(args.params)
    budget = parse_bytes(args.budget) if args.budget is not None else None
    options = dict(
        optimizer=args.optimizer,
        mixed_precision=args.mixed_precision,
        bucket_cap_mb=args.bucket_cap_mb,
        largest_unit_params=parse_count(args.unit_params) if args.unit_params else None,
        align_for_bandwidth=args.align_for_bandwidth,
    )
    first = estimate_memory(model, args.world_size[0], 0, **options)
    precision = args.mixed_precision or "fp32"
    print(
        f"{first.param_count:,} trainable parameters"
        + (f" (+{first.frozen_param_count:,} frozen)" if first.frozen_param_count else "")
        + f", {first.optimizer} ({first.optimizer_bytes_per_param} B/param of state), {precision}"
        + (
            ""
            if first.units_from_model
            else "; stage 3 assumes units of "
            + (f"{options['largest_unit_params']:,} parameters" if args.unit_params else "1/10 of the model")
        )
    )
    header = ["ranks", "stage", "params", "grads", "optimizer", "workspace", "total"]
    if args.bandwidth is not None:
        header += ["comm/step", f"s/step @{args.bandwidth:g}GB/s"]
    rows, unfit = [], []
    for world_size in args.world_size:
        estimates = [estimate_memory(model, world_size, stage, **options) for stage in STAGES]
        chosen = next((e.stage for e in estimates if budget is not None and e.total <= budget), None)
        if budget is not None and chosen is None:
            unfit.append((world_size, min(e.total for e in estimates)))
        for e in estimates:
            row = [str(world_size), str(e.stage)] + [
                format_bytes(v) for v in (e.params, e.grads, e.optimizer_state, e.workspace, e.total)
            ]
            if args.bandwidth is not None:
                comm = estimate_communication(
                    model,
                    world_size,
                    e.stage,
                    reduce_bytes=e.reduce_bytes,
                    gather_bytes=e.param_bytes if e.mixed_precision else None,
                    bandwidth_gbps=args.bandwidth,
                    latency_us=args.latency,
                    bucket_cap_mb=args.bucket_cap_mb,
                    buffer_dtype=e.mixed_precision.buffer_dtype if e.mixed_precision else None,
                    align_for_bandwidth=args.align_for_bandwidth,
                )
                row += [format_bytes(comm.sent_bytes, binary=False), f"{comm.seconds:.3f}"]
            if e.stage == chosen:
                row.append(f"<- stage='auto' picks this for --budget {args.budget}")
            rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    for row in [header] + rows:
        cells = [cell.rjust(width) for cell, width in zip(row, widths)] + row[len(header) :]
        print("  ".join(cells))
    if unfit:
        world_size, smallest = unfit[0]
        print(
            f"error: no stage fits --budget {args.budget} = {format_both(budget)} per rank at world size "
            f"{world_size}; the smallest estimate is {format_both(smallest)}",
            file=sys.stderr,
        )
        return 1
    return 0


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage too; we promise one line
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _OneLineParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", help="trainable parameter count: 7e9, 7B, 350M")
    what.add_argument("--model", help="package.module:factory building the nn.Module (on the meta device)")
    parser.add_argument("--world-size", type=int, action="append", required=True, help="ranks; repeat for several")
    parser.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_STATE_BYTES))
    parser.add_argument("--mixed-precision", choices=["bf16", "fp16"], default=None)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--unit-params", help="stage-3 unit size (default: the model's units, or 1/10)")
    parser.add_argument("--bandwidth", type=float, help="per-rank bandwidth in GB/s (10^9 bytes/s)")
    parser.add_argument("--latency", type=float, default=0.0, help="microseconds per collective")
    parser.add_argument("--budget", help="per-rank memory budget: 24GB, 80GiB, 512MiB")
    parser.add_argument(
        "--align-for-bandwidth",
        action="store_true",
        help="the layout wrap uses on NCCL (align_for_bandwidth): parameters at multiples of 64 "
        "elements, buckets of lcm(N, 128)",
    )
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.world_size):
        parser.error(f"--world-size must be >= 1, got {min(args.world_size)}")
    try:
        return estimate(args)
    except (ValueError, TypeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
