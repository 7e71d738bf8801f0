"""What the Trainer's and Fabric's strategies share: their options, the wrap (of a model built
on the meta device too), the optimizer brought over from torch, the process group, and the
training state that rides in a checkpoint's manifest.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.utilities.device_dtype_mixin import _update_properties
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import nn

from ...checkpoint import save_checkpoint
from ...checkpoint.format import read_manifest
from ...checkpoint.json_values import decode_tree, encode_tree
from ...checkpoint.protocol import agree
from ...comm import collectives as C
from ...comm import process_group as PG
from ...config import ShardConfig
from ...errors import CheckpointError
from ...facade import ShardedModule
from ...optim import ShardedOptimizer
from ...wrap import wrap
from ..shared import check_wrap_options, shard_optimizer
from .precision import PrecisionSpec

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment

__all__ = [
    "DistributedParts",
    "SavedState",
    "WrapOptions",
    "decode_state",
    "encode_state",
    "read_saved_state",
    "save_with_state",
    "shard_optimizer",
]

STATE_KEY = "lightning"
"""The key of the manifest's ``extra`` under which a strategy keeps the framework's state."""


@dataclass(frozen=True)
class WrapOptions:
    """``shardpar.wrap``'s arguments as a strategy takes them, checked when it is made (a
    misspelt option fails at ``ShardparStrategy(...)``, not minutes later at ``fit``)."""

    stage: int | str = 0
    init_fn: Callable[[nn.Module], Any] | None = None
    """How modules built on the meta device get their values (``shardpar.wrap``'s
    ``init_fn``); None: each submodule's ``reset_parameters()``."""
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.init_fn is not None and not callable(self.init_fn):
            raise TypeError(f"init_fn must be a callable taking a module, got {type(self.init_fn).__name__}")
        check_wrap_options(self.stage, self.options, "ShardparStrategy")

    @property
    def timeout_s(self) -> float:
        timeout_s: float = self.options.get("timeout_s", ShardConfig.timeout_s)
        return timeout_s

    def wrap(
        self, module: nn.Module, precision: PrecisionSpec, device: torch.device, built_where: str
    ) -> ShardedModule:
        """``shardpar.wrap`` with these options and the precision's mixed precision: a module
        built on the meta device is materialised there (born sharded at stage 3), any other is
        first moved to ``device``. ``built_where`` says, in errors, how a module came to be
        partly on the meta device."""
        on_meta = _built_on_meta(module, built_where)
        if not on_meta:
            module.to(device)
        options = dict(self.options)
        options["mixed_precision"] = precision.resolve(options.get("mixed_precision"))
        model = wrap(module, self.stage, init_fn=self.init_fn if on_meta else None, **options)
        if on_meta:  # Lightning's modules remember their device (module.device); they never moved
            _update_properties(module, device=model.engine.device)
        return model


def _built_on_meta(module: nn.Module, built_where: str) -> bool:
    """Whether every parameter and buffer of ``module`` is on the meta device; a module that is
    only partly there is refused, naming one tensor of each kind."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    on_meta = [name for name, tensor in tensors if tensor.is_meta]
    elsewhere = [(name, tensor.device) for name, tensor in tensors if not tensor.is_meta]
    if on_meta and elsewhere:
        raise ValueError(
            f"'{on_meta[0]}' was built on the meta device but '{elsewhere[0][0]}' on {elsewhere[0][1]}: shardpar "
            f"initialises a model built on the meta device as a whole ({built_where}); build every layer there, "
            "or none"
        )
    return bool(on_meta)


# --------------------------------------------------------------------------- processes


class DistributedParts:
    """What both strategies do alike as Lightning parallel strategies (mixed in before the
    framework's ``ParallelStrategy``): where this rank trains, the process group, Lightning's
    own launcher, and the collectives Lightning calls itself (barriers, broadcasts of paths
    and decisions, the reduce behind ``self.log(..., sync_dist=True)``)."""

    launcher_class: type
    """The framework's ``_SubprocessScriptLauncher``: ``python train.py`` with ``devices=N``
    starts the other N-1 processes; under torchrun or SLURM there is nothing to start."""
    wrap_options: WrapOptions
    _process_group_backend: str | None
    _timeout: timedelta | None
    # What the framework's ParallelStrategy (and the strategy's own __init__) provides:
    parallel_devices: list[torch.device] | None
    cluster_environment: ClusterEnvironment | None
    num_nodes: int
    global_rank: int
    local_rank: int
    node_rank: int

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = self.launcher_class(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        """Lightning's process group (from its cluster environment: torchrun, its own launcher,
        SLURM...), with shardpar's timeout unless ``timeout`` was given: on gloo shardpar bounds
        its waits by ``timeout_s`` and names the ranks, and gloo's own timeout must not fire first."""
        super().setup_environment()  # type: ignore[misc]
        reset_seed()
        self.set_world_ranks()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(self.root_device)
        timeout = (
            self._timeout if self._timeout is not None else PG.backend_timeout(self.wrap_options.timeout_s, backend)
        )
        kwargs: dict[str, Any] = {"timeout": timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        assert self.cluster_environment is not None  # Lightning's connector gave one, as to _configure_launcher
        _init_dist_connection(self.cluster_environment, backend, **kwargs)
        self._process_group_backend = backend

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # the attribute Lightning sets on its function, which its stubs do not declare
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            C.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        return C.broadcast_object(obj, src, device=self.root_device)

    def reduce_for_lightning(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Lightning's reduce of logged values and metrics, as its DDP strategy does it."""
        if isinstance(tensor, torch.Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor


# --------------------------------------------------------------------------- checkpoints
# [Note: Lightning state in a shardpar checkpoint]
# A checkpoint a strategy writes is a shardpar checkpoint directory (what shardpar.save_checkpoint
# writes: safetensors and a JSON manifest; it loads at any world size and stage). The model and
# the optimizer are its tensors; everything else Lightning saves (epoch, global step, loops'
# progress, callbacks' states, LR schedulers, the precision plugin's scaler, hyperparameters,
# what on_save_checkpoint adds) goes into the manifest's ``extra`` under "lightning" as a typed
# JSON tree ([Note: typed JSON trees] in shardpar/checkpoint/json_values.py). Rank 0's state is
# stored, as Lightning's own strategies store rank 0's file. Nothing is pickled, so nothing is
# unpickled on load: a state that JSON cannot hold (an object in the hyperparameters, a callback
# keeping tensors) is refused when saving, naming where it sits.


def encode_state(state: dict[str, Any], where: str) -> Any:
    """``state`` as the typed JSON tree kept in the manifest (see the Note above)."""
    try:
        return encode_tree(state, where)
    except TypeError as error:
        raise TypeError(
            f"{error}. A shardpar checkpoint keeps Lightning's training state as JSON beside the tensors and never "
            "pickles it: keep such a value out of the checkpoint (save_hyperparameters(ignore=[...]), a callback's "
            "state_dict()) or store it as numbers, strings, lists, dicts and single-value tensors"
        ) from None


def save_with_state(
    path: Any, model: ShardedModule, optimizer: ShardedOptimizer | None, state: Callable[[], dict[str, Any]], who: str
) -> None:
    """``shardpar.save_checkpoint`` into rank 0's ``path`` with ``state()`` (made and encoded
    on rank 0 only, which writes the manifest) as the framework's state; a state that cannot
    be stored is raised on every rank before anything is written."""
    problem, extra = None, None
    if model.engine.rank == 0:
        try:
            extra = {STATE_KEY: encode_state(state(), "checkpoint")}
        except Exception as error:
            problem = error
    target = agree(problem, who, model.engine.group, os.fspath(path))[0]
    save_checkpoint(target, model, optimizer, extra=extra)


@dataclass(frozen=True)
class SavedState:
    """What a strategy needs to know of a checkpoint before loading it."""

    path: str
    """Rank 0's path (every rank loads the same checkpoint)."""
    has_optimizer: bool


def read_saved_state(path: Any, model: ShardedModule, who: str) -> SavedState:
    """Check on every rank that ``path`` (rank 0's) is a checkpoint a strategy wrote; a
    problem on any rank is raised on every rank."""
    problem, result = None, None
    paths = agree(None, who, model.engine.group, os.fspath(path))
    try:
        target = Path(paths[0])
        if target.is_file():
            raise CheckpointError(
                f"{target} is a file, not a shardpar checkpoint directory: shardpar's strategies read only their "
                "own checkpoints, never a pickle (a checkpoint of strategy='ddp' is one). Load its weights yourself "
                "from a file you trust, e.g. before fitting with a module built on the CPU"
            )
        manifest = read_manifest(target)
        if not (isinstance(manifest.extra, dict) and STATE_KEY in manifest.extra):
            raise CheckpointError(
                f"{target} is a shardpar checkpoint without Lightning's state (not written by a Lightning strategy); "
                "load it into the wrapped model with shardpar.load_checkpoint(path, strategy.model)"
            )
        result = SavedState(os.fspath(target), manifest.optimizer is not None)
    except Exception as error:
        problem = error
    agree(problem, who, model.engine.group)
    assert result is not None  # agree raised on every rank after any problem
    return result


def decode_state(extra: Any, path: str) -> dict[str, Any]:
    """The framework's state that :func:`save_with_state` stored, as it was."""
    state = decode_tree(extra[STATE_KEY], f"{path}: Lightning's state")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: Lightning's state in the manifest is a {type(state).__name__}, not a dict")
    return state
