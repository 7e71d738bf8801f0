"""Stage-3 units: which parameters are gathered together, and around which modules' forward
(:func:`plan_units`); what a backward still needs of each (:class:`Unit`).

[Note: units]
A wrap policy picks submodules as *units* (a transformer block, typically): their parameters
are gathered just before the unit's forward and its backward and freed after. A parameter
registered by several modules (a tied embedding and LM head) belongs to the innermost
policy unit that encloses all of them.

Parameters no policy unit encloses (embeddings, a final norm, a tied head: what FSDP2 leaves
to the root) are not held for the whole step. They form *leftover units*, grouped by the
modules that use them: each owner module is mapped to its *hook module*, the outermost
module on the path from the root to the owner that contains no policy unit and runs a
forward of its own (containers such as ``ModuleList`` do not), and leftover parameters with
the same set of hook modules form one unit, gathered around each hook module's forward. A
tied embedding/head therefore has two hook modules and is gathered for each of its two uses,
exactly like a block applied twice. Only parameters registered directly on the wrapped
module itself have the root as hook module and stay gathered for the root's whole forward
(and backward) -- and so do leftover units smaller than ``min_unit_params`` (a norm, a
position table), which are not worth a gather of their own.

[Note: entry modules]
A unit is gathered around its hook modules' forward, but code may call the modules inside a
hook module without calling the hook module itself: timm's ``--grad-checkpointing`` runs
``checkpoint_seq([model.layer1, ...])``, which calls each stage's blocks directly and never
``layer1.forward``; a parent may loop ``for block in self.layer1``; a ``generate``-like method
may call a block's submodules. So every module on the path from a unit's hook module down to
the modules that register its parameters (running a forward of its own, outside compiled
code) is an *entry module* of the unit: when its forward starts and no use of the unit is in
progress, that call is a use of the unit like a hook module's (gathered, hooked for backward,
freed after, see [Note: one step at stage 3]); inside a use (the hook module's forward, or
another entry module's) it does nothing. Consecutive uses through entry modules in one
forward share one gather (a unit is freed when another unit starts); in backward each use is
gathered for its own backward, so a unit whose hook module is bypassed pays one gather per
module call there, where ``wrap_policy`` naming the called modules' class pays one.

[Note: compiled modules]
A module is *compiled* when ``torch.compile`` made it an ``OptimizedModule`` around the original
(``_orig_mod``), or when ``module.compile()`` compiled it in place (``_compiled_call_impl`` set:
torchtitan's ``block.compile(fullgraph=True)``). Either way its own hooks run eagerly, around
the compiled code: dynamo skips ``nn.Module._call_impl``, the frame that runs them, and starts
tracing at ``forward``. Hooks on the modules *inside* it would run inside compiled code, where
an engine hook (compiler-disabled: it launches collectives) breaks the graph, and
``fullgraph=True`` refuses that. So no engine hook goes inside a compiled module: anything a
policy or the leftover rule picks inside one is lifted to the compiled module itself (a
``checkpoint_wrapper`` around a block, compiled, is the unit a ``[Block]`` policy picks), and a
class policy matches a compiled module by the class of its ``_orig_mod``. This is how FSDP2
works with compiled blocks: ``fully_shard(block)`` hooks only the block itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from .flat_param import FlatParamGroup

ROOT = ""
"""Qualified name of the wrapped module itself."""


def encloses(outer: str, name: str) -> bool:
    """Whether module ``outer`` is module ``name`` or one of its ancestors (qualified names;
    the root encloses every module)."""
    return outer == ROOT or name == outer or name.startswith(outer + ".")


def is_compiled(module: nn.Module) -> bool:
    """Wrapped by ``torch.compile`` or compiled in place by ``module.compile()`` (see [Note:
    compiled modules])."""
    from torch._dynamo.eval_frame import OptimizedModule

    if isinstance(module, OptimizedModule):
        return True
    # A container compiled in place is never called: its modules' hooks still run eagerly.
    return module._compiled_call_impl is not None and type(module).forward is not nn.Module.forward


def runs_forward(module: nn.Module) -> bool:
    """Containers such as ModuleList/ModuleDict never run ``forward``: hooks on them never
    fire. A compiled module runs its original's forward."""
    return is_compiled(module) or type(module).forward is not nn.Module.forward


def _original(module: nn.Module) -> nn.Module:
    """What a class policy looks at: the module a ``torch.compile`` wrapper holds."""
    from torch._dynamo.eval_frame import OptimizedModule

    return module._orig_mod if isinstance(module, OptimizedModule) else module


@dataclass(frozen=True)
class UnitPlan:
    """One unit: the parameters gathered together and the modules whose forward gathers them."""

    name: str
    """The policy module's qualified name, or the hook modules' names joined by '+'
    (``<root>`` for the wrapped module itself)."""
    hook_modules: tuple[str, ...]
    params: tuple[str, ...]
    """Canonical parameter names, in registration order."""
    from_policy: bool
    entry_modules: tuple[str, ...] = ()
    """Modules whose forward gathers the unit when no use of it is in progress (see [Note:
    entry modules])."""


class Unit:
    """One stage-3 unit: its flat groups and what this backward still needs of them."""

    def __init__(
        self,
        index: int,
        name: str,
        hook_modules: tuple[str, ...],
        flats: list[FlatParamGroup],
        from_policy: bool = True,
    ) -> None:
        self.index = index
        self.name = name
        self.hook_modules = hook_modules
        self.flats = flats
        self.from_policy = from_policy
        self.trainable: list[FlatParamGroup] = [f for f in flats if f.trainable]
        self.trainable_names: tuple[str, ...] = tuple(name for f in self.trainable for name in f.params)
        """The trainable groups' parameter names (what a use tells the first-step orders)."""
        self.active_backward = 0
        """Uses whose backward started (pre-backward) and has not reached the inputs yet."""
        self.final: set[FlatParamGroup] = set()
        """Trainable groups whose gradients are final in this backward (not gathered again):
        changed only through :meth:`mark_final` and :meth:`clear_final`, which keep
        :attr:`needed` and :attr:`backward_done` with it."""
        self.needed: list[FlatParamGroup] = list(flats)
        """The groups a gather of this unit still needs: all but the final ones (kept as
        ``final`` changes, so the hooks read it without building it)."""
        self.backward_done = False
        """Every trainable group's gradients are final in this backward (a unit with none never is)."""
        self.running = 0
        """Uses of the unit whose forward is running (see [Note: entry modules])."""
        self.entered_by: Any = None
        """The entry module whose forward started the use in progress, if one did."""

    def mark_final(self, flat: FlatParamGroup) -> None:
        """``flat``'s gradients are final in this backward."""
        self.final.add(flat)
        needed = []  # (a loop rather than a comprehension, which is a call: once per group per step)
        for f in self.flats:
            if f not in self.final:
                needed.append(f)
        self.needed = needed
        self.backward_done = len(self.final) == len(self.trainable)

    def clear_final(self) -> None:
        """A new backward (or a recompute after the gradients were final): every group is needed again."""
        if self.final:
            self.final.clear()
            self.needed = list(self.flats)
            self.backward_done = False

    def full_bytes(self) -> int:
        return sum(f.full_bytes for f in self.flats)


def display_name(qualified: str) -> str:
    return qualified if qualified else "<root>"


class ModuleTree:
    """The wrapped module's submodules by qualified name.

    [Note: a module under several names]
    One module object may be registered under several names (``m[1].in_proj = m[0].in_proj``,
    ``nn.Sequential(mlp, mlp)``): torch, DDP and FSDP2 train such models. ``modules`` holds each
    module once, under its *canonical* name (the first, as ``named_modules()`` yields it);
    ``aliases`` lists every name of it, so that questions about where a module is used (does a
    unit enclose this use, which hook module does this use go through) see every use, while
    hooks go on the one object once."""

    def __init__(self, root: nn.Module) -> None:
        self.modules: dict[str, nn.Module] = dict(root.named_modules())
        self.every_name: dict[str, nn.Module] = dict(root.named_modules(remove_duplicate=False))
        canonical = {id(module): name for name, module in self.modules.items()}
        self.canonical: dict[str, str] = {name: canonical[id(module)] for name, module in self.every_name.items()}
        """Any name of a module -> its canonical name."""
        self.aliases: dict[str, list[str]] = {name: [] for name in self.modules}
        for name, first in self.canonical.items():
            self.aliases[first].append(name)
        self.order = {name: index for index, name in enumerate(self.every_name)}
        compiled = [n for n, m in self.modules.items() if n and is_compiled(m)]
        self.compiled = sorted(compiled, key=len)  # outermost first
        """Compiled submodules (the root is never lifted to), outermost first."""
        self._registrations = [
            (parent._modules, key, child)
            for parent in self.modules.values()
            for key, child in parent._modules.items()
            if child is not None
        ]
        """Every (parent's ``_modules``, key, child) as wrapped: what :meth:`compiled_since`
        compares with."""

    def compiled_since(self) -> list[str]:
        """Submodules compiled in place (``module.compile()``) since this tree was made, by
        canonical name; a submodule replaced by a ``torch.compile`` wrapper of itself is an
        error (see [Note: compiled after wrap] in engines/module_hooks.py). Cheap, as it runs
        at every root forward: one dict look-up per registration, and one attribute test per
        module with no call -- a module of this tree that was not compiled when it was made
        can become compiled only in place, which sets its ``_compiled_call_impl``, so only a
        module with that set is asked :func:`is_compiled`."""
        from torch._dynamo.eval_frame import OptimizedModule

        for registered, key, child in self._registrations:
            now = registered.get(key)
            if now is not child and isinstance(now, OptimizedModule) and now._orig_mod is child:
                name = display_name(self.canonical_name_of(child))
                raise RuntimeError(
                    f"shardpar: module '{name}' was replaced by torch.compile({name}) after shardpar.wrap; "
                    "the engine's hooks sit on the modules it wrapped. Compile it in place instead "
                    "(block.compile(...) on the module itself: parameter names stay the same), or "
                    "assign the torch.compile wrapper before shardpar.wrap"
                )
        known = set(self.compiled)
        return [
            n
            for n, m in self.modules.items()
            if m._compiled_call_impl is not None and n and n not in known and is_compiled(m)
        ]

    def canonical_name_of(self, module: nn.Module) -> str:
        return next(name for name, m in self.modules.items() if m is module)

    def lift(self, name: str) -> str:
        """The outermost compiled module enclosing ``name`` (or ``name`` itself), by canonical name."""
        name = self.canonical[name]
        for outer in self.compiled:
            if encloses(outer, name):
                return outer
        return name

    def inside_compiled(self, name: str) -> bool:
        return self.lift(name) != self.canonical[name]

    def encloses(self, outer: str, name: str) -> bool:
        """Whether the module ``outer`` (canonical name) is, or is an ancestor of, the use of a
        module under the name ``name`` (any alias)."""
        return any(encloses(alias, name) for alias in self.aliases[outer])

    def path(self, name: str) -> list[str]:
        """Names from the root's child down to ``name`` (empty for the root)."""
        if not name:
            return []
        parts = name.split(".")
        return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _select_policy_units(tree: ModuleTree, policy: Any, min_params: int) -> list[str]:
    """Qualified names of the submodules the wrap policy makes units (root excluded)."""
    named = [(n, m) for n, m in tree.modules.items() if n and runs_forward(m) and not tree.inside_compiled(n)]
    if policy is None or isinstance(policy, int):
        threshold = min_params if policy is None else policy
        chosen: list[str] = []
        claimed: set[nn.Parameter] = set()
        for name, sub in reversed(named):  # children before parents (post-order by position)
            own = [p for p in sub.parameters() if p not in claimed]
            if sum(p.numel() for p in own) >= threshold:
                chosen.append(name)
                claimed.update(own)
        if isinstance(policy, int) and not chosen:
            raise ValueError(
                f"wrap_policy={policy} selects no submodule (none has {policy} parameters or more); "
                "lower the threshold or name module classes"
            )
        return sorted(chosen, key=tree.order.__getitem__)
    # A class or callable policy may pick modules inside a compiled module (torchtitan compiles
    # a checkpoint wrapper around each block): the compiled module is the unit instead.
    candidates = [(n, m) for n, m in tree.modules.items() if n and runs_forward(m)]

    def lifted(picked: list[str]) -> list[str]:
        return sorted({tree.lift(n) for n in picked}, key=tree.order.__getitem__)

    if isinstance(policy, (list, tuple, set)):
        classes = tuple(policy)
        for cls in classes:
            if not isinstance(cls, type) or not issubclass(cls, nn.Module):
                raise ValueError(f"wrap_policy entries must be nn.Module classes, got {cls!r}")
            if not any(isinstance(_original(m), cls) for _, m in candidates):
                raise ValueError(f"wrap_policy names {cls.__qualname__}, but the model has no module of that class")
        return lifted([n for n, m in candidates if isinstance(_original(m), classes)])
    if callable(policy):
        chosen = lifted([n for n, m in candidates if policy(n, _original(m))])
        if not chosen:
            raise ValueError("wrap_policy selects no submodule; every parameter would be in the root unit")
        return chosen
    raise TypeError(f"wrap_policy must be None, an int, a sequence of module classes or a callable, got {policy!r}")


def _owners(root: nn.Module) -> dict[nn.Parameter, list[str]]:
    """Every parameter -> the qualified names of the modules that register it."""
    owners: dict[nn.Parameter, list[str]] = {}
    for module_name, sub in root.named_modules(remove_duplicate=False):
        for _, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(param, [])
            if module_name not in owners[param]:
                owners[param].append(module_name)
    return owners


def _hook_module(tree: ModuleTree, owner: str, units: list[str]) -> str:
    """See [Note: units]: the outermost module on the root -> owner path that contains no
    policy unit and runs a forward (lifted out of compiled modules)."""
    for name in tree.path(owner):
        contains_unit = any(encloses(name, alias) for u in units for alias in tree.aliases[u])
        if not contains_unit and runs_forward(tree.every_name[name]):
            return tree.lift(name)
    return tree.lift(owner) if owner and runs_forward(tree.every_name[owner]) else ROOT


def _entry_modules(tree: ModuleTree, hooks: tuple[str, ...], owners: set[str]) -> tuple[str, ...]:
    """See [Note: entry modules]: the modules strictly inside a hook module on the way to an
    owner (itself included), in registration order."""
    entries: set[str] = set()
    for owner in owners:
        for name in tree.path(tree.lift(owner)):
            if (
                name not in hooks
                and any(encloses(h, name) for h in hooks)
                and runs_forward(tree.modules[name])
                and not tree.inside_compiled(name)
            ):
                entries.add(name)
    return tuple(sorted(entries, key=tree.order.__getitem__))


def plan_units(root: nn.Module, policy: Any, min_params: int) -> list[UnitPlan]:
    """Every unit of ``root`` at stage 3 (see [Note: units]), in the order their first hook
    module is registered; units without parameters are left out."""
    tree = ModuleTree(root)
    policy_units = _select_policy_units(tree, policy, min_params)
    canonical = {p: n for n, p in root.named_parameters()}
    owners = _owners(root)
    assigned: dict[str, list[str]] = {u: [] for u in policy_units}
    leftovers: dict[tuple[str, ...], list[str]] = {}
    for param, name in canonical.items():
        enclosing = [u for u in policy_units if all(tree.encloses(u, o) for o in owners[param])]
        if enclosing:
            assigned[max(enclosing, key=len)].append(name)
            continue
        hook_names = sorted({_hook_module(tree, o, policy_units) for o in owners[param]}, key=tree.order.__getitem__)
        leftovers.setdefault(tuple(hook_names), []).append(name)
    # Leftover units below the threshold are not worth a gather of their own (each costs a
    # collective's latency twice per step): they join the parameters the root itself uses.
    numel = {name: p.numel() for p, name in canonical.items()}
    held: list[str] = []
    for hooks in list(leftovers):
        if hooks != (ROOT,) and sum(numel[n] for n in leftovers[hooks]) < min_params:
            held += leftovers.pop(hooks)
    if held:
        order = {name: i for i, name in enumerate(canonical.values())}
        leftovers[(ROOT,)] = sorted(leftovers.get((ROOT,), []) + held, key=order.__getitem__)
    by_name = {name: p for p, name in canonical.items()}

    def entries(hooks: tuple[str, ...], params: list[str]) -> tuple[str, ...]:
        return _entry_modules(tree, hooks, {o for name in params for o in owners[by_name[name]]})

    plans = [UnitPlan(u, (u,), tuple(params), True, entries((u,), params)) for u, params in assigned.items() if params]
    plans += [
        UnitPlan("+".join(display_name(h) for h in hooks), hooks, tuple(params), False, entries(hooks, params))
        for hooks, params in leftovers.items()
    ]
    return sorted(plans, key=lambda plan: tree.order[plan.hook_modules[0]])
