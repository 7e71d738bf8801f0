"""Rank functions and helpers shared by the checkpoint tests (module-level, so the harness
can ship them to its ranks).

The model is ``KitchenSink`` (tied embedding/head, a frozen parameter, a persistent and a
non-persistent buffer, an unused layer) trained with AdamW on two param groups whose
learning rates differ, so a parameter restored into the wrong group, a lost ``step`` or a
missing ``exp_avg`` all change the result.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from tests.support.models import KITCHEN
from tests.support.parity import Recipe, build_optimizer, cap_mb, global_batch, rank_slice

RECIPE = Recipe(KITCHEN, steps=4, clip=0.5)
K = 2
"""Steps before the save, and again after the load."""

WRAP_OPTIONS: dict[int, dict[str, Any]] = {
    0: {"bucket_cap_mb": cap_mb(100)},  # several buckets, so pieces split parameters
    1: {"bucket_cap_mb": cap_mb(100)},
    2: {"bucket_cap_mb": cap_mb(100)},
    3: {"wrap_policy": (nn.Linear,)},  # several units; the tied weight lives in the root
}


def build(
    stage: int,
    seed: int = 0,
    optimizer: str | None = None,
    recipe: Recipe = RECIPE,
    options: dict[str, Any] | None = None,
):
    """A fresh wrapped KitchenSink and its shardpar optimizer (``seed`` changes the init;
    ``options`` are wrap options on top of the stage's ``WRAP_OPTIONS``)."""
    module = dataclasses.replace(recipe.model, seed=seed).build()
    model = shardpar.wrap(module, stage=stage, **WRAP_OPTIONS[stage], **(options or {}))
    if optimizer is not None:
        recipe = recipe.with_(optimizer=optimizer)
    opt, _ = build_optimizer(recipe, model, lambda cls, params, **kw: shardpar.optimizer(model, cls, params, **kw))
    return module, model, opt


def train(module: nn.Module, model: Any, opt: Any, start: int, stop: int, recipe: Recipe = RECIPE) -> None:
    """Steps ``start..stop-1`` of the recipe's data on this rank's slices."""
    rank, world_size = C.get_rank(), C.get_world_size()
    for step in range(start, stop):
        x, y = global_batch(module, recipe, step)
        module.loss(model(rank_slice(x, rank, world_size)), rank_slice(y, rank, world_size)).backward()
        model.clip_grad_norm_(recipe.clip)
        opt.step()
        opt.zero_grad()


def full_optimizer_state(opt: Any) -> dict[str, Any]:
    """``{param: {key: full tensor | value}}`` plus ``"groups"`` (hyperparameters), the same on
    every rank, assembled from every rank's pieces: what the optimizer state *means*,
    independent of stage and world size."""
    mine = []
    for tensors in opt.pieces():
        for piece in tensors:
            for key, value in opt.state_of(piece).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == piece.tensor.numel():
                    mine.append((piece.name, key, piece.param_range, value.detach().reshape(-1).clone()))
                else:
                    mine.append((piece.name, key, None, value.item() if isinstance(value, torch.Tensor) else value))
    numel = {name: p.numel() for name, p in opt.engine.named_params}
    full: dict[str, Any] = {}
    for listed in C.all_gather_objects(mine):
        for name, key, param_range, value in listed:
            per = full.setdefault(name, {})
            if param_range is None:
                per[key] = value
            else:
                per.setdefault(key, torch.full((numel[name],), float("nan"), dtype=value.dtype))
                per[key][param_range[0] : param_range[1]] = value
    full["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return full


def save_run(
    stage: int, path: str, steps: int = K, options: dict[str, Any] | None = None, async_save: bool = False
) -> dict[str, Any]:
    """Train ``steps`` steps, save; return what was saved (model and optimizer, in full)."""
    module, model, opt = build(stage, options=options)
    train(module, model, opt, 0, steps)
    handle = shardpar.save_checkpoint(
        path, model, opt, extra={"step": steps, "note": "resume me"}, async_save=async_save
    )
    saved = {"model": model.full_state_dict(), "optimizer": full_optimizer_state(opt)}  # collectives, while it writes
    handle.wait()
    return saved


def load_run(stage: int, path: str, steps: int = K, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load into a fresh, differently initialised model; train ``steps`` more."""
    module, model, opt = build(stage, seed=7, options=options)
    extra = shardpar.load_checkpoint(path, model, opt)
    loaded = {"model": model.full_state_dict(), "optimizer": full_optimizer_state(opt), "extra": extra}
    train(module, model, opt, extra["step"], extra["step"] + steps)
    loaded["final"] = model.full_state_dict()
    return loaded


def try_load(stage: int, path: str) -> str:
    """Load, returning the error message (so every rank's outcome reaches the test)."""
    _, model, opt = build(stage)
    try:
        shardpar.load_checkpoint(path, model, opt)
    except shardpar.CheckpointError as error:
        return f"CheckpointError: {error}"
    return "loaded"


def save_full_run(stage: int, path: str, max_shard_size: str, dtype: str | None) -> dict[str, torch.Tensor]:
    module, model, opt = build(stage)
    train(module, model, opt, 0, 1)
    files = shardpar.save_full(path, model, max_shard_size=max_shard_size, dtype=dtype)
    return {"files": files, "state": model.full_state_dict()}


def assert_equal_states(actual: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    """Bitwise equality of nested dicts of tensors and values."""
    assert actual.keys() == expected.keys(), f"{what}: keys {sorted(actual)} vs {sorted(expected)}"
    for key, value in expected.items():
        other = actual[key]
        if isinstance(value, dict):
            assert_equal_states(other, value, f"{what}/{key}")
        elif isinstance(value, torch.Tensor):
            assert other.dtype == value.dtype and torch.equal(other, value), f"{what}/{key} differs"
        else:
            assert other == value, f"{what}/{key}: {other!r} vs {value!r}"
