"""The engine: one stage's training machinery, composed of the parts its row of the stage
table picks (``stages.py``): parameter storage, gradient reducer strategy, parameter gatherer,
backward path.

The engine owns what every stage shares: the training state, the hooks that tell it where
forward and backward are, the end-of-backward callback, buffers, and the questions the
``ShardedModule`` facade, the optimizer and checkpoints ask ("which tensors do I update",
"which pieces do I save", "how much memory do you hold").

[Note: end of backward]
Gradients must be final when ``backward()`` returns, so the reducer's last work runs in a
callback queued on the autograd engine. It has to be queued on the *outermost* backward:
reentrant activation checkpointing runs an inner backward (its own graph task) inside the
outer one, and a callback queued from a gradient hook firing in there would run when the
inner backward ends -- mid-backward, reducing every remaining bucket early with zeros and
again at the real end. So the callback is queued from a hook on the root module's outputs,
which fires first and in the outer backward; a gradient hook queues it only when no root
hook did (a backward through part of the model).
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import watch
from ..comm.sharding_groups import ShardingGroups
from ..config import ShardConfig
from ..core.backward_paths import BackwardPath
from ..core.deferred_init import DeferredInit
from ..core.element_order import ElementOrder
from ..core.first_step_orders import ReadyOrder
from ..core.gather_phases import GatherPhases
from ..core.gatherer import UnitGatherer
from ..core.inventory import (
    ParamInventory,
    check_dense_gradients,
    check_supported_dtypes,
    module_device,
    sparse_gradient_error,
)
from ..core.layout import BufferLayout
from ..core.pieces import TensorPiece
from ..core.rebuild import BucketRebuild, Relayout, carry_state
from ..core.reduce_strategies import ReduceStrategy
from ..core.reducer import GradientReducer
from ..core.sharded import ShardedStorage
from ..core.storage import Storage
from ..core.training_state import Phase, TrainingState
from ..core.units import ModuleTree
from ..core.wait_clock import WaitClock
from .buffer_sync import BufferSync
from .casts import MixedPrecisionCasts
from .grad_placeholder_hooks import GradPlaceholders
from .hooks import engine_hook, grad_ready_hooks, grad_tensors, never_compiled, on_first_grad
from .module_hooks import UnitHooks, UseHooks, module_of_params
from .stages import RowInputs

if TYPE_CHECKING:
    from .stages import StageRow

WRAPPED_MARK = "_shardpar_wrapped"
"""Set on the module an engine manages, so that wrapping it (or a model containing it) again
is refused: a second engine would re-point its parameters and gradients behind the first."""


_disabled = engine_hook


class Engine:
    """Training machinery of one wrapped module at one stage (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        config: ShardConfig,
        group: Any,
        row: StageRow,
        deferred_init: DeferredInit | None = None,
        sharding: ShardingGroups | None = None,
    ) -> None:
        self.module = module
        self.config = config
        self.group = group
        self.row = row
        self.stage = row.stage
        self.world_size = C.get_world_size(group)
        self.rank = C.get_rank(group)
        self.deferred_init = deferred_init
        """Set when the module was built on the meta device (stage 3; see core/deferred_init.py)."""
        self.device = deferred_init.device if deferred_init is not None else module_device(module)
        self.shards = sharding if sharding is not None and sharding.is_hybrid else ShardingGroups.whole(group)
        """Where this rank's shards live (stages 1-3): its shard group, and under hybrid sharding
        the replica group holding the same shards ([Note: sharding groups])."""
        self.comm = C.CommStats()
        """What ran on every rank of ``group`` (and under full sharding everything)."""
        self.shard_comm = C.CommStats() if self.shards.is_hybrid else self.comm
        """What ran within the shard group: reduce-scatters and all-gathers."""
        self.replica_comm = C.CommStats() if self.shards.is_hybrid else self.comm
        """What ran across the replica groups: the all-reduce of each owned shard."""
        self.state = TrainingState()
        self.wait_clock = WaitClock(self.state)
        """Seconds this rank waited for collectives, per phase (see [Note: exposed communication])."""
        watch.track(self.state)
        watch.configure(group, config.timeout_s)
        for part_group in (self.shards.shard_group, self.shards.replica_group) if self.shards.is_hybrid else ():
            watch.configure(part_group, config.timeout_s)
        self.inventory = ParamInventory(module)
        if not self.inventory.trainable:
            raise ValueError(
                "shardpar.wrap: the module has no parameter with requires_grad=True; "
                "there is nothing to train in data parallel"
            )
        check_supported_dtypes(self.inventory)
        check_dense_gradients(module, self.inventory)
        self.casts = MixedPrecisionCasts(config.mixed_precision)
        self.param_dtype = self.casts.param_dtype
        self.original_buffer_dtypes = self.casts.original_buffer_dtypes
        """Buffers that ``MixedPrecision.buffer_dtype`` cast: their dtypes as created."""
        self.casts.cast_buffers(module)
        self.layout_generation = 0
        """How many times the buckets were rebuilt (at most once; see [Note: bucket rebuild])."""
        self._relayouts: dict[Any, Any] = {}
        """The rebuild's moves, by bucketed parameter set: what optimizers built before it follow."""
        self._handles: list[Any] = []
        self._backward_start_hook = _disabled(lambda grad: self.ensure_backward_started())
        """Put on the root output once per forward; made once (see on_first_grad)."""
        self._finish_backward_eagerly = never_compiled(self._finish_backward)
        """The end-of-backward callback, made once."""
        self._tree = ModuleTree(module)
        self.unit_hooks: UnitHooks | None = None
        """Stage 3's hooks on units' hook and entry modules (installed by the stage's row)."""

        inputs = RowInputs(
            module,
            self.inventory,
            config,
            group,
            self.world_size,
            self.shards,
            self.comm,
            self.shard_comm,
            self.replica_comm,
            self.wait_clock,
            self.device,
            self.casts,
            deferred_init,
        )
        self.storage: Storage = row.storage(inputs)
        """The stage's parameter storage (its row's: core/storage.py names what is asked of it)."""
        self.strategy: ReduceStrategy = row.strategy(inputs, self.storage.spaces)
        rebuilds = config.rebuild_buckets and self.storage.relayouts
        ready_order = ReadyOrder(module_of_params(self._tree, self.storage)) if rebuilds else None
        self.reducer = GradientReducer(
            self.storage.spaces, self.strategy, self.state, self.comm, group, self.wait_clock, ready_order=ready_order
        )
        self.use_hooks = UseHooks(self._tree, self.storage, self.reducer)
        """Stages 0-2's hooks on the modules that use parameters (installed by the stage's row)."""
        # Where param.grad cannot be the gradient (shards; fp32 masters under mixed precision),
        # plain torch code that reads it must fail loudly: see core/grad_placeholders.py.
        hidden = not self.strategy.full_grads_on_params or self.param_dtype is not None
        self.grad_placeholders = (
            GradPlaceholders(self.inventory.trainable, self.stage, self.reducer) if hidden else None
        )
        reducer = self.reducer
        self._handles += grad_ready_hooks(
            ((name, reducer.bucket_of[name].params[name]) for name in reducer.names),
            self._on_grad_ready,
            reducer.arrival_counter,
        )
        if self.grad_placeholders is not None:
            self._handles += self.grad_placeholders.before_accumulation_hooks(self.ensure_backward_started)
        self.buffer_sync = BufferSync(
            module, group, self.rank, self.world_size, config.broadcast_buffers, self.comm, self.wait_clock
        )
        self.gatherer: GatherPhases = row.gatherer(self)
        """The stage's gatherer, its hooks installed (see stages.py)."""
        self.backward_path: BackwardPath = row.backward_path(self)
        """Orders the reducer and the gatherer in backward (see [Note: a gradient's path through
        backward] in core/backward_paths.py)."""
        self._install_root_hooks()
        self._cast_hooks: list[Any] = self.casts.install_hooks(self._tree)
        self.module_attributes: tuple[str, ...] = (WRAPPED_MARK,)
        """Instance attributes the engine sets on the module (taken off when it closes)."""
        setattr(module, WRAPPED_MARK, True)
        self._attached: list[Any] = []
        """What attached itself to this engine (the module facade): closed with it."""

    # ------------------------------------------------------------------ construction helpers

    def _install_root_hooks(self) -> None:
        self._handles.append(self.module.register_forward_pre_hook(_disabled(self._root_pre_forward), prepend=True))
        self._handles.append(self.module.register_forward_hook(_disabled(self._root_post_forward)))
        self._handles.append(self.module.register_forward_hook(_disabled(self._root_forward_raised), always_call=True))

    def install_use_hooks(self) -> None:
        """Stages 0-2: the modules that register parameters (lifted out of compiled regions)
        record first use (launch order) and complete lazy gathers (stages 1-2)."""
        self.use_hooks.install()

    def install_unit_hooks(self, gatherer: UnitGatherer) -> None:
        """Stage 3: the hooks on every unit's hook and entry modules that drive ``gatherer``."""
        storage = self.storage
        assert isinstance(storage, ShardedStorage)  # stage 3's row
        self.unit_hooks = UnitHooks(
            gatherer,
            self.reducer,
            self.state,
            self.ensure_backward_started,
            storage.units,
            storage.plans,
            self._tree.modules,
        )

    def _follow_compiled_modules(self) -> None:
        """Hooks out of modules compiled since wrapping (see [Note: compiled after wrap] in
        module_hooks.py)."""
        if not self._tree.compiled_since():
            return
        tree = ModuleTree(self.module)
        if self.unit_hooks is not None:
            self.unit_hooks.move_to(tree)  # first: it may refuse, before anything moved
        self._tree = tree
        self.use_hooks.move_to(tree)
        if self.reducer.orders.ready is not None:
            self.reducer.orders.ready.regroup(module_of_params(tree, self.storage))
        for handle in self._cast_hooks:
            handle.remove()
        self._cast_hooks = self.casts.install_hooks(tree)

    # ------------------------------------------------------------------ forward

    def check_requires_grad(self) -> None:
        """Which parameters train is fixed at wrap time (it decides buffers and hooks)."""
        name = self.inventory.changed_requires_grad()
        if name is not None:
            raise RuntimeError(
                f"requires_grad of parameter '{name}' changed after shardpar.wrap; freeze or "
                "unfreeze parameters before wrapping (wrap the model again to change them)"
            )

    def cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Floating-point inputs are cast to ``param_dtype`` so layers see one dtype (see
        [Note: what mixed precision casts] in casts.py)."""
        return self.casts.cast_inputs(args, kwargs)

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self.state.is_recompute():
            return
        self.check_requires_grad()
        self._follow_compiled_modules()
        self._take_off_grad_placeholders()
        self.state.phase = Phase.FORWARD
        self.buffer_sync.before_forward()
        self.gatherer.begin_forward()
        self._unit_uses_forgotten()

    def _unit_uses_forgotten(self) -> None:
        """Stage 3: the gatherer forgot the unit uses in progress; the entry hooks taken off
        for them are back ([Note: entry hooks quiet inside a use] in module_hooks.py)."""
        if self.unit_hooks is not None:
            self.unit_hooks.uses_forgotten()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.state.is_recompute():
            return
        self.state.phase = Phase.IDLE
        self.buffer_sync.after_forward(torch.is_grad_enabled() and self.state.require_grad_sync)
        if torch.is_grad_enabled():
            tensors = grad_tensors(output)
            if tensors:
                on_first_grad(tensors, self._backward_start_hook)
            self.reducer.orders.forward_ended()
            self.use_hooks.after_forward()  # [Note: one gather hook per bucket] in module_hooks.py
        self.gatherer.end_forward()

    def _root_forward_raised(self, module: nn.Module, args: Any, output: Any) -> None:
        """Runs after every root forward, raising or not; acts only when it raised (the
        post-forward hook did not run): no backward will follow, so nothing stays gathered."""
        if self.state.phase is not Phase.FORWARD or self.state.is_recompute():
            return
        self.state.phase = Phase.IDLE
        self.gatherer.abandon_forward()
        self._unit_uses_forgotten()

    # ------------------------------------------------------------------ backward

    def ensure_backward_started(self) -> None:
        """The first hook of a backward (see [Note: end of backward])."""
        if self.state.final_callback_queued:
            return
        self._take_off_grad_placeholders()  # before the first gradient accumulates into .grad
        self.state.begin_backward()
        self.reducer.begin_backward()
        self.state.final_callback_queued = True
        # Never compiled: a training step compiled with its backward runs this callback while
        # dynamo's frame callback is set, and it waits for and launches collectives.
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward_eagerly)
        self.reducer.orders.backward_starts(self._exchange_with_every_rank)
        self.gatherer.begin_backward()

    def _exchange_with_every_rank(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` through the gatherer's channel (its shard group), then,
        under hybrid sharding, the shard groups' first rows across the replica group: row 0
        is rank 0's on every rank, so the order adopted from it is the same everywhere."""
        rows = self.gatherer.exchange(values)
        if self.shards.is_hybrid:
            rows = C.all_gather_objects(
                rows[0], group=self.shards.replica_group, device=self.device, stats=self.replica_comm, kind="control"
            )
        return rows

    def _on_grad_ready(self, name: str, param: nn.Parameter) -> None:
        if not self.state.final_callback_queued:  # else the backward has started: skip the call
            self.ensure_backward_started()
        grad = param.grad
        if grad is not None and grad.layout is not torch.strided:
            raise sparse_gradient_error(name, grad)
        if not torch.is_grad_enabled():  # backward without create_graph: already so, no context to enter
            self.backward_path.grad_ready(name, param)
            return
        with torch.no_grad():
            self.backward_path.grad_ready(name, param)

    def _finish_backward(self) -> None:
        try:
            with torch.no_grad():
                self.gatherer.check_previous_backward()  # before any wait on reductions: see its note
                if self.state.backward_syncs:
                    self.backward_path.finish_backward()
                    if self.reducer.orders.ready is not None:
                        self._rebuild_buckets()
                    self._put_grad_placeholders()
                self.gatherer.finish_backward()
                self._unit_uses_forgotten()
                self.buffer_sync.after_backward()
        finally:
            self.reducer.end_backward()
            self.state.end_backward()

    def settle_gradients(self) -> None:
        """Read the used-parameter flags in flight, waiting for them on a GPU: after it, which
        parameters have a gradient is known (step(), zero_grad(set_to_none=False), checkpoints)."""
        self.gatherer.check_tags(block=True)  # first: see [Note: deferred tag checks] in core/unit_order.py
        if (
            self.reducer.settle(block=True)
            and self.grad_placeholders is not None
            and self.grad_placeholders.wait_for_flags
        ):
            self.grad_placeholders.put_on()

    def _rebuild_buckets(self) -> None:
        """Once, at the end of the first synchronising backward: see [Note: bucket rebuild] in
        core/rebuild.py and :class:`BucketRebuild`."""
        rebuild = BucketRebuild(
            self.reducer, self.storage, self.strategy, self.rank, self.group, self.comm, self.device
        )
        if not rebuild.relayout():
            return
        self._relayouts = rebuild.moves
        self.layout_generation += 1
        if self.storage.groups:
            self.use_hooks.reinstall_gathers()

    def own_whole(self, names: Iterable[str]) -> None:
        """Lay ``names`` out whole, each in one rank's slice (stages 1-3), for an optimizer
        whose update reads whole tensors: see [Note: whole-tensor ownership] in
        core/layout.py. Collective (every rank builds the same optimizer); the optimizers
        built before follow the new layout on their next use, as after a bucket rebuild."""
        assert self.stage > 0, "at stage 0 every rank updates whole parameters"
        layouts = self.storage.whole_layouts(frozenset(names))
        if not layouts:
            return
        self.settle_gradients()
        shards = self.shards  # owners are ranks of the shard group: the layouts are its
        moves = {
            space: Relayout(space.layout, layout, shards.shard_rank, shards.shard_group, self.shard_comm)
            for space, layout in layouts.items()
        }
        self.storage.relayout(moves)
        self.strategy.relayout(moves)
        self.reducer.follow_placement()
        self.gatherer.follow_placement()
        self._relayouts = moves
        self.layout_generation += 1
        if self.storage.groups and self.storage.relayouts:
            self.use_hooks.reinstall_gathers()

    def carry_optimizer_state(
        self, states: dict[str, tuple[torch.Tensor, dict[str, Any]]]
    ) -> dict[str, dict[str, Any]]:
        """An optimizer built before the bucket rebuild, on its first use after it: its state
        (``name -> (tensor, state)``) in the new layout; collective where the masters are
        sharded (see [Note: optimizers follow the layout] in optim/sharded.py)."""
        return carry_state(states, self._relayouts, self.storage, self.group, self.comm, self.device)

    # ------------------------------------------------------------------ optimizer

    def zero_grad(self, names: Iterable[str] | None = None, set_to_none: bool = True) -> None:
        """Forget the gradients of ``names`` (None: every parameter's), or zero and keep them
        (``set_to_none=False``); see [Note: zero_grad of some parameters] and [Note:
        zero_grad(set_to_none=False)] in core/reducer.py. Names that cover every trainable
        parameter (an optimizer over the whole model, the usual case) take the plain clear."""
        some = None if names is None else self.reducer.flag_index.keys() & names
        if some is not None and len(some) == len(self.reducer.names):
            some = None
        if (some is not None or not set_to_none) and not self.reducer.ledger.unused_known:
            self.settle_gradients()
        self._take_off_grad_placeholders(some)
        self.reducer.zero_grad(some, set_to_none)

    def _put_grad_placeholders(self) -> None:
        if self.grad_placeholders is not None:
            self.grad_placeholders.put_on()

    def _take_off_grad_placeholders(self, names: Iterable[str] | None = None) -> None:
        if self.grad_placeholders is not None:
            self.grad_placeholders.take_off(names)

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        """Final gradients this rank is responsible for, and whether they are a shard (so a
        global norm needs an all-reduce of partial sums). After ``zero_grad`` and before a
        synchronising backward there are none (torch: every ``.grad`` None, or a zero that
        ``set_to_none=False`` kept), whatever the stage's buffers still hold."""
        return self.strategy.owned_grads() if self.reducer.ledger.grads_ready else ([], False)

    def owned_grad_pieces(self) -> tuple[list[torch.Tensor], bool]:
        """:meth:`owned_grads` cut per parameter (stage 0) or per piece of a parameter this rank
        owns (stages 1-3), as views: the tensors a norm is taken over, one by one, as torch
        takes one per parameter ([Note: a norm per piece] in core/clipping.py)."""
        if not self.reducer.ledger.grads_ready:
            return [], False
        return self.strategy.owned_grad_pieces(), self.strategy.owned_grads()[1]

    def without_gradient(self) -> set[str]:
        """The parameters the optimizer must skip in the coming step (plain torch skips a
        parameter whose ``.grad`` is None; see [Note: used parameters] in core/gradient_ledger.py)."""
        if not self.reducer.ledger.unused_known:
            self.settle_gradients()
        return self.reducer.without_gradient()

    def count_optimizer_step(self) -> None:
        """Every ``step()`` call counts, also one with nothing to do: ranks in step call it
        equally often (see [Note: ranks out of step] in shardpar.comm.watch)."""
        self.state.step_count += 1

    # ------------------------------------------------------------------ state dicts and pieces

    @property
    def named_params(self) -> list[tuple[str, nn.Parameter]]:
        return self.inventory.named

    @property
    def trainable(self) -> list[tuple[str, nn.Parameter]]:
        return self.inventory.trainable

    @property
    def frozen(self) -> list[tuple[str, nn.Parameter]]:
        return self.inventory.frozen

    def element_orders(self) -> dict[str, ElementOrder]:
        """Every parameter's element order: pieces' ranges count its elements in that order,
        which is row-major unless it was wrapped in another memory format ([Note: element
        order] in core/element_order.py); checkpoints and state dicts translate."""
        orders: dict[str, ElementOrder] = self.storage.element_orders()
        return orders

    def save_pieces(self) -> list[TensorPiece]:
        """What this rank writes to a checkpoint: 1-D pieces of parameters (trainable and
        frozen, ranges in param space: see :meth:`element_orders`) such that, over all ranks,
        every element of every parameter is written exactly once. Buffers are not included
        (replicated; the checkpoint takes rank 0's). Under hybrid sharding the first shard group
        writes: every replica group holds the same shards, and a checkpoint holds each once."""
        return self.storage.save_pieces() if self.shards.replica_rank == 0 else []

    # ------------------------------------------------------------------ memory

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds, by kind, and the peaks of the transient kinds."""
        stats = {
            "params": self.storage.param_bytes(),
            "grads": self.strategy.grad_bytes(),
            "workspace": self.strategy.workspace_bytes(),
            "peak_staging": self.strategy.peak_staging_bytes,
        }
        stats.update(self.gatherer.memory_stats())
        return stats

    def collective_schedule(self) -> list[tuple[str, int, torch.dtype]]:
        """(kind, elements with padding, dtype) of each gradient reduction and parameter
        all-gather one steady step issues, in that order: what the benchmark times on its own
        to tell exposed from hidden communication."""
        kind = self.strategy.collective
        reductions = [(kind, b.spec.range.size, self.casts.reduce_dtype(b.space)) for b in self.reducer.buckets]
        return reductions + [("all_gather", numel, dtype) for numel, dtype in self.gatherer.gathers_per_step()]

    def layouts(self) -> list[BufferLayout]:
        """The BufferLayout of every bucketed parameter set: stage 0-2 buffers, stage 3 groups."""
        layouts: list[BufferLayout] = self.storage.layouts()
        return layouts

    @property
    def hook_handles(self) -> list[Any]:
        """Every hook this engine has registered and not removed yet."""
        unit_hooks = self.unit_hooks.handles if self.unit_hooks is not None else []
        return self._handles + self.use_hooks.handles + unit_hooks + self._cast_hooks

    def attach(self, part: Any) -> None:
        """Something built over this engine that must be undone with it: ``part.close()`` runs
        when the engine closes (the module facade's attributes and hooks)."""
        self._attached.append(part)

    def close(self) -> None:
        """Remove every hook this engine registered (the module keeps working unwrapped)."""
        watch.untrack(self.state)  # a closed engine is not what a rank is doing
        for handle in self.hook_handles:
            handle.remove()
        self._handles.clear()
        self.use_hooks.forget()
        self.unit_hooks = None
        self._cast_hooks = []
        for name in self.module_attributes:
            self.module.__dict__.pop(name, None)
        for part in reversed(self._attached):
            part.close()
        self._attached.clear()


def collect_cycles_before_exit() -> None:
    """[Note: collecting at exit] A wrapped model is a reference cycle (its modules' hooks
    hold the engine, which holds the modules), so a script that drops it leaves it to the
    cycle collector, with the process group the engine holds. Left to the interpreter's
    finalisation, the group would be destroyed after torch's own state, which can abort the
    process ("terminate called without an active exception") after a run that succeeded.
    Collecting at exit, while everything is alive, frees them in a healthy state; see also
    [Note: no group outlives destroy_process_group] in comm/process_group.py."""
    gc.collect()


atexit.register(collect_cycles_before_exit)
