"""Parity helpers: train the same model on the same data with plain torch and with shardpar.

[Note: the parity contract]
DESIGN.md: "same data, same seed: stages 0-3 at any world size produce the same parameters
as one process training on the concatenated batch (fp32: within 1e-5 relative)". So:

- the data of step ``s`` is a *global* batch drawn from a generator seeded with
  ``(data_seed, s, index)`` only; every rank and the reference draw the same one, and rank
  ``r`` of ``N`` trains on rows ``[r·B/N, (r+1)·B/N)`` of it;
- the reference is one plain torch model trained on the whole global batch (mean loss); the
  mean over the global batch is the mean of the per-rank means over equal slices, which is
  what shardpar's "divide by N, then sum" computes;
- a model whose control flow depends on each rank's data (``KitchenSink(branches=True)``)
  is compared with a reference that runs forward once per rank slice and averages the slice
  losses (``chunked_reference``), which is the same mathematical objective;
- the measure is the relative error ``max|a - b| / max|b|`` per tensor, at most 1e-5 (fp32
  sums in a different order differ by a few ulps; 1e-5 leaves room for a few optimizer steps
  without hiding a wrong scale, a missing rank or a stale gradient, which all show at >=1e-3).

[Note: unused parameters]
A trainable parameter that took part in no backward on any rank since ``zero_grad`` keeps
``.grad = None`` under plain torch, and its optimizer skips it (no weight decay, no moment
update). shardpar does the same ([Note: used parameters] in ``shardpar/core/gradient_ledger.py``), so
the reference is plain torch as it is; a parameter used on some ranks only gets the average
with the other ranks counting zero, which the chunked reference computes the same way.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks
from tests.support.models import ModelSpec, param_groups

TOLERANCE = 1e-5


@dataclass(frozen=True)
class Recipe:
    """One training run, described so that the harness can ship it to the ranks."""

    model: ModelSpec
    steps: int = 3
    optimizer: str = "AdamW"
    """Name of a ``torch.optim`` class."""
    lr: float = 1e-2
    optimizer_options: tuple[tuple[str, Any], ...] = ()
    groups: bool = True
    """Two param groups (``tests.support.models.param_groups``) instead of one."""
    exclude_from_decay: tuple[str, ...] = ()
    clip: float | None = 1.0
    micro_batches: int = 1
    """> 1: shardpar accumulates that many micro-batches (all but the last under
    ``no_sync``, loss divided by their number); the reference takes one step on their
    concatenation."""
    backwards: int = 1
    """> 1: that many forward+backward passes per step without ``no_sync`` and without a
    step between them; the reference does the same (gradients add up)."""
    scheduler: str | None = None
    """None, "step" (StepLR, halving each step) or "lambda" (LambdaLR, 1/(1+step))."""
    chunked_reference: bool = False
    global_batch: int = 12
    """Divisible by 1, 2, 3 and 4."""
    zero_grad: str = "optimizer"
    """How gradients are cleared after each step: "optimizer" (``opt.zero_grad()``),
    "model" (``model.zero_grad()``, set_to_none) or "module" (``nn.Module.zero_grad`` of the
    wrapped model itself)."""
    data_seed: int = 1234

    def with_(self, **changes: Any) -> Recipe:
        return Recipe(**{**self.__dict__, **changes})


@dataclass
class Result:
    state: dict[str, torch.Tensor]
    norms: list[float] = field(default_factory=list)
    lrs: list[list[float]] = field(default_factory=list)
    """Per step, the lr of every (inner, for shardpar) param group when ``step()`` ran."""
    extra: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- data


def global_batch(model: nn.Module, recipe: Recipe, step: int, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch number ``index`` of step ``step``: a function of the seeds only."""
    generator = torch.Generator().manual_seed(recipe.data_seed * 1_000_003 + step * 1009 + index)
    return model.example(recipe.global_batch, generator)


def rank_slice(tensor: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = tensor.shape[0] // world_size
    assert size * world_size == tensor.shape[0], "global batch must split evenly"
    return tensor[rank * size : (rank + 1) * size]


# --------------------------------------------------------------------------- optimizers


def build_optimizer(recipe: Recipe, model: nn.Module, make: Callable[..., torch.optim.Optimizer]) -> tuple[Any, Any]:
    """``make(optimizer_class, params, **defaults)`` builds the optimizer (plain or shardpar);
    returns it and its scheduler (or None)."""
    cls = getattr(torch.optim, recipe.optimizer)
    params = (
        param_groups(model, lr=recipe.lr, exclude_from_decay=recipe.exclude_from_decay)
        if recipe.groups
        else [p for p in model.parameters() if p.requires_grad]
    )
    opt = make(cls, params, lr=recipe.lr, **dict(recipe.optimizer_options))
    if recipe.scheduler is None:
        scheduler = None
    elif recipe.scheduler == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    elif recipe.scheduler == "lambda":
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
    else:
        raise ValueError(recipe.scheduler)
    return opt, scheduler


# --------------------------------------------------------------------------- reference


def train_reference(recipe: Recipe, world_size: int = 1) -> Result:
    """Plain torch, one process, the whole global batch (``world_size`` only matters for a
    ``chunked_reference``)."""
    model = recipe.model.build()
    model.train()
    opt, scheduler = build_optimizer(recipe, model, lambda cls, params, **kw: cls(params, **kw))
    result = Result(state={})
    for step in range(recipe.steps):
        if recipe.micro_batches > 1:
            parts = [global_batch(model, recipe, step, i) for i in range(recipe.micro_batches)]
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            model.loss(model(x), y).backward()
        else:
            for index in range(recipe.backwards):
                x, y = global_batch(model, recipe, step, index)
                if recipe.chunked_reference:
                    losses = [
                        model.loss(model(rank_slice(x, r, world_size)), rank_slice(y, r, world_size))
                        for r in range(world_size)
                    ]
                    loss = torch.stack(losses).mean()
                else:
                    loss = model.loss(model(x), y)
                loss.backward()
        if recipe.clip is not None:
            result.norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.clip)))
        result.lrs.append([g["lr"] for g in opt.param_groups])
        opt.step()
        if scheduler is not None:
            scheduler.step()
        opt.zero_grad(set_to_none=True)
    result.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return result


@functools.cache
def reference(recipe: Recipe, world_size: int = 1) -> Result:
    """Cached :func:`train_reference`; the world size only matters for chunked references."""
    return train_reference(recipe, world_size if recipe.chunked_reference else 1)


# --------------------------------------------------------------------------- shardpar


def train_sharded(
    recipe: Recipe,
    stage: int,
    wrap_options: tuple[tuple[str, Any], ...] = (),
    between_backward_and_step: Callable[[Any, Any, Result], None] | None = None,
) -> Result:
    """Train with shardpar on this rank (world size 1 without a process group, or a rank of
    the harness); every rank returns its own view of the result."""
    rank, world_size = C.get_rank(), C.get_world_size()
    module = recipe.model.build()
    model = shardpar.wrap(module, stage=stage, **dict(wrap_options))
    model.train()
    opt, scheduler = build_optimizer(
        recipe, model, lambda cls, params, **kw: shardpar.optimizer(model, cls, params, **kw)
    )
    result = Result(state={})
    result.extra["at_wrap"] = describe(model)  # the layout before the first backward rebuilds the buckets
    result.extra["memory_after_backward"] = []
    result.extra["padding_after_backward"] = []
    for step in range(recipe.steps):
        if recipe.micro_batches > 1:
            for index in range(recipe.micro_batches):
                x, y = global_batch(module, recipe, step, index)
                last = index == recipe.micro_batches - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
                    (module.loss(model(x), y) / recipe.micro_batches).backward()
        else:
            for index in range(recipe.backwards):
                x, y = global_batch(module, recipe, step, index)
                x, y = rank_slice(x, rank, world_size), rank_slice(y, rank, world_size)
                module.loss(model(x), y).backward()
        result.extra["memory_after_backward"].append(model.memory_stats())
        result.extra["padding_after_backward"].append(padding_magnitude(model))
        if between_backward_and_step is not None:
            between_backward_and_step(model, opt, result)
        if recipe.clip is not None:
            result.norms.append(float(model.clip_grad_norm_(recipe.clip)))
        result.lrs.append([g["lr"] for g in opt.inner.param_groups])
        opt.step()
        if scheduler is not None:
            scheduler.step()
        if recipe.zero_grad == "optimizer":
            opt.zero_grad()
        elif recipe.zero_grad == "model":
            model.zero_grad(set_to_none=True)
        elif recipe.zero_grad == "module":
            module.zero_grad(set_to_none=True)
        else:
            raise ValueError(recipe.zero_grad)
    result.state = model.full_state_dict()
    result.extra.update(describe(model))
    result.extra["comm"] = model.comm_stats()
    result.extra["memory"] = model.memory_stats()
    return result


def describe(model: Any) -> dict[str, Any]:
    """Closed-form inputs of the byte/memory formulas, read from the engine's layouts."""
    engine = model.engine
    layouts = [space.layout for space in engine.storage.spaces]  # the trainable parameters' layouts
    # A rank owns its slice within its shard group (all ranks unless hybrid sharding).
    pieces = [piece for layout in layouts for piece in layout.pieces(engine.shards.shard_rank)]
    return {
        "psi": sum(p.numel() for _, p in engine.trainable),
        "frozen_numel": sum(p.numel() for _, p in engine.frozen),
        "padding": sum(layout.padding for layout in layouts),
        "numel": sum(layout.numel for layout in layouts),
        "shard_numel": sum(layout.shard_numel for layout in layouts),
        "bucket_numels": [b.range.size for layout in layouts for b in layout.buckets],
        "bucket_names": [list(b.names) for layout in layouts for b in layout.buckets],
        "bucket_payloads": [
            sum(layout.slots[name].range.size for name in b.names) for layout in layouts for b in layout.buckets
        ],
        "local_numel": sum(piece.buffer_range.size for piece in pieces),
        "local_pieces": len(pieces),
        "local_numel_by_param": {piece.name: piece.buffer_range.size for piece in pieces},
        "rank": engine.rank,
        "world_size": engine.world_size,
    }


def _padding_masks(layout: Any, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """True where a buffer laid out by ``layout`` holds padding: in buffer space (no slot
    covers the element) and in this rank's local space (no piece does)."""
    full = torch.ones(layout.numel, dtype=torch.bool)
    for slot in layout.slots.values():
        full[slot.range.start : slot.range.end] = False
    local = torch.ones(layout.shard_numel, dtype=torch.bool)
    for piece in layout.pieces(rank):
        local[piece.local_range.start : piece.local_range.end] = False
    return full, local


def padding_magnitude(model: Any) -> tuple[float, int]:
    """The largest ``|value|`` in the padding of any buffer this rank holds for its trainable
    parameters (values, master copies and gradients, full or sharded), and how many buffers
    were looked at. Padding must stay zero: it is reduced, gathered and clipped with the rest."""
    engine = model.engine
    largest, looked_at = 0.0, 0
    for space in engine.storage.spaces:  # stage 0-2 buffers, stage-3 trainable flat groups
        full_mask, local_mask = _padding_masks(space.layout, engine.shards.shard_rank)
        tensors = [getattr(space, name, None) for name in ("data", "full", "shard")]
        master = getattr(engine.storage, "master", None)  # stages 0-2: the full-precision copies and shards
        tensors += [(getattr(master, name, None) or {}).get(space) for name in ("copies", "full", "shards")]
        tensors += [
            (getattr(engine.strategy, name, None) or {}).get(space)
            for name in ("grad_buffers", "master_grads", "master_grad_shards", "grad_shards", "_accumulated", "_carry")
        ]
        for tensor in tensors:
            if tensor is None or tensor.untyped_storage().nbytes() == 0:  # a freed stage-3 full buffer
                continue
            mask = full_mask if tensor.numel() == space.layout.numel else local_mask
            assert tensor.numel() == mask.numel(), "a buffer of neither the full nor the shard size"
            if mask.any():
                largest = max(largest, tensor.detach().float()[mask].abs().max().item())
            looked_at += 1
    return largest, looked_at


def closed_form_buckets(numels: list[int], world_size: int, cap: int | None, aligned: bool) -> list[tuple[int, int]]:
    """``(size, payload)`` of every bucket a layout of tensors of ``numels`` elements (in this
    order) has, written out from [Note: alignment] and [Note: layout order] without
    ``BufferLayout``: aligned, each tensor starts at the next multiple of 64 elements and a
    bucket's size is a multiple of lcm(N, 128); dense, tensors are back to back and a bucket
    is a multiple of N. A tensor that would take a non-empty bucket past ``cap`` elements
    (counting the gaps in front of its tensors) starts the next bucket."""
    align, multiple = (64, math.lcm(world_size, 128)) if aligned else (1, world_size)
    limit = math.inf if cap is None else cap
    buckets: list[tuple[int, int]] = []
    start, end, payload, count = 0, 0, 0, 0  # the open bucket: start, end of its last tensor, ...
    for numel in numels:
        at = math.ceil(end / align) * align
        if count and at - start + numel > limit:
            buckets.append((math.ceil((end - start) / multiple) * multiple, payload))
            start = end = at = start + buckets[-1][0]
            payload = count = 0
        end, payload, count = at + numel, payload + numel, count + 1
    if count:
        buckets.append((math.ceil((end - start) / multiple) * multiple, payload))
    return buckets


def closed_form_padding(numels: list[int], world_size: int, cap: int | None, aligned: bool) -> int:
    """Padding elements of :func:`closed_form_buckets`."""
    return sum(size - payload for size, payload in closed_form_buckets(numels, world_size, cap, aligned))


def run(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list[Any]:
    """``fn`` on every rank; world size 1 runs in this process without any process group."""
    if world_size == 1:
        return [fn(*args, **kwargs)]
    return run_ranks(fn, world_size, *args, timeout=timeout, **kwargs)


# --------------------------------------------------------------------------- comparison


def relative_to_oracle(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max|got - want| / max|want|`` in float64, the scale floored at 1e-12 (the integration
    tests' measure against a framework's DDP run)."""
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-12)).item()


def assert_params_close(got: dict, want: dict, tolerance: float, what: str) -> None:
    """Same names and dtypes, and every tensor within ``tolerance`` of the oracle's (relative)."""
    assert got.keys() == want.keys(), what
    for name in want:
        assert got[name].dtype == want[name].dtype, f"{what}: {name} is {got[name].dtype}, not {want[name].dtype}"
        error = relative_to_oracle(got[name], want[name])
        assert error <= tolerance, f"{what}: {name} differs from the oracle by {error:.2e} (relative)"


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``max|a - b| / max|b|`` (absolute error where ``b`` is all zeros)."""
    if not actual.is_floating_point():
        return 0.0 if torch.equal(actual, expected) else math.inf
    diff = (actual.double() - expected.double()).abs().max().item()
    scale = expected.double().abs().max().item()
    return diff / scale if scale > 0 else diff


def assert_states_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float = TOLERANCE, what: str = ""
) -> None:
    assert list(actual) == list(expected), f"{what}: keys differ: {list(actual)} vs {list(expected)}"
    errors = {}
    for name, tensor in expected.items():
        assert actual[name].shape == tensor.shape, (
            f"{what}: {name} has shape {actual[name].shape}, expected {tensor.shape}"
        )
        errors[name] = rel_error(actual[name], tensor)
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"{what}: relative error above {tol:g}: " + ", ".join(f"{n}={e:.3g}" for n, e in bad.items())


def assert_ranks_identical(results: list[Result], what: str = "") -> None:
    """Parameters are complete and equal on every rank after ``step()``."""
    for rank, result in enumerate(results[1:], start=1):
        for name, tensor in results[0].state.items():
            assert torch.equal(result.state[name], tensor), f"{what}: '{name}' differs between rank 0 and rank {rank}"


def assert_close_values(actual: list[float], expected: list[float], tol: float = TOLERANCE, what: str = "") -> None:
    assert len(actual) == len(expected), f"{what}: {actual} vs {expected}"
    for a, b in zip(actual, expected):
        assert abs(a - b) <= tol * abs(b), f"{what}: {actual} vs {expected}"


def check_parity(results: list[Result], recipe: Recipe, world_size: int, what: str = "") -> None:
    """Every rank equal, and equal to the plain-torch reference (params, buffers, norms)."""
    assert_ranks_identical(results, what)
    expected = reference(recipe, world_size)
    assert_states_close(results[0].state, expected.state, what=what)
    for rank, result in enumerate(results):
        assert_close_values(result.norms, expected.norms, what=f"{what}: clip norms on rank {rank}")


@functools.cache
def sharded(
    recipe: Recipe, stage: int, world_size: int, wrap_options: tuple[tuple[str, Any], ...] = ()
) -> list[Result]:
    """Cached per-rank results of :func:`train_sharded`, so several tests can check
    different properties of one run without paying for it again."""
    return run(train_sharded, world_size, recipe, stage, wrap_options)


def cap_mb(numel: int) -> float:
    """``bucket_cap_mb`` that makes the bucket cap exactly ``numel`` fp32 elements."""
    return numel * 4 / 2**20
