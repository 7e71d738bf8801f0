"""``ShardedModule``: the ``nn.Module`` users get back from :func:`shardpar.wrap`.

It is a thin facade: forward runs the wrapped module, everything about storage and
synchronisation is delegated to the stage's engine. Parameter names, parameter objects
and state-dict keys are the wrapped module's own, so code written for the unwrapped model
(param groups, schedulers, ``state_dict`` consumers) keeps working.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..comm import collectives as C
from ..core import clipping
from ..engines import Engine
from .module_state import ModuleState
from .surface import ModuleSurface


def sharded_module_of(model: Any, who: str) -> ShardedModule:
    """The ``ShardedModule`` that ``model`` is, or that a ``torch.compile`` wrapper of it holds.

    timm and other trainers compile what they train, so the object a script keeps is often
    ``torch.compile(shardpar.wrap(model))`` (an ``OptimizedModule`` whose ``_orig_mod`` is the
    ShardedModule): every shardpar function that takes the model accepts that wrapper too and
    works on the module inside it. ``who`` names the caller in the error for anything else."""
    inner = model
    while (
        not isinstance(inner, ShardedModule)
        and isinstance(inner, nn.Module)
        and isinstance(getattr(inner, "_orig_mod", None), nn.Module)
    ):
        inner = inner._orig_mod  # torch.compile's OptimizedModule (compiled again: one level per compile)
    if not isinstance(inner, ShardedModule):
        raise TypeError(
            f"{who} needs the model returned by shardpar.wrap (or torch.compile of it), got {type(model).__name__}"
        )
    return inner


class ShardedModule(nn.Module):
    """A module trained data-parallel at one ZeRO stage. ``.module`` is the wrapped model."""

    def __init__(self, module: nn.Module, engine: Engine) -> None:
        super().__init__()
        self.module = module
        self.engine = engine
        self._surface = ModuleSurface(engine)
        self._optimizers: list[weakref.ref[Any]] = []
        """The optimizers attached, in the order they were built, not kept alive by the model."""
        """Every shardpar optimizer built over this model and still alive (``memory_stats``
        counts their state; one the script dropped holds none). The engine holds none of them."""

    @property
    def stage(self) -> int:
        stage: int = self.engine.stage  # the engine's row's stage
        return stage

    @property
    def module_state(self) -> ModuleState:
        """The full values of the module and torch's state-dict methods on them (for shardpar's
        loaders; scripts use ``state_dict``, ``load_state_dict`` and :meth:`gathered`)."""
        return self._surface.state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # The engine's hooks on the wrapped module do the per-forward work (buffers, gathers,
        # backward hooks), so calling ``.module`` directly behaves the same.
        args, kwargs = self.engine.cast_inputs(args, kwargs)
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Fall through to the wrapped model for its own methods (e.g. ``generate``).
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        """torch's ``DistributedDataParallel(model)`` asks this of the module it wraps, first
        thing: around a ShardedModule (accelerate's ``prepare`` of a model passed to a plain
        Hugging Face ``Trainer``, a framework's own DDP) it would all-reduce the gradients a
        second time and fight shardpar's storage, so it is refused here by name. (A TypeError,
        which ``hasattr`` does not swallow.)"""
        raise TypeError(
            "torch DistributedDataParallel around a model wrapped by shardpar: shardpar already synchronises "
            "gradients (and shards them at stages 1-3), so DDP would reduce them twice. Pass the unwrapped model "
            "to DDP, or train the ShardedModule directly; with the Hugging Face Trainer use "
            "shardpar.integrations.transformers.ShardparTrainer(..., shardpar_stage=N), with Lightning "
            "ShardparStrategy"
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise TypeError(
            "copy.deepcopy of a model wrapped by shardpar would make a second engine over the same process groups; "
            "copy.deepcopy(model.module) gives a plain copy of the module with the current weights (on every rank, "
            "as it gathers them), for an EMA or evaluation model"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(
            "a model wrapped by shardpar cannot be pickled (torch.save(model)): it holds process groups and "
            "shards. Save model.state_dict() or shardpar.save_checkpoint(...), or torch.save(model.module, path) "
            "for a plain module with the current weights (on every rank, as it gathers them)"
        )

    def _apply(self, fn: Any, recurse: bool = True) -> ShardedModule:
        """``to()``, ``double()``, ``cuda()``, ``half()``... after wrap: see
        :meth:`ModuleState.refuse_moves` (the wrapped module's own ``_apply`` does the same)."""
        self._surface.state.refuse_moves(fn)
        return self

    # ------------------------------------------------------------------ original names

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.module.named_buffers(prefix=prefix, recurse=recurse, remove_duplicate=remove_duplicate)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """``module.state_dict()`` with full, detached tensors, on every rank (every key,
        tied aliases, frozen parameters and persistent buffers included)."""
        return self._surface.full_state_dict()

    def state_dict(  # type: ignore[override]
        self, *args: Any, destination: dict[str, torch.Tensor] | None = None, prefix: str = "", keep_vars: bool = False
    ) -> dict[str, torch.Tensor]:
        """Same as :meth:`full_state_dict` (the wrapped module's keys, full tensors, under
        ``prefix``). A collective at every stage: call it on every rank."""
        if args:
            raise TypeError("ShardedModule.state_dict takes keyword arguments only (destination=, prefix=)")
        out = destination if destination is not None else {}
        for key, value in self.full_state_dict().items():
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load full tensors (keys as in ``module.state_dict()``) into every stage's storage:
        torch's own ``load_state_dict`` of the wrapped module, with its hooks, strictness and
        missing/unexpected keys, run on the full values and written back to the masters and
        shards ([Note: full values in the module]). A collective at stages 1-3. Unlike torch's, a
        load that raises (missing keys under ``strict``, a wrong shape) changes nothing."""
        load = self._surface.state.load_state_dict_of(self.module, atomic=True)
        return load(state_dict, strict=strict, assign=assign)

    @contextlib.contextmanager
    def gathered(self, module: nn.Module | None = None, writeback: bool = True) -> Iterator[None]:
        """Inside, every parameter of the model (or of ``module``, one of its submodules) holds
        its full, full-precision value on every rank, and buffers their built dtypes, for code
        that reads or writes weights outside forward (PEFT's ``merge_and_unload()``, an EMA,
        weight surgery), as FSDP's ``summon_full_params``. On exit, with ``writeback``, what the
        parameters and buffers hold then (written in place, or re-assigned through ``.data``)
        is stored in the masters and shards of every rank; every rank must write the same values.
        With ``writeback=False`` the values are copies at every stage, and changes are dropped.
        A collective at stages 1-3 (enter it on every rank); between steps only."""
        if module is not None and not any(module is sub for sub in self.module.modules()):
            raise ValueError(
                f"model.gathered(module) takes the wrapped model or one of its submodules, "
                f"got a {type(module).__name__} that is not in it"
            )
        with self._surface.state.full_values(scope=module, writeback=writeback, copies=not writeback):
            yield

    # ------------------------------------------------------------------ training helpers

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally without any collective; the
        first backward outside reduces the sum. (Stage 2 then holds full gradients until that
        backward: the price of accumulation.)"""
        previous = self.engine.state.require_grad_sync
        self.engine.state.require_grad_sync = False
        try:
            yield
        finally:
            self.engine.state.require_grad_sync = previous

    @property
    def require_backward_grad_sync(self) -> bool:
        """torch DDP's switch, which scripts such as nanoGPT set for gradient accumulation:
        False makes the next backward passes accumulate without any collective, like
        :meth:`no_sync`; True makes the next one reduce everything accumulated."""
        return self.engine.state.require_grad_sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self.engine.state.require_grad_sync = bool(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget this rank's gradients wherever the stage keeps them, as ``nn.Module.zero_grad``;
        with ``set_to_none=False`` zero the gradients that exist and keep them, so that a step
        still updates those parameters (torch's semantics)."""
        self.engine.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Scale gradients so their global norm (over all ranks' shards) is at most
        ``max_norm``; return the norm before clipping, as ``torch.nn.utils.clip_grad_norm_``
        (the same arguments; a norm per parameter, or per piece of one this rank owns: see
        [Note: a norm per piece] in ``shardpar.core.clipping``). At stages 1-3 one
        all-reduce of the norm; never a host sync unless ``error_if_nonfinite``."""
        pieces, sharded = self.engine.owned_grad_pieces()
        grads, _ = self.engine.owned_grads()
        with torch.no_grad():
            total = clipping.total_norm(
                pieces,
                norm_type,
                device=self.engine.device,
                dtype=clipping.result_dtype(grads),
                all_reduce=self._all_reduce_norm if sharded else None,
                foreach=foreach,
            )
            if error_if_nonfinite and not torch.isfinite(total):
                raise RuntimeError(
                    f"the total norm of order {float(norm_type)} of the gradients is non-finite ({total.item()}); "
                    "pass error_if_nonfinite=False to clip anyway"
                )
            clipping.clip_with_norm_(pieces, max_norm, total, foreach=foreach)
        return total

    def _all_reduce_norm(self, tensor: torch.Tensor, op: str) -> None:
        """The one collective of a sharded clip: partial norms across the ranks of the shards
        (the shard group: its replicas hold the same shards)."""
        self.engine.wait_clock.wait(
            C.all_reduce(
                tensor,
                group=self.engine.shards.shard_group,
                async_op=True,
                op=op,
                stats=self.engine.shard_comm,
                kind="clip_norm",
            ),
            gather=False,
        )

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]``, as
        ``torch.nn.utils.clip_grad_value_``. Elementwise, so each rank clamps the gradient
        elements it holds (its shards at stages 1-3) and nothing is communicated."""
        clip_value = float(clip_value)
        if not clip_value >= 0:
            raise ValueError(f"clip_value must be a non-negative number, got {clip_value!r}")
        grads, _ = self.engine.owned_grads()
        with torch.no_grad():
            for grad in grads:
                grad.clamp_(-clip_value, clip_value)

    def comm_stats(self) -> dict[str, dict[str, float]]:
        """Bytes this rank sent since wrap (or the last reset), per collective kind; see
        [Note: byte accounting] in ``shardpar.comm.comm_stats``. Under hybrid sharding the
        same, summed over the groups, plus ``"by_group"``: ``{"shard_group": ...,
        "replica_group": ..., "all_ranks": ...}``, each shaped like the whole."""
        engine = self.engine
        if not engine.shards.is_hybrid:
            return engine.comm.snapshot()
        by_group = {
            C.SHARD_GROUP: engine.shard_comm.snapshot(),
            C.REPLICA_GROUP: engine.replica_comm.snapshot(),
            C.ALL_RANKS: engine.comm.snapshot(),
        }
        out: dict[str, Any] = C.merge_snapshots(list(by_group.values()))
        out["by_group"] = by_group
        return out

    def reset_comm_stats(self) -> None:
        for stats in (self.engine.comm, self.engine.shard_comm, self.engine.replica_comm):
            stats.reset()

    def attach_optimizer(self, optimizer: Any) -> None:
        """``shardpar.optimizer`` built ``optimizer`` over this model (one of several, maybe:
        one for the matrices and one for the rest, as nanochat trains)."""
        self._optimizers = [ref for ref in self._optimizers if ref() is not None] + [weakref.ref(optimizer)]

    def attached_optimizers(self) -> list[Any]:
        """The optimizers ``shardpar.optimizer`` built over this model that are alive, in the
        order they were built (the same on every rank: following a layout is collective)."""
        alive = [ref() for ref in self._optimizers]
        return [optimizer for optimizer in alive if optimizer is not None]

    def memory_stats(self) -> dict[str, int]:
        """Bytes of model state this rank holds now: ``params``, ``grads``,
        ``optimizer_state`` (the state of every optimizer attached, once there is one),
        ``workspace`` and ``total``."""
        stats = dict(self.engine.memory_stats())
        optimizers = self.attached_optimizers()
        if optimizers:
            stats["optimizer_state"] = sum(optimizer.state_bytes() for optimizer in optimizers)
        stats["total"] = sum(v for k, v in stats.items() if not k.startswith("peak_"))
        return stats

    def extra_repr(self) -> str:
        return f"stage={self.engine.stage}, world_size={self.engine.world_size}"
