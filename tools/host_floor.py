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
- ``builtin-hook``: the same hook as a C function, no Python frame
  (``functools.partial(arrivals.__setitem__, index)``): what is left of the hook's price
  when its body costs nothing, i.e. autograd's own call into Python;
- ``views``: before backward the flat buffer is zeroed (one ``zero_``) and each ``.grad`` set to
  its view of it, so autograd adds every gradient into the buffer in place (DDP's
  ``gradient_as_bucket_view``; shardpar's [Note: gradients accumulate in the buffer] in
  shardpar/core/reducer.py);
- ``hook+views``: both, the least a reducer of this kind can pay: shardpar's stages 0-1 add
  their bookkeeping on top (the counting in each hook, the launch, the end of backward);
- ``prehook+hook+views``: that and a tensor hook per parameter that runs before accumulation
  and does nothing: the least stage 1 pays, whose loud ``.grad`` placeholders must come off
  before anything accumulates into them, by that hook where a backward reaches a parameter
  first ([Note: no full gradients at stages 1-3] in shardpar/core/grad_placeholders.py);
- ``prehook+hook+copy``: no full gradient buffer; each gradient, once accumulated, copied into
  its slot of a flat staging buffer and ``.grad`` released, and the pre-accumulation hook: the
  least stage 2's gradient path pays;
- ``units``: FSDP2's mechanism per block of the model (``ModelSpec.unit_class``) at its
  leanest, with no collective: each block's parameters are views of one flat full buffer
  whose storage is freed after the block's forward and given back before its backward
  (``untyped_storage().resize_``) and filled from a flat shard by one ``copy_`` (a world-1
  all-gather), a forward pre-hook and a forward hook per block, the block's input through an
  identity autograd function whose backward ends the block's backward (frees the buffer, and
  copies the block's gradients into a flat buffer by one ``_foreach_copy_``), a tensor hook
  on its output that starts it: the least stage 3's per-unit work can cost in Python hooks.
  Its forward is timed too (every other variant's forward is plain torch's);
- ``guarded-units``: ``units`` and, at their leanest, the guarantees stage 3 keeps on top of
  that mechanism: while a block is sharded each parameter is of a guarding subclass (one
  ``__class__`` switch at each free and each gather: an operation on it raises; a kernel that
  gets past the class finds no storage, as in ``units``, where the parameters are views of
  the freed buffer), each gather carries a tag checked on completion
  (rank agreement), each parameter a post-accumulate-grad hook that marks it used (the
  used flags that unused parameters and ``RanksOutOfStep`` rest on), and the block's
  gradients go on into a gradient shard (a world-1 reduce-scatter: one ``torch.mul`` by
  1/N). No bookkeeping beyond: what is left between this and shardpar's stage 3 is its own
  Python. ``--leave-out GUARANTEE`` (repeatable; one of ``GUARANTEES``) takes one out, to
  price each.

Before timing, every variant's gradients are checked to equal ``plain``'s bit for bit (a
variant that changed them would be measuring something else). One process, no
process group. Prints one line per variant: the median backward in ms, its interquartile
range, and the difference from ``plain``'s median, then the median forward + backward and
its difference; ``--json PATH`` writes the same figures.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from benchkit.models import ModelSpec, parse_models  # noqa: E402
from torch import nn  # noqa: E402

GUARANTEES = ("guards", "tags", "used-flags", "reduce-scatter")
"""What ``guarded-units`` keeps on top of ``units`` (see the module docstring), in that order."""

VARIANTS = (
    "plain",
    "hook",
    "builtin-hook",
    "views",
    "hook+views",
    "prehook+hook+views",
    "prehook+hook+copy",
    "units",
    "guarded-units",
)


class Variant:
    """One copy of the model with one variant's gradient mechanism: ``before_backward`` runs
    just before each backward, inside the timed span."""

    def __init__(
        self, name: str, model: nn.Module, unit_class: type[nn.Module], guarantees: tuple[str, ...] = GUARANTEES
    ) -> None:
        self.name, self.model = name, model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.arrivals = 0
        self.buffer = torch.zeros(sum(p.numel() for p in self.params))
        self.views, offset = [], 0
        for param in self.params:
            self.views.append(self.buffer[offset : offset + param.numel()].view_as(param))
            offset += param.numel()
        self.slots = {param: view for param, view in zip(self.params, self.views)}
        self.arrived: dict[int, nn.Parameter] = {}
        """Index -> parameter, filled by the ``builtin-hook`` variant's hooks (which cannot
        count: each backward writes the same keys again)."""
        after_accumulation = {"prehook+hook+copy": self._copy_out}.get(name, self._count)
        for index, param in enumerate(self.params):
            if name.startswith("prehook"):
                param.register_hook(_nothing)
            if name == "builtin-hook":
                param.register_post_accumulate_grad_hook(functools.partial(self.arrived.__setitem__, index))
            elif "hook" in name:
                param.register_post_accumulate_grad_hook(after_accumulation)
        kept = frozenset(guarantees if name == "guarded-units" else ())
        self.used = bytearray(len(self.params))
        """The used flags, set by the ``guarded-units`` variant's hooks."""
        if "used-flags" in kept:
            for index, param in enumerate(self.params):
                param.register_post_accumulate_grad_hook(functools.partial(self._mark_used, index))
        self.units = (
            [UnitGathers(m, self, kept) for m in model.modules() if isinstance(m, unit_class)]
            if name.endswith("units")
            else []
        )
        if self.units:  # each block's gradients, not the head's
            self.expected_arrivals = sum(len(unit.params) for unit in self.units)
        else:
            self.expected_arrivals = len(self.params) if "hook" in name else 0
        """Gradients its hooks count in one backward."""

    def _count(self, param: nn.Parameter) -> None:
        self.arrivals += 1

    def _mark_used(self, index: int, param: nn.Parameter) -> None:
        self.used[index] = 1

    def _copy_out(self, param: nn.Parameter) -> None:
        self.arrivals += 1
        assert param.grad is not None
        self.slots[param].copy_(param.grad)
        param.grad = None

    def clear(self) -> None:
        for param in self.params:
            param.grad = None

    def before_backward(self) -> None:
        if "views" in self.name:
            self.buffer.zero_()
            for param, view in zip(self.params, self.views):
                param.grad = view

    def grads(self) -> list[torch.Tensor]:
        if self.name == "prehook+hook+copy":  # the gradients are in the flat buffer
            return [view.clone() for view in self.views]
        if self.units:  # the blocks' gradients are; the rest (the head's) on .grad
            in_units = {p for unit in self.units for p in unit.params}
            return [self.slots[p].clone() if p in in_units else p.grad.clone() for p in self.params]
        return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]


def _nothing(grad: torch.Tensor) -> None:
    return None


class _EndOfUnitBackward(torch.autograd.Function):
    """Identity on a block's input; its backward runs once the block's backward is over (the
    parameters' gradients accumulated first: autograd runs AccumulateGrad nodes first)."""

    @staticmethod
    def forward(ctx: Any, unit: UnitGathers, x: torch.Tensor) -> torch.Tensor:
        ctx.unit = unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        ctx.unit.after_backward()
        return None, grad


class _Sharded(nn.Parameter):
    """The guarding class of a sharded parameter (``guarded-units``): an operation on it
    raises; its attributes (``.grad``, ``.shape``) stay readable, as shardpar's guard keeps
    metadata readable."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") not in ("__get__", "__set__"):
            raise RuntimeError(f"read a sharded parameter ({getattr(func, '__name__', func)})")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class UnitGathers:
    """One block under the ``units`` variant, or with ``guarantees`` (some of
    ``GUARANTEES``) the ``guarded-units`` one (see the module docstring)."""

    def __init__(self, block: nn.Module, variant: Variant, guarantees: frozenset[str] = frozenset()) -> None:
        self.params = [p for p in block.parameters() if p.requires_grad]
        self.variant = variant
        # Asked once per gather or free, outside the loops over parameters.
        self.guards, self.tags, self.reduce_scatter = (g in guarantees for g in ("guards", "tags", "reduce-scatter"))
        self.shard = torch.cat([p.detach().reshape(-1) for p in self.params])
        self.full = torch.empty_like(self.shard)
        offset = 0
        for param in self.params:
            param.data = self.full[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
        self.grad_slots = [variant.slots[p] for p in self.params]
        start = self.grad_slots[0].storage_offset()
        self.grad_flat = variant.buffer[start : start + self.shard.numel()]
        """The block's gradients in the flat buffer (its parameters' slots are consecutive)."""
        assert self.grad_slots[-1].storage_offset() + self.grad_slots[-1].numel() == start + self.shard.numel()
        self.grad_shard = torch.empty_like(self.shard)
        """This rank's gradient shard of the block (world 1: all of it)."""
        self.storage_bytes = self.full.untyped_storage().nbytes()
        self.sequence = 0
        """The tag of the next gather (a sequence number every rank counts alike)."""
        self.tag = torch.zeros(2, dtype=torch.int64)
        """Where a gather's tag lands, every rank's (one here): the group and the sequence number."""
        self.tag_sequence = self.tag[1:]
        """The sequence number's place in the tag (a view made once: the write is one ``fill_``)."""
        self.free()
        self.input_has_grad = True
        """Whether the block's input of the last forward needs a gradient (the first block's
        does not: its backward ends with the whole backward's, in a callback)."""
        block.register_forward_pre_hook(self._pre_forward)
        block.register_forward_hook(self._post_forward)

    def gather(self) -> None:
        self.full.untyped_storage().resize_(self.storage_bytes)
        self.full.copy_(self.shard)
        if self.tags:
            expected = self.sequence
            self.sequence += 1
            self.tag_sequence.fill_(expected)
            if self.tag.tolist() != [0, expected]:  # every rank's tag (one here) is this rank's
                raise RuntimeError(f"gather {expected}: ranks out of step")
        if self.guards:
            for param in self.params:
                param.__class__ = nn.Parameter

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)
        if self.guards:
            for param in self.params:
                param.__class__ = _Sharded

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        self.gather()
        self.input_has_grad = args[0].requires_grad
        if not self.input_has_grad:
            return None
        return (_EndOfUnitBackward.apply(self, args[0]),) + args[1:]

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> None:
        self.free()
        output.register_hook(self._pre_backward)

    def _pre_backward(self, grad: torch.Tensor) -> None:
        self.gather()
        if not self.input_has_grad:
            torch.autograd.Variable._execution_engine.queue_callback(self.after_backward)

    def after_backward(self) -> None:
        params = self.params
        torch._foreach_copy_(self.grad_slots, [p.grad for p in params])
        for param in params:
            param.grad = None
        self.variant.arrivals += len(params)
        if self.reduce_scatter:
            torch.mul(self.grad_flat, 1.0, out=self.grad_shard)  # the reduce-scatter, at world 1
        self.free()  # after the gradients are taken: a guarded parameter's .grad costs a Python call


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
        counted = variant.arrivals + len(variant.arrived)
        if counted != variant.expected_arrivals:
            raise SystemExit(
                f"error: variant {variant.name}: {counted} gradients counted, {variant.expected_arrivals} expected"
            )


def measure(
    spec: ModelSpec, rounds: int, warmup: int, guarantees: tuple[str, ...] = GUARANTEES
) -> dict[str, dict[str, float]]:
    torch.manual_seed(0)
    base = spec.build()
    batch = spec.batch_for(torch.Generator().manual_seed(0))
    variants = [Variant(name, copy.deepcopy(base), spec.unit_class, guarantees) for name in VARIANTS]
    losses = [make_loss(spec, v.model, batch) for v in variants]
    check_same_gradients(variants, losses)
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    both: dict[str, list[float]] = {v.name: [] for v in variants}
    for round_ in range(warmup + rounds):
        for variant, loss in zip(variants, losses):
            variant.clear()
            began = time.thread_time()
            out = loss()
            started = time.thread_time()
            variant.before_backward()
            out.backward()
            ended = time.thread_time()
            if round_ >= warmup:
                times[variant.name].append((ended - started) * 1e3)
                both[variant.name].append((ended - began) * 1e3)
    plain, plain_both = statistics.median(times["plain"]), statistics.median(both["plain"])
    figures = {}
    for name, samples in times.items():
        q1, _, q3 = statistics.quantiles(samples, n=4)
        median, median_both = statistics.median(samples), statistics.median(both[name])
        figures[name] = {
            "median_ms": median,
            "q1_ms": q1,
            "q3_ms": q3,
            "over_plain_ms": median - plain,
            "forward_backward_ms": median_both,
            "forward_backward_over_plain_ms": median_both - plain_both,
        }
    return figures


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="overhead", help="one of tools/bench.py's models (default overhead)")
    parser.add_argument("--rounds", type=int, default=300, help="timed backward passes per variant (default 300)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first (default 10)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--leave-out",
        action="append",
        default=[],
        choices=GUARANTEES,
        metavar="GUARANTEE",
        help=f"take this guarantee out of guarded-units (repeatable; one of {', '.join(GUARANTEES)})",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    (spec,) = parse_models(args.model)
    guarantees = tuple(g for g in GUARANTEES if g not in args.leave_out)
    figures = measure(spec, args.rounds, args.warmup, guarantees)
    tensors = sum(1 for p in spec.build().parameters() if p.requires_grad)
    print(f"{spec.name}: {tensors} parameter tensors; backward, main-thread CPU ms, median of {args.rounds}")
    if args.leave_out:
        print(f"  (guarded-units without {', '.join(g for g in GUARANTEES if g not in guarantees)})")
    for name, row in figures.items():
        print(
            f"  {name:17s} {row['median_ms']:7.3f} (IQR {row['q1_ms']:.3f}-{row['q3_ms']:.3f})"
            f"  {row['over_plain_ms']:+.3f} over plain  ({row['over_plain_ms'] * 1e3 / tensors:+.2f} us a tensor)"
            f"   forward+backward {row['forward_backward_ms']:7.3f}  {row['forward_backward_over_plain_ms']:+.3f} over plain"
        )
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"model": spec.name, "tensors": tensors, "guarantees": list(guarantees), "variants": figures}, indent=1
            )
        )


if __name__ == "__main__":
    main()
