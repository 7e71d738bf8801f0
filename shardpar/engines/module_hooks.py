"""The engine's hooks on the model's submodules, which drive its parts: at stages 0-2 on the
modules that use parameters (:class:`UseHooks`), at stage 3 on each unit's hook and entry
modules and on each use's inputs and outputs (:class:`UnitHooks`: every hook of stage 3's
gatherer; it calls down into the gatherer, which installs none). None goes inside a compiled module ([Note: compiled modules] in
core/units.py), also when the module is compiled after wrapping:

[Note: compiled after wrap]
torchtitan-style code may compile a block in place after ``shardpar.wrap``
(``model.module.layers[i].compile(fullgraph=True)``): the hooks are already on the modules
inside it, where compiled code would have to call them. So the root's pre-forward asks the
module tree which submodules were compiled since it was made (one attribute test per module)
and, if any, moves the hooks as if the blocks had been compiled before wrapping: stages 0-2
reinstall their use hooks (and mixed precision its casts) on a new tree, lifted to the
compiled modules; stage 3 takes the entry-module hooks off the modules inside a compiled
module (a use of the unit through the compiled module's own hooks is in progress whenever
they would run). Stage 3 cannot move a unit: its parameters were grouped at wrap time around
its hook modules, so a hook module inside a newly compiled module is an error naming both,
raised before any collective. A module *replaced* by a ``torch.compile`` wrapper after
wrapping is an error too: the wrapper is not the module the engine wrapped (its names gain
``_orig_mod.``); compiling in place is the same thing without the new names.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..core.flat_param import FlatParamGroup
from ..core.gatherer import UnitGatherer
from ..core.reducer import GradientReducer
from ..core.training_state import TrainingState
from ..core.units import Unit, UnitPlan, display_name
from .hooks import engine_hook, hook_first_grad, never_compiled, on_first_grad, output_tensors


def module_of_params(tree: Any, storage: Any) -> dict[str, str]:
    """Stages 0-2: each trainable parameter's use module (the first, for a tied one); ``tree``
    is the engine's module tree."""
    module_of: dict[str, str] = {}
    for hook_name, names in storage.use_modules(tree.lift).items():
        for name in names:
            module_of.setdefault(name, hook_name)
    return module_of


class UseHooks:
    """Stages 0-2: the modules that register parameters (lifted out of compiled regions)
    tell the first-step orders they run (core/first_step_orders.py) and complete lazy gathers
    (stages 1-2).

    [Note: one gather hook per bucket]
    A forward pre-hook costs every forward a slow path through ``nn.Module.__call__`` (about
    3 µs on a CPU core, the hook's own work aside): on the overhead model's 193 modules with
    parameters, about 0.5 ms of a stage-1 step (docs/benchmarks.md, "one gather hook per
    bucket"). Until the end of the first
    forward with autograd every use module has its hook, recording the order modules first
    run in; after it, a bucket's gather is completed by the hook of the module that used the
    bucket first in that order, and the other hooks go. Two kinds stay: those of compiled
    modules (compiled code must only ever see plain parameters: [Note: guarded parameters] in
    core/param_guard.py) and those of a bucket no recorded forward used (a branch not taken
    then). A module that runs before its bucket's hooked module in a later forward (the
    control flow changed) reads guarded parameters, and the guard completes the gather first:
    the same values, later. When the buckets are rebuilt or the hooks move (modules compiled
    after wrap), the new hooks are thinned at once, by the order recorded."""

    def __init__(self, tree: Any, storage: Any, reducer: GradientReducer) -> None:
        self.tree, self.storage, self.reducer = tree, storage, reducer
        self.first_use: list[Any] = []
        """Stage 0's use-module hooks: they record first use in the first forward only."""
        self._gathering: dict[str, tuple[list[int], Any]] = {}
        """Stages 1-2's use-module hooks, which complete lazy gathers of the current buckets:
        hook module -> (the positions of the buckets it gathers, its hook's handle)."""
        self._order_recorded = False
        """Whether a forward with autograd ended, recording the order of :attr:`_first_runs`."""
        self._first_runs: dict[str, None] = {}
        """Hook modules in the order they first ran while the first-step orders recorded uses
        (a dict as an ordered set)."""
        self.installed = False
        """Whether the stage's row installed them (stages 0-2)."""

    @property
    def gathers(self) -> list[Any]:
        """The handles of the gather hooks."""
        return [handle for _, handle in self._gathering.values()]

    @property
    def handles(self) -> list[Any]:
        return self.first_use + self.gathers

    def install(self) -> None:
        self.installed = True
        modules = self.tree.modules
        for hook_name, names in self.storage.use_modules(self.tree.lift).items():
            positions = sorted({self.reducer.bucket_of[name].position for name in names})
            groups = [self.storage.groups[p] for p in positions] if self.storage.groups else []
            # A partial: no extra Python call.
            hook = engine_hook(functools.partial(self._on_use, hook_name, names, groups))
            handle = modules[hook_name].register_forward_pre_hook(hook, prepend=True)
            if groups:
                self._gathering[hook_name] = (positions, handle)
            else:
                self.first_use.append(handle)

    def _on_use(
        self, hook_name: str, names: list[str], groups: list[FlatParamGroup], module: nn.Module, args: Any
    ) -> None:
        orders = self.reducer.orders
        if (
            orders.records_uses
        ):  # else nothing to record: skip the call ([Note: the host's share of a step] in hooks.py)
            orders.module_runs(names)
            self._first_runs.setdefault(hook_name)
        for group in groups:
            group.wait_unsharded()

    def after_forward(self) -> None:
        """A forward with autograd returned from the root: after the first, stage 0's first-use
        hooks go, and stages 1-2 keep one gather hook per bucket ([Note: one gather hook per
        bucket])."""
        if not self._order_recorded:
            self.remove_first_use()
            self._order_recorded = True
            self._thin_gathers()

    def remove_first_use(self) -> None:
        for handle in self.first_use:
            handle.remove()
        self.first_use.clear()

    def _thin_gathers(self) -> None:
        first_user: dict[int, str] = {}
        for hook_name in self._first_runs:
            if hook_name in self._gathering:
                for position in self._gathering[hook_name][0]:
                    first_user.setdefault(position, hook_name)
        compiled = set(self.tree.compiled)
        for hook_name, (positions, handle) in list(self._gathering.items()):
            keeps = hook_name in compiled or any(first_user.get(p, hook_name) == hook_name for p in positions)
            if not keeps:
                handle.remove()
                del self._gathering[hook_name]

    def reinstall_gathers(self) -> None:
        """After the buckets were rebuilt: the lazy gathers to complete are the new buckets'."""
        for handle in self.gathers:
            handle.remove()
        self._gathering.clear()
        self.install()
        if self._order_recorded:
            self._thin_gathers()

    def move_to(self, tree: Any) -> None:
        """Modules were compiled after wrapping (see [Note: compiled after wrap]): the same
        hooks, lifted out of ``tree``'s compiled modules; first-use hooks only while the first
        forward has not ended."""
        self.tree = tree
        if not self.installed:
            return
        for handle in self.handles:
            handle.remove()
        self.forget()
        self.install()
        if self._order_recorded:
            self.remove_first_use()
            self._thin_gathers()

    def forget(self) -> None:
        """The engine closed (it removed every handle)."""
        self.first_use.clear()
        self._gathering.clear()


class QuietEntries:
    """Stage 3's entry hooks taken off while a use of their unit is in progress.

    [Note: entry hooks quiet inside a use]
    An entry module's pre-hook starts a use of its unit only when none is in progress
    ([Note: entry modules] in core/units.py), and an entry module almost always runs inside
    one: its block's forward. There the hook does nothing, yet a module with any hook takes
    ``nn.Module.__call__``'s slow path, about 4 µs a call on a CPU core with the hook's own
    call: 0.8 ms of a stage-3 step on the overhead model's 192 entry modules (issue #44). So
    when a use begins, each of the unit's entry modules whose only forward pre-hook is the
    entry hook gets an empty hook dict in its place (one dict store; with no other hook left
    the module takes the fast path), and when the use ends the hook dict is put back. Nothing
    of anyone else's is skipped: a module with another pre-hook, and one that is an entry of
    another unit too, keeps its hooks. A pre-hook registered on such a module while its dict
    stood aside lands in the stand-in; putting back then keeps the stand-in, whose handles
    that registration holds, with the entry hook put back at its front and the entry hook's
    handle pointed at it. Uses that never end (a raised forward, a recompute that
    checkpointing stopped early) are forgotten by the gatherer at the root's next forward, its
    abandonment or the end of backward, when every hook is put back too."""

    def __init__(self) -> None:
        self._entries: dict[Unit, list[_QuietEntry]] = {}
        """Unit -> its entry modules that are entries of it alone."""
        self._off: dict[Unit, list[tuple[_QuietEntry, dict[int, Any]]]] = {}
        """Unit -> (entry, the module's own hook dict) for each hook dict standing aside."""

    def add(self, unit: Unit, name: str, module: nn.Module, handle: Any) -> None:
        self._entries.setdefault(unit, []).append(_QuietEntry(name, module, handle))

    def forget(self, name: str) -> None:
        """The entry hooks of module ``name`` come off for good (it was compiled after wrap)."""
        for entries in self._entries.values():
            entries[:] = [entry for entry in entries if entry.name != name]

    def take_off(self, unit: Unit) -> None:
        """A use of ``unit`` began: its entry modules' hook dicts stand aside where the entry
        hook is their only pre-hook."""
        if unit in self._off:
            return
        off = []
        for entry in self._entries.get(unit, ()):
            module_dict = entry.module_dict
            hooks = module_dict["_forward_pre_hooks"]
            if len(hooks) == 1 and entry.handle.id in hooks:
                module_dict["_forward_pre_hooks"] = entry.stand_in
                off.append((entry, hooks))
        self._off[unit] = off

    def put_back(self, unit: Unit) -> None:
        """The use of ``unit`` ended: every hook dict it took off is back."""
        for entry, hooks in self._off.pop(unit, ()):
            stand_in = entry.stand_in
            if not stand_in:
                entry.module_dict["_forward_pre_hooks"] = hooks
                continue
            # A pre-hook was registered meanwhile: its handle knows the stand-in, which stays.
            stand_in.update(hooks)
            stand_in.move_to_end(entry.handle.id, last=False)  # the entry hook was registered with prepend
            entry.handle.hooks_dict_ref = weakref.ref(stand_in)
            entry.module_dict["_forward_pre_hooks"] = stand_in
            entry.stand_in = collections.OrderedDict()

    def put_back_all(self) -> None:
        for unit in list(self._off):
            self.put_back(unit)


class _QuietEntry:
    """One entry module :class:`QuietEntries` may quiet: its name, its ``__dict__`` (where
    ``nn.Module`` keeps its hook dicts), the entry hook's handle, and the empty dict that
    stands in for its hook dict."""

    __slots__ = ("name", "module_dict", "handle", "stand_in")

    def __init__(self, name: str, module: nn.Module, handle: Any) -> None:
        self.name = name
        self.module_dict: dict[str, Any] = module.__dict__
        self.handle = handle
        self.stand_in: collections.OrderedDict[int, Any] = collections.OrderedDict()


class _PostBackward(torch.autograd.Function):
    """Identity on a use's inputs; its backward tells the gatherer the use's backward is done.
    As a node of its own it runs before hooks on those input tensors and on the node that made
    them, i.e. before the previous unit's pre-backward starts its prefetch."""

    @staticmethod
    def forward(ctx: Any, gatherer: UnitGatherer, unit: Unit, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.gatherer, ctx.unit = gatherer, unit
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.gatherer.post_backward(ctx.unit)
        return (None, None) + grads


class UnitHooks:
    """Stage 3: every hook that drives the gatherer ([Note: one step at stage 3] in
    core/gatherer.py): on each unit's hook and entry modules, on each use's inputs (an identity
    autograd function: the use's backward is over) and on its outputs (their first gradient:
    the use's backward starts). Each calls the engine-side work (the first backward's start,
    the launch order's record) and the gatherer; neither calls back."""

    def __init__(
        self,
        gatherer: UnitGatherer,
        reducer: GradientReducer,
        state: TrainingState,
        start_backward: Callable[[], None],
        units: Sequence[Unit],
        plans: Sequence[UnitPlan],
        modules: dict[str, nn.Module],
    ) -> None:
        self.gatherer, self.reducer, self.state = gatherer, reducer, state
        self.start_backward = start_backward
        """The engine's start of a backward ([Note: end of backward] in engine.py), run first by
        every pre-backward hook."""
        self.units = list(units)
        # Made once: a hook per unit output per forward is only registered, not built. The
        # hooks are partials of the methods (no lambda between: a call fewer per hook, three
        # per unit per step).
        self._pre_backward_hooks = {unit: never_compiled(functools.partial(self._pre_backward, unit)) for unit in units}
        self.on_hook_modules: list[Any] = []
        for unit in units:
            for hook_name in unit.hook_modules:
                module = modules[hook_name]
                self.on_hook_modules.append(
                    module.register_forward_pre_hook(
                        engine_hook(functools.partial(self._pre_forward, unit)),
                        prepend=True,
                        with_kwargs=True,
                    )
                )
                self.on_hook_modules.append(
                    module.register_forward_hook(engine_hook(functools.partial(self._post_forward, unit)))
                )
        self.on_entry_modules: dict[str, list[Any]] = {}
        """Entry module -> its hooks' handles (see [Note: entry modules] in core/units.py)."""
        self._leave_hooked: set[tuple[Unit, str]] = set()
        """(unit, entry module) pairs whose forward hook is on (see :meth:`_hook_leave`)."""
        # An entry module runs almost always inside a use of its unit (its block's forward),
        # where its hook does nothing: it asks the unit first, itself, and calls down only when
        # there is something to do (the gatherer's enter asks the same again). Inside a use
        # the hook is also taken off for the time being (see [Note: entry hooks quiet inside
        # a use]).
        entry_units: dict[str, list[Unit]] = {}
        for unit, plan in zip(units, plans):
            for entry_name in plan.entry_modules:
                entry_units.setdefault(entry_name, []).append(unit)
        self._quiet = QuietEntries()
        for unit, plan in zip(units, plans):
            for entry_name in plan.entry_modules:
                handle = modules[entry_name].register_forward_pre_hook(
                    engine_hook(
                        lambda m, args, kwargs, unit=unit, name=entry_name: (
                            None if unit.running else self._enter(unit, name, m, args, kwargs)
                        )
                    ),
                    prepend=True,
                    with_kwargs=True,
                )
                self.on_entry_modules.setdefault(entry_name, []).append(handle)
                if len(entry_units[entry_name]) == 1:  # an entry of another unit too must keep its hook
                    self._quiet.add(unit, entry_name, modules[entry_name], handle)

    # ------------------------------------------------------------------ a use of a unit

    def _pre_forward(
        self, unit: Unit, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self.gatherer.pre_forward(unit)
        if unit.running == 1:  # the use began (not one nested in another use of it)
            self._quiet.take_off(unit)
        if self.reducer.orders.records_uses:  # read here, so that a use calls in only while they record
            self._record_use(unit)
        return self._hook_inputs(unit, args, kwargs)

    def _post_forward(self, unit: Unit, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.gatherer.post_forward(unit)
        if not unit.running:
            self._quiet.put_back(unit)
        self._hook_outputs(unit, output)

    def _enter(
        self, unit: Unit, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if not self.gatherer.enter(unit, module):
            return None  # a use of the unit is in progress
        self._quiet.take_off(unit)
        if (unit, name) not in self._leave_hooked:
            self._hook_leave(unit, name, module)
        self._record_use(unit)
        return self._hook_inputs(unit, args, kwargs)

    def _hook_leave(self, unit: Unit, name: str, module: nn.Module) -> None:
        """The forward hook that ends a use an entry module started, put on by the first such
        use rather than at wrap: inside its unit's uses, where an entry module almost always
        runs, that hook would be a call that does nothing (once per entry module per forward).
        Registered from the module's own pre-hook, it runs after this very forward: torch reads
        a module's forward hooks once its forward returns (or raises: ``always_call``). It stays
        on, so a model that enters this way every step registers it once; it is never removed
        from inside a call (torch iterates the hooks of a raised forward as a live dict)."""
        self._leave_hooked.add((unit, name))
        self.on_entry_modules[name].append(
            module.register_forward_hook(
                engine_hook(
                    lambda m, args, output, unit=unit: self._leave(unit, m, output) if unit.entered_by is m else None
                ),
                always_call=True,
            )
        )

    def _leave(self, unit: Unit, module: nn.Module, output: Any) -> None:
        if self.gatherer.leave(unit, module):
            if not unit.running:
                self._quiet.put_back(unit)
            self._hook_outputs(unit, output)

    def uses_forgotten(self) -> None:
        """The gatherer forgot the uses in progress (a raised forward, a recompute that
        checkpointing stopped early, a new forward or the end of backward): every entry hook
        taken off for one is put back."""
        self._quiet.put_back_all()

    def _pre_backward(self, unit: Unit, grad: Any) -> None:
        self.start_backward()
        self.gatherer.pre_backward(unit)

    def _record_use(self, unit: Unit) -> None:
        """A unit's use, to the first-step orders (their recording rule: core/first_step_orders.py),
        while they record any (as a use hook does, once per unit use)."""
        orders = self.reducer.orders
        if orders.records_uses:  # else nothing to record: the attribute is read, not called in
            orders.module_runs(unit.trainable_names)

    def _hook_inputs(
        self, unit: Unit, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        """The use's inputs through :class:`_PostBackward`: its backward ends the use's backward.
        Only the arguments that hold a tensor needing a gradient are replaced; a container is
        made again only if it holds one, so a list the caller passed for the module to fill
        (``block(x, into=results)``) is still the caller's."""
        if not torch.is_grad_enabled():
            return None
        # (loops rather than comprehensions: each of those is a call, once per unit use)
        only_tensors = not kwargs  # block(x): no tree walk
        for a in args if only_tensors else ():
            if not isinstance(a, torch.Tensor):
                only_tensors = False
                break
        if only_tensors:
            positions, tensors = [], []
            for i, t in enumerate(args):
                if t.requires_grad:
                    positions.append(i)
                    tensors.append(t)
            if not positions:
                return None  # freed when its gradients are final, or at the end of backward
            leaves = list(args)
            for i, tensor in zip(positions, _PostBackward.apply(self.gatherer, unit, *tensors)):  # type: ignore[no-untyped-call]
                leaves[i] = tensor
            return tuple(leaves), kwargs
        values = [*args, *kwargs.values()]
        opened = []  # (position in values, its leaves, their spec) of each value holding such a tensor
        tensors = []
        for position, value in enumerate(values):
            leaves, spec = tree_flatten(value)
            needing_grad = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            if needing_grad:
                opened.append((position, leaves, spec))
                tensors.extend(needing_grad)
        if not tensors:
            return None
        outputs = iter(_PostBackward.apply(self.gatherer, unit, *tensors))  # type: ignore[no-untyped-call]
        for position, leaves, spec in opened:
            values[position] = tree_unflatten(
                [next(outputs) if isinstance(t, torch.Tensor) and t.requires_grad else t for t in leaves], spec
            )
        return tuple(values[: len(args)]), dict(zip(kwargs, values[len(args) :]))

    def _hook_outputs(self, unit: Unit, output: Any) -> None:
        """A hook on the use's outputs: their first gradient starts the use's backward. An
        output with no tensor to be seen may hide some (an object of the model's own class):
        the unit is then held gathered through its backward, which no hook can start (see
        [Note: one step at stage 3] in core/gatherer.py)."""
        if not torch.is_grad_enabled():
            return
        if isinstance(output, torch.Tensor):  # a block's one output: hooked without the tree walk
            if output.requires_grad:
                hook_first_grad(output, self._pre_backward_hooks[unit])
            return
        tensors = output_tensors(output)
        needing_grad = [t for t in tensors if t.requires_grad]
        if needing_grad:
            on_first_grad(needing_grad, self._pre_backward_hooks[unit])
        elif not tensors:
            self.gatherer.hold_until_backward(unit)

    @property
    def handles(self) -> list[Any]:
        return self.on_hook_modules + [h for handles in self.on_entry_modules.values() for h in handles]

    def move_to(self, tree: Any) -> None:
        """Modules were compiled after wrapping (see [Note: compiled after wrap]): entry hooks
        inside them come off; a hook module inside one is an error."""
        for unit in self.units:
            for hook_name in unit.hook_modules:
                if tree.inside_compiled(hook_name):
                    compiled = display_name(tree.lift(hook_name))
                    raise RuntimeError(
                        f"shardpar (stage 3): module '{compiled}' was compiled after shardpar.wrap, and "
                        f"unit '{unit.name}' is gathered around the forward of '{display_name(hook_name)}' "
                        f"inside it, which compiled code cannot call out to. Compile '{compiled}' before "
                        f"shardpar.wrap (its units are then planned around it), or compile the unit's "
                        f"own module ('{display_name(hook_name)}') after wrapping"
                    )
        self._quiet.put_back_all()
        for entry_name in [name for name in self.on_entry_modules if tree.inside_compiled(name)]:
            self._quiet.forget(entry_name)
            for handle in self.on_entry_modules.pop(entry_name):
                handle.remove()
            self._leave_hooked = {(unit, name) for unit, name in self._leave_hooked if name != entry_name}
