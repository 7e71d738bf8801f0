"""What every stage shares: the model's parameter inventory, the cross-rank consistency
check, the initial broadcast, buffer broadcasting and the engine interface.

An engine owns *how* parameters and gradients are stored and synchronised; the
:class:`~shardpar.module.ShardedModule` facade and the optimizer talk to it only through
the methods declared here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .. import collectives as C
from ..config import ShardConfig


@dataclass(frozen=True)
class TensorPiece:
    """A local tensor holding part of one parameter, and which part.

    ``param_range`` is in param space (offsets into the flattened parameter). Used for what
    the wrapped optimizer updates (the whole parameter at stage 0, this rank's piece at
    stages 1-3) and for what a checkpoint writes and reads.
    """

    name: str
    tensor: torch.Tensor
    param_range: tuple[int, int]


def unique_named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters in registration order, each once under its first name (tied weights)."""
    return list(module.named_parameters())


def tied_names(module: nn.Module) -> dict[str, str]:
    """``alias -> canonical name`` for every parameter reachable under more than one name."""
    canonical: dict[nn.Parameter, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param in canonical:
            aliases[name] = canonical[param]
        else:
            canonical[param] = name
    return aliases


def module_device(module: nn.Module) -> torch.device:
    """The single device every parameter and buffer is on; raise naming two that differ."""
    first: tuple[str, torch.device] | None = None
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if first is None:
            first = (name, tensor.device)
        elif tensor.device != first[1]:
            raise ValueError(
                f"shardpar.wrap needs every parameter and buffer on one device, but "
                f"'{first[0]}' is on {first[1]} and '{name}' is on {tensor.device}; "
                "move the model with model.to(device) before wrapping"
            )
    return first[1] if first is not None else torch.device("cpu")


def model_signature(module: nn.Module, config: ShardConfig) -> list[tuple[str, str]]:
    """What every rank must agree on, as comparable ``(what, value)`` rows."""
    rows = [("config", config.fingerprint())]
    for name, p in module.named_parameters():
        rows.append((f"parameter '{name}'", f"shape={tuple(p.shape)} dtype={p.dtype} requires_grad={p.requires_grad}"))
    for name, b in module.named_buffers():
        rows.append((f"buffer '{name}'", f"shape={tuple(b.shape)} dtype={b.dtype}"))
    return rows


def first_difference(reference: Sequence[tuple[str, str]], other: Sequence[tuple[str, str]]) -> str | None:
    for (what_a, value_a), (what_b, value_b) in zip(reference, other):
        if what_a != what_b:
            return f"{what_a} on rank 0 is {what_b} here (parameters/buffers differ in name or order)"
        if value_a != value_b:
            return f"{what_a} is {value_a} on rank 0 but {value_b} on rank {{rank}}"
    if len(reference) != len(other):
        longer, shorter = (reference, other) if len(reference) > len(other) else (other, reference)
        extra = longer[len(shorter)][0]
        owner = "rank 0" if longer is reference else "rank {rank}"
        return f"{extra} exists only on {owner} ({len(reference)} entries on rank 0, {len(other)} on rank {{rank}})"
    return None


class Engine:
    """Base of all stages. Subclasses implement storage and gradient synchronisation."""

    stage: int = -1

    def __init__(self, module: nn.Module, config: ShardConfig, group: C.ProcessGroup | None = None) -> None:
        self.module = module
        self.config = config
        self.group = group
        self.world_size = C.get_world_size(group)
        self.rank = C.get_rank(group)
        self.device = module_device(module)
        self.comm = C.CommStats()
        self.require_grad_sync = True
        self.named_params = unique_named_parameters(module)
        self.param_names: dict[nn.Parameter, str] = {p: n for n, p in self.named_params}
        self.trainable = [(n, p) for n, p in self.named_params if p.requires_grad]
        self.frozen = [(n, p) for n, p in self.named_params if not p.requires_grad]
        self.aliases = tied_names(module)
        self._hook_handles: list[Any] = []
        self.optimizer: Any = None
        """The ShardedOptimizer built over this engine, once there is one."""
        self.last_backward_wait_s = 0.0
        """Seconds the end of the last backward waited for gradient collectives (exposed
        communication; the rest overlapped backward)."""

    # ------------------------------------------------------------------ set-up helpers

    def broadcast_module_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make ``tensors`` equal rank 0's on every rank (set-up only; not per step)."""
        with torch.no_grad():
            for tensor in tensors:
                C.broadcast(tensor, 0, group=self.group)

    def broadcast_buffers(self) -> None:
        """DDP semantics: before each forward, every rank takes rank 0's buffers."""
        if self.world_size == 1 or not self.config.broadcast_buffers:
            return
        buffers = [b for b in self.module.buffers()]
        if not buffers:
            return
        with torch.no_grad():
            handles = [C.broadcast(b, 0, group=self.group, async_op=True, stats=self.comm) for b in buffers]
            for handle in handles:
                handle.wait()

    def add_hook(self, handle: Any) -> None:
        self._hook_handles.append(handle)

    def close(self) -> None:
        """Remove every hook this engine registered (the module keeps working unwrapped)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    # ------------------------------------------------------------------ interface

    def pre_forward(self) -> None:
        """Called by ``ShardedModule.forward`` before the wrapped module runs."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        raise NotImplementedError

    def optimizer_tensors(self, names: Sequence[str]) -> list[TensorPiece]:
        """The tensors the wrapped optimizer updates for these parameters, on this rank."""
        raise NotImplementedError

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        """Final gradients this rank is responsible for, and whether they are a shard (so a
        global norm needs an all-reduce of partial sums)."""
        raise NotImplementedError

    def before_optimizer_step(self) -> None:
        """Called before the wrapped optimizer updates its tensors."""

    def after_optimizer_step(self) -> None:
        """Called after the wrapped optimizer updated its tensors."""

    def wait_for_params(self) -> None:
        """Block until parameters are complete and current (e.g. pending all-gathers)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of ``module.state_dict()``, full and detached, on every rank."""
        self.wait_for_params()
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`full_state_dict` (every rank passes the same full tensors)."""
        self.wait_for_params()
        with torch.no_grad():
            self.module.load_state_dict(state, strict=True)

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds, by kind: ``params``, ``grads``, plus engine specifics."""
        raise NotImplementedError

    def save_pieces(self) -> list[TensorPiece]:
        """What this rank writes to a checkpoint: 1-D pieces of parameters (trainable and
        frozen) such that, over all ranks, every element of every parameter is written
        exactly once. Buffers are not included (replicated; the checkpoint takes rank 0's)."""
        raise NotImplementedError

    def load_pieces(self) -> list[TensorPiece]:
        """Where this rank must put parameter values on load (1-D views into live storage).
        After filling them, call :meth:`after_load`."""
        raise NotImplementedError

    def after_load(self) -> None:
        """Called once every load piece was filled."""

    def iter_frozen_and_buffers(self) -> Iterator[torch.Tensor]:
        for _, p in self.frozen:
            yield p.data
        yield from self.module.buffers()
