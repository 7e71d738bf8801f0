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
from torch.utils._pytree import tree_map

from ..comm import collectives as C
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


WRAPPED_MARK = "_shardpar_wrapped"
"""Set on the module an engine manages, so that wrapping it (or a model containing it) again
is refused: a second engine would re-point its parameters and gradients behind the first."""


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
        self._requires_grad = [p.requires_grad for _, p in self.named_params]
        self.grads_ready = False
        """Some backward reduced gradients since the last zero_grad (else step() is a no-op)."""
        self.original_dtypes = {name: p.dtype for name, p in self.named_params}
        """Parameter dtypes as created: what checkpoints and full state dicts hold."""
        self.original_buffer_dtypes: dict[str, torch.dtype] = {}
        """Buffers that ``MixedPrecision.buffer_dtype`` cast: their dtypes as created."""
        # The wrapped module's own zero_grad must clear the engine's gradients too.
        module.zero_grad = lambda set_to_none=True: self.zero_grad()
        setattr(module, WRAPPED_MARK, True)
        self._hook_handles: list[Any] = []
        self.optimizer: Any = None
        """The ShardedOptimizer built over this engine, once there is one."""
        mp = config.mixed_precision
        self.param_dtype = mp.param_dtype if mp is not None else None
        self.last_backward_wait_s = 0.0
        """Seconds the end of the last backward waited for gradient collectives (exposed
        communication; the rest overlapped backward)."""

    # ------------------------------------------------------------------ set-up helpers

    def broadcast_module_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make ``tensors`` equal rank 0's on every rank (set-up only; not per step)."""
        with torch.no_grad():
            for tensor in tensors:
                C.broadcast(tensor, 0, group=self.group)

    def cast_buffers(self) -> None:
        """``MixedPrecision.buffer_dtype``: floating buffers are kept in that dtype."""
        mp = self.config.mixed_precision
        if mp is None or mp.buffer_dtype is None:
            return
        for name, buffer in self.module.named_buffers():
            if buffer.is_floating_point():
                self.original_buffer_dtypes[name] = buffer.dtype
                buffer.data = buffer.data.to(mp.buffer_dtype)

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Floating-point inputs are cast to ``param_dtype`` so layers see one dtype."""
        if self.param_dtype is None:
            return args, kwargs

        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(self.param_dtype)
            return value

        return tree_map(cast, args), tree_map(cast, kwargs)

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
        self.module.__dict__.pop("zero_grad", None)
        self.module.__dict__.pop(WRAPPED_MARK, None)

    # ------------------------------------------------------------------ interface

    def pre_forward(self) -> None:
        """Called by ``ShardedModule.forward`` before the wrapped module runs."""
        raise NotImplementedError

    def zero_grad(self) -> None:
        """Reset gradients to zero wherever this stage keeps them."""
        self.clear_grads()
        self.grads_ready = False

    def clear_grads(self) -> None:
        raise NotImplementedError

    def check_requires_grad(self) -> None:
        """Which parameters train is fixed at wrap time (it decides buffers and hooks)."""
        now = [p.requires_grad for _, p in self.named_params]
        if now != self._requires_grad:
            name = next(n for (n, p), before in zip(self.named_params, self._requires_grad) if p.requires_grad != before)
            raise RuntimeError(
                f"requires_grad of parameter '{name}' changed after shardpar.wrap; freeze or "
                "unfreeze parameters before wrapping (wrap the model again to change them)"
            )

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
        """Every tensor of ``module.state_dict()``, full, detached and in full precision (the
        master values), on every rank. Tied aliases map to the same tensor."""
        self.wait_for_params()
        params = self.gather_full_params()
        out = {}
        for key, value in self.module.state_dict(keep_vars=True).items():
            canonical = self.aliases.get(key, key)
            if canonical in params:
                out[key] = params[canonical]
            else:  # a buffer: back in the dtype the model was built with
                out[key] = value.detach().to(self.original_buffer_dtypes.get(canonical, value.dtype), copy=True)
        return out

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """``name -> full tensor`` of every parameter, assembled on every rank from all
        ranks' :meth:`save_pieces` (each element is written by exactly one rank, so one
        all-reduce per dtype of the zero-filled rest reproduces the values exactly)."""
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for name, param in self.named_params:
            by_dtype.setdefault(self.original_dtypes[name], []).append((name, param))
        pieces = {}
        for piece in self.save_pieces():
            pieces.setdefault(piece.name, []).append(piece)
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for dtype, named in by_dtype.items():
                flat = torch.zeros(sum(p.numel() for _, p in named), dtype=dtype, device=self.device)
                offset = 0
                for name, param in named:
                    full = flat[offset : offset + param.numel()]
                    for piece in pieces.get(name, []):
                        full[piece.param_range[0] : piece.param_range[1]].copy_(piece.tensor)
                    out[name] = full.view(param.shape)
                    offset += param.numel()
                C.all_reduce(flat, group=self.group)
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Inverse of :meth:`full_state_dict` (every rank passes the same full tensors).

        Values go through :meth:`load_pieces`, so master copies and stage-3 shards get the
        full-precision values, not a low-precision compute copy.
        """
        self.wait_for_params()
        expected = {name: tuple(t.shape) for name, t in self.module.state_dict(keep_vars=True).items()}
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        wrong_shape = [
            f"{name}: {tuple(state[name].shape)} vs model {shape}"
            for name, shape in expected.items()
            if name in state and tuple(state[name].shape) != shape
        ]
        if missing or unexpected or wrong_shape:
            raise ValueError(
                "state dict does not match the model: "
                + "; ".join(
                    f"{label}: {', '.join(items)}"
                    for label, items in (("missing", missing), ("unexpected", unexpected), ("shape", wrong_shape))
                    if items
                )
            )
        with torch.no_grad():
            for piece in self.load_pieces():
                start, end = piece.param_range
                piece.tensor.copy_(state[piece.name].reshape(-1)[start:end])
            for name, buffer in self.module.named_buffers():
                if name in state:
                    buffer.copy_(state[name])
            self.after_load()

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

    def frozen_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for _, p in self.frozen)

    def iter_frozen_and_buffers(self) -> Iterator[torch.Tensor]:
        for _, p in self.frozen:
            yield p.data
        yield from self.module.buffers()
