"""The engine's hooks on the model's submodules, which drive its parts: at stages 0-2 on the
modules that use parameters (:class:`UseHooks`), at stage 3 on each unit's hook and entry
modules (:func:`unit_hooks`).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..core.gatherer import UnitGatherer
from ..core.reducer import GradientReducer
from ..core.training_state import TrainingState
from ..core.units import Unit, UnitPlan
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
    record first use (launch order) and complete lazy gathers (stages 1-2)."""

    def __init__(self, tree: Any, storage: Any, reducer: GradientReducer, state: TrainingState) -> None:
        self.tree, self.storage, self.reducer, self.state = tree, storage, reducer, state
        self.first_use: list[Any] = []
        """Stage 0's use-module hooks: they record first use in the first forward only."""
        self.gathers: list[Any] = []
        """Stages 1-2's use-module hooks: they complete lazy gathers of the current buckets."""

    @property
    def handles(self) -> list[Any]:
        return self.first_use + self.gathers

    def install(self) -> None:
        modules = self.tree.modules
        for hook_name, names in self.storage.use_modules(self.tree.lift).items():
            positions = sorted({self.reducer.bucket_of[name].position for name in names})
            groups = [self.storage.groups[p] for p in positions] if self.storage.groups else []
            hook = engine_hook(lambda module, args, names=names, groups=groups: self._on_use(names, groups))
            handle = modules[hook_name].register_forward_pre_hook(hook, prepend=True)
            (self.gathers if groups else self.first_use).append(handle)

    def _on_use(self, names: list[str], groups: list) -> None:
        if self.reducer.launch_order.recording and torch.is_grad_enabled() and not self.state.is_recompute():
            self.reducer.launch_order.saw(names)
        if self.reducer.ready_order is not None:
            self.reducer.ready_order.ran(names)
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

    def forget(self) -> None:
        """The engine closed (it removed every handle)."""
        self.first_use.clear()
        self.gathers.clear()


def unit_hooks(gatherer: UnitGatherer, units: Sequence[Unit], plans: Sequence[UnitPlan],
               modules: dict[str, nn.Module]) -> list[Any]:
    """Stage 3: the hooks on every unit's hook and entry modules that drive ``gatherer``; their
    handles."""
    handles = []
    for unit in units:
        for hook_name in unit.hook_modules:
            module = modules[hook_name]
            handles.append(module.register_forward_pre_hook(
                engine_hook(lambda m, args, kwargs, unit=unit: gatherer.pre_forward(unit, args, kwargs)),
                prepend=True, with_kwargs=True))
            handles.append(module.register_forward_hook(
                engine_hook(lambda m, args, output, unit=unit: gatherer.post_forward(unit, output))))
    for unit, plan in zip(units, plans):
        for entry_name in plan.entry_modules:  # see [Note: entry modules] in core/units.py
            module = modules[entry_name]
            handles.append(module.register_forward_pre_hook(
                engine_hook(lambda m, args, kwargs, unit=unit: gatherer.enter(unit, m, args, kwargs)),
                prepend=True, with_kwargs=True))
            handles.append(module.register_forward_hook(
                engine_hook(lambda m, args, output, unit=unit: gatherer.leave(unit, m, output)), always_call=True))
    return handles
