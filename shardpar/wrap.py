"""``shardpar.wrap``: validate, agree across ranks, then build the stage's engine."""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn

from .checkpoint.dtypes import is_storable
from .comm import collectives as C
from .comm import devices as D
from .comm import process_group as PG
from .comm.sharding_groups import ShardingGroups, resolve_shard_group_size, sharding_groups
from .config import ShardConfig
from .core.deferred_init import DeferredInit, InitFn, materialise_whole
from .core.inventory import check_initialized, first_difference, model_signature, module_device, plain_state_entries
from .engines import WRAPPED_MARK, build_engine
from .facade import ShardedModule
from .planner import choose_plan

logger = logging.getLogger("shardpar")


def _build_config(module: Any, stage: Any, options: dict[str, Any]) -> tuple[ShardConfig, torch.device]:
    if isinstance(module, ShardedModule):
        raise ValueError("shardpar.wrap: this model is already wrapped (a ShardedModule); wrap the plain model once")
    if not isinstance(module, nn.Module):
        raise TypeError(f"shardpar.wrap needs a torch.nn.Module, got {type(module).__name__}")
    for name, sub in module.named_modules():
        if isinstance(sub, ShardedModule) or getattr(sub, WRAPPED_MARK, False):
            what = "this module" if not name else f"its submodule '{name}'"
            raise ValueError(
                f"shardpar.wrap: {what} is already wrapped by shardpar (its parameters live in an engine's "
                "buffers); wrap the plain model once, or wrap a fresh copy"
            )
    check_initialized(module)
    budget = options.pop("memory_budget", None)
    if stage == "auto" or budget is not None:
        if stage != "auto":
            raise ValueError(f"memory_budget is used with stage='auto' only, got stage={stage!r}")
        if budget is None:
            raise ValueError("stage='auto' needs memory_budget= (bytes per rank, or a string such as '24GB')")
        # The optimizer is not known yet: the planner assumes AdamW (8 bytes of state per element).
        planner_options = {
            k: options[k]
            for k in ("mixed_precision", "bucket_cap_mb", "wrap_policy", "min_unit_params", "align_for_bandwidth")
            if k in options
        }
        world_size = C.get_world_size() if C.is_initialized() else PG.launched_world_size()
        if planner_options.get("align_for_bandwidth") is None and not C.is_initialized():
            # The default group that wrap is about to create does not exist yet: align as its
            # backend will (NCCL for a CUDA model), so the plan counts the engine's padding.
            device = module_device(module)
            device = D.rank_device().device if device.type == "meta" else device  # its type picks the backend
            planner_options["align_for_bandwidth"] = world_size > 1 and PG.backend_for(device) == "nccl"
        plan = choose_plan(
            module,
            world_size,
            budget,
            shard_group_sizes=_fixed_shard_group_size(options, world_size),
            **planner_options,
        )
        stage = plan.stage
        if plan.shard_group_size not in (None, world_size) and options.get("mesh") is None:
            options.setdefault("shard_group_size", plan.shard_group_size)
        logger.info("shardpar.wrap(stage='auto'): %s", plan.reason)
    unknown = sorted(set(options) - set(ShardConfig.option_names()))
    if unknown:
        raise TypeError(
            f"shardpar.wrap got unknown option(s) {', '.join(unknown)}; "
            f"known options: {', '.join(n for n in ShardConfig.option_names() if n != 'stage')}"
        )
    config = ShardConfig(stage=stage, **options)
    _check_storable(module)
    return config, module_device(module)


def _fixed_shard_group_size(options: dict[str, Any], world_size: int) -> list[int] | None:
    """The shard group size the user fixed (``shard_group_size`` or a mesh), for the planner
    to plan with only that one; None lets it choose."""
    choice, mesh = options.get("shard_group_size"), options.get("mesh")
    if mesh is not None and hasattr(mesh, "size"):
        return [int(mesh.size(1))]
    if choice is None:
        return None
    return [resolve_shard_group_size(choice, world_size)]


def _check_storable(module: nn.Module) -> None:
    """Refuse at wrap, not at the first save hours later, a state-dict entry no checkpoint can
    hold (complex128: safetensors has no such dtype). Trainable dtypes are checked by the
    engine (real floating point only)."""
    for name, tensor in plain_state_entries(module).items():
        if not is_storable(tensor.dtype):
            kind = "parameter" if isinstance(tensor, nn.Parameter) else "buffer"
            raise ValueError(
                f"{kind} '{name}' has dtype {tensor.dtype}, which a safetensors checkpoint cannot store; "
                "keep it as a real view (torch.view_as_real) or in complex64, or register it as a "
                "non-persistent buffer"
            )


def _place(device: torch.device, deferred: bool, group: Any) -> torch.device:
    """Where the model trains, decided once the process group exists (it may be bound to a
    device, and a group wrap created has applied LOCAL_RANK): a meta-built model on this
    rank's device, any other where it is, checked against the rank's device and the group's
    backends ([Note: a rank's device] in ``shardpar/comm/devices.py``)."""
    if deferred:
        device = D.training_device(group)
    D.check_rank_device(device, group)
    return device


def _agree_across_ranks(
    problem: Exception | None, module: nn.Module, config: ShardConfig | None, group: Any, device: torch.device
) -> None:
    """One all-gather of every rank's local verdict and model signature; every rank raises
    the same error if any rank failed or differs, so no rank is left waiting in a collective.
    ``device`` is where this rank trains; after a problem, its own device (the model's may be
    the wrong one)."""
    # config is None only after a problem (the options could not be read)
    signature = model_signature(module, cast(ShardConfig, config).fingerprint()) if problem is None else None
    verdict = None if problem is None else f"{type(problem).__name__}: {problem}"
    if problem is not None and C.is_initialized():
        device = D.rank_device(group).device
    gathered = C.all_gather_objects((verdict, signature), group=group, device=device)
    rank = C.get_rank(group)
    for other, (other_verdict, _) in enumerate(gathered):
        if other_verdict is not None:
            if other == rank and problem is not None:
                raise problem
            raise ValueError(f"shardpar.wrap failed on rank {other}: {other_verdict}")
    reference = gathered[0][1]
    for other, (_, other_signature) in enumerate(gathered[1:], start=1):
        difference = first_difference(reference, other_signature)
        if difference is not None:
            raise ValueError(
                f"shardpar.wrap: the model or options differ between ranks (seen on rank {rank}): "
                + difference.format(rank=other)
            )


def _sharding(config: ShardConfig, group: Any) -> ShardingGroups | None:
    """Stages 1-3 with ``shard_group_size`` or ``mesh``: the shard and replica groups, agreed
    across ranks (a mismatch is an error on every rank; see [Note: sharding groups]). Stage 0
    shards nothing and ignores both."""
    if config.stage == 0 or (config.shard_group_size is None and config.mesh is None):
        return None
    sharding = sharding_groups(config.shard_group_size, mesh=config.mesh, group=group, timeout_s=config.timeout_s)
    if sharding.shard_size == 1 and sharding.world_size > 1:  # the same on every rank: all raise
        raise ValueError(
            f"{sharding.source} shards nothing at stage {config.stage}: every rank would hold everything and "
            "all-reduce every gradient over all ranks, which is stage 0 (DDP) with less work; use stage=0, or a "
            "shard group of more than one rank"
        )
    return sharding


def wrap(
    module: nn.Module, stage: int | str = 0, *, process_group: Any = None, init_fn: InitFn | None = None, **options: Any
) -> ShardedModule:
    """Train ``module`` data-parallel at ZeRO ``stage`` (0-3) on every rank of the job.

    Works without torchrun (world size 1); under torchrun it creates the default process
    group if the script has not. Every rank ends with rank 0's weights. Options are the
    fields of :class:`shardpar.ShardConfig` (``bucket_cap_mb``, ``mixed_precision``, ...).
    ``stage="auto"`` with ``memory_budget=`` (bytes per rank or e.g. ``"24GB"``) lets the
    planner pick the lowest stage whose estimate fits.

    A module built under ``torch.device("meta")`` is initialised here, one unit at a time at
    stage 3 (the full model never exists on a rank), as ``model.apply(init_fn)`` would on CPU
    (``init_fn=None``: each submodule's ``reset_parameters()``); see [Note: deferred
    initialisation] in ``shardpar/core/deferred_init.py``.
    """
    problem: Exception | None = None
    config: ShardConfig | None = None
    device = torch.device("cpu")
    deferred = False
    try:
        config, device = _build_config(module, stage, options)
        deferred = device.type == "meta"
        if init_fn is not None and not callable(init_fn):
            raise TypeError(f"init_fn must be a callable taking a module, got {type(init_fn).__name__}")
        if init_fn is not None and not deferred:
            raise ValueError(
                f"init_fn initialises a model built on the meta device (under `with torch.device('meta'):`), but this "
                f"model's parameters are on {device}; drop init_fn, or build the model on the meta device"
            )
    except (TypeError, ValueError) as error:
        problem = error
    # The backend of a group wrap creates follows the device type; the device itself is
    # chosen after, once the group exists.
    PG.init_default_group(
        D.rank_device().device if deferred else device,
        config.timeout_s if config is not None else ShardConfig.timeout_s,
    )
    if problem is None:
        try:
            device = _place(device, deferred, process_group)
        except (TypeError, ValueError) as error:
            problem = error
    _agree_across_ranks(problem, module, config, process_group, device)
    assert config is not None  # it raised on every rank after any problem, and only a problem leaves config None
    deferred_init = None
    if deferred and config.stage == 3:
        deferred_init = DeferredInit(init_fn, device)
    elif deferred:
        materialise_whole(module, init_fn, process_group, device)  # stages 0-2 keep every parameter anyway
    engine = build_engine(module, config, process_group, deferred_init, _sharding(config, process_group))
    return ShardedModule(module, engine)
