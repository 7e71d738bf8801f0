"""The engine's hooks on the model's submodules, which drive its parts: at stages 0-2 on the
modules that use parameters (:class:`UseHooks`), at stage 3 on each unit's hook and entry
modules (:class:`UnitHooks`). None goes inside a compiled module ([Note: compiled modules] in
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

from collections.abc import Sequence
from typing import Any

from torch import nn

from ..core.flat_param import FlatParamGroup
from ..core.gatherer import UnitGatherer
from ..core.reducer import GradientReducer
from ..core.units import Unit, UnitPlan, display_name
from .hooks import engine_hook


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
    (stages 1-2)."""

    def __init__(self, tree: Any, storage: Any, reducer: GradientReducer) -> None:
        self.tree, self.storage, self.reducer = tree, storage, reducer
        self.first_use: list[Any] = []
        """Stage 0's use-module hooks: they record first use in the first forward only."""
        self.gathers: list[Any] = []
        """Stages 1-2's use-module hooks: they complete lazy gathers of the current buckets."""
        self.installed = False
        """Whether the stage's row installed them (stages 0-2)."""

    @property
    def handles(self) -> list[Any]:
        return self.first_use + self.gathers

    def install(self) -> None:
        self.installed = True
        modules = self.tree.modules
        for hook_name, names in self.storage.use_modules(self.tree.lift).items():
            positions = sorted({self.reducer.bucket_of[name].position for name in names})
            groups = [self.storage.groups[p] for p in positions] if self.storage.groups else []
            hook = engine_hook(lambda module, args, names=names, groups=groups: self._on_use(names, groups))
            handle = modules[hook_name].register_forward_pre_hook(hook, prepend=True)
            (self.gathers if groups else self.first_use).append(handle)

    def _on_use(self, names: list[str], groups: list[FlatParamGroup]) -> None:
        self.reducer.orders.module_runs(names)
        for group in groups:
            group.wait_unsharded()

    def remove_first_use(self) -> None:
        for handle in self.first_use:
            handle.remove()
        self.first_use.clear()

    def reinstall_gathers(self) -> None:
        """After the buckets were rebuilt: the lazy gathers to complete are the new buckets'."""
        for handle in self.gathers:
            handle.remove()
        self.gathers.clear()
        self.install()

    def move_to(self, tree: Any) -> None:
        """Modules were compiled after wrapping (see [Note: compiled after wrap]): the same
        hooks, lifted out of ``tree``'s compiled modules; first-use hooks only while the first
        forward has not ended."""
        self.tree = tree
        if not self.installed:
            return
        recording = bool(self.first_use)
        for handle in self.handles:
            handle.remove()
        self.forget()
        self.install()
        if not recording:
            self.remove_first_use()

    def forget(self) -> None:
        """The engine closed (it removed every handle)."""
        self.first_use.clear()
        self.gathers.clear()


class UnitHooks:
    """Stage 3: the hooks on every unit's hook and entry modules that drive the gatherer."""

    def __init__(
        self, gatherer: UnitGatherer, units: Sequence[Unit], plans: Sequence[UnitPlan], modules: dict[str, nn.Module]
    ) -> None:
        self.units = list(units)
        self.on_hook_modules: list[Any] = []
        for unit in units:
            for hook_name in unit.hook_modules:
                module = modules[hook_name]
                self.on_hook_modules.append(
                    module.register_forward_pre_hook(
                        engine_hook(lambda m, args, kwargs, unit=unit: gatherer.pre_forward(unit, args, kwargs)),
                        prepend=True,
                        with_kwargs=True,
                    )
                )
                self.on_hook_modules.append(
                    module.register_forward_hook(
                        engine_hook(lambda m, args, output, unit=unit: gatherer.post_forward(unit, output))
                    )
                )
        self.on_entry_modules: dict[str, list[Any]] = {}
        """Entry module -> its hooks' handles (see [Note: entry modules] in core/units.py)."""
        for unit, plan in zip(units, plans):
            for entry_name in plan.entry_modules:
                module = modules[entry_name]
                self.on_entry_modules.setdefault(entry_name, []).extend(
                    [
                        module.register_forward_pre_hook(
                            engine_hook(lambda m, args, kwargs, unit=unit: gatherer.enter(unit, m, args, kwargs)),
                            prepend=True,
                            with_kwargs=True,
                        ),
                        module.register_forward_hook(
                            engine_hook(lambda m, args, output, unit=unit: gatherer.leave(unit, m, output)),
                            always_call=True,
                        ),
                    ]
                )

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
        for entry_name in [name for name in self.on_entry_modules if tree.inside_compiled(name)]:
            for handle in self.on_entry_modules.pop(entry_name):
                handle.remove()
