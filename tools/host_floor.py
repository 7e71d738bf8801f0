"""What plain torch itself charges for the mechanisms a gradient path needs, with no wrapper.

    OMP_NUM_THREADS=1 python tools/host_floor.py --model overhead --rounds 300

Issue #44 compares shardpar's step at world size 1 with plain torch's. Part of the difference is
not shardpar's Python but torch's price for what any data-parallel reducer that runs in
autograd needs, DDP's C++ reducer included: learning that each gradient is ready, and getting it
into a flat buffer that a collective can read. This tool measures that price in plain torch, on
tools/bench.py's model and batch (``--model`` takes its names), by interleaved backward passes
of identical copies of the model, main-thread CPU per backward:

- ``plain``: no hooks, ``.grad`` None before backward (autograd hands its new tensor over): the
  floor every configuration is compared with;
- ``hook``: one post-accumulate-grad hook per parameter that only counts (autograd's call into
  Python per gradient: what any hook-based reducer pays before it does anything);
- ``views``: before backward the flat buffer is zeroed (one ``zero_``) and each ``.grad`` set to
  its view of it, so autograd adds every gradient into the buffer in place (DDP's
  ``gradient_as_bucket_view``; shardpar's [Note: gradients accumulate in the buffer] in
  shardpar/core/reducer.py);
- ``hook+views``: both, the least a reducer of this kind can pay: shardpar's stages 0-1 add
  their bookkeeping on top (the counting in each hook, the launch, the end of backward).

Before timing, every variant's gradients are checked to equal ``plain``'s bit for bit (a
variant that changed them would be measuring something else). One process, no
process group. Prints one line per variant: the median backward in ms, its interquartile
range, and the difference from ``plain``'s median; ``--json PATH`` writes the same figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchkit.models import ModelSpec, parse_models  # noqa: E402
from torch import nn  # noqa: E402

VARIANTS = ("plain", "hook", "views", "hook+views")


class Variant:
    """One copy of the model with one variant's gradient mechanism: ``before_backward`` runs
    just before each backward, inside the timed span."""

    def __init__(self, name: str, model: nn.Module) -> None:
        self.name, self.model = name, model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.arrivals = 0
        self.buffer = torch.zeros(sum(p.numel() for p in self.params))
        self.views, offset = [], 0
        for param in self.params:
            self.views.append(self.buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        if "hook" in name:
            for param in self.params:
                param.register_post_accumulate_grad_hook(self._count)

    def _count(self, param: nn.Parameter) -> None:
        self.arrivals += 1

    def clear(self) -> None:
        for param in self.params:
            param.grad = None

    def before_backward(self) -> None:
        if "views" in self.name:
            self.buffer.zero_()
            for param, view in zip(self.params, self.views):
                param.grad = view

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]


def make_loss(
    spec: ModelSpec, model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]
) -> Callable[[], torch.Tensor]:
    """The benchmark's loss (cross-entropy over the model's logits) as a closure."""

    def loss() -> torch.Tensor:
        logits = model(batch[0])
        return F.cross_entropy(logits.flatten(0, -2), batch[1])

    return loss


def check_same_gradients(variants: list[Variant], losses: list[Callable[[], torch.Tensor]]) -> None:
    """Every variant's gradients equal ``plain``'s bit for bit; a SystemExit naming the first
    parameter that differs otherwise."""
    results = []
    for variant, loss in zip(variants, losses):
        variant.clear()
        out = loss()
        variant.before_backward()
        out.backward()
        results.append(variant.grads())
        variant.clear()
    names = [name for name, p in variants[0].model.named_parameters() if p.requires_grad]
    for variant, grads in zip(variants[1:], results[1:]):
        for name, expected, got in zip(names, results[0], grads):
            if not torch.equal(expected, got):
                raise SystemExit(f"error: variant {variant.name}: the gradient of '{name}' differs from plain torch's")
        if "hook" in variant.name and variant.arrivals != len(variant.params):
            raise SystemExit(
                f"error: variant {variant.name}: {variant.arrivals} hook calls for {len(variant.params)} parameters"
            )


def measure(spec: ModelSpec, rounds: int, warmup: int) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    base = spec.build()
    batch = spec.batch_for(torch.Generator().manual_seed(0))
    variants = [Variant(name, copy.deepcopy(base)) for name in VARIANTS]
    losses = [make_loss(spec, v.model, batch) for v in variants]
    check_same_gradients(variants, losses)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for round_ in range(warmup + rounds):
        for variant, loss in zip(variants, losses):
            variant.clear()
            out = loss()
            started = time.thread_time()
            variant.before_backward()
            out.backward()
            spent = time.thread_time() - started
            if round_ >= warmup:
                times[variant.name].append(spent * 1e3)
    plain = statistics.median(times["plain"])
    figures = {}
    for name, samples in times.items():
        q1, _, q3 = statistics.quantiles(samples, n=4)
        median = statistics.median(samples)
        figures[name] = {"median_ms": median, "q1_ms": q1, "q3_ms": q3, "over_plain_ms": median - plain}
    return figures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="overhead", help="one of tools/bench.py's models (default overhead)")
    parser.add_argument("--rounds", type=int, default=300, help="timed backward passes per variant (default 300)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default 10)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    (spec,) = parse_models(args.model)
    figures = measure(spec, args.rounds, args.warmup)
    tensors = sum(1 for p in spec.build().parameters() if p.requires_grad)
    print(f"{spec.name}: {tensors} parameter tensors; backward, main-thread CPU ms, median of {args.rounds}")
    for name, row in figures.items():
        print(
            f"  {name:11s} {row['median_ms']:7.3f} (IQR {row['q1_ms']:.3f}-{row['q3_ms']:.3f})"
            f"  {row['over_plain_ms']:+.3f} over plain  ({row['over_plain_ms'] * 1e3 / tensors:+.2f} us a tensor)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"model": spec.name, "tensors": tensors, "variants": figures}, indent=1))


if __name__ == "__main__":
    main()
