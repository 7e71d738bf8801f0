"""Plain copies of a wrapped module: ``copy.deepcopy(model.module)`` and ``torch.save(model.module)``.

[Note: plain copies]
Scripts written for DDP copy the inner module for an EMA or an evaluation model
(``ema = copy.deepcopy(model.module)``) or pickle it (``torch.save(model.module, path)``). A
wrapped module cannot be copied as it stands: its hooks call the engine (which holds process
groups), and at stage 3 its parameters have no values between steps. So the engine gives the
module a ``__deepcopy__`` and a ``__reduce_ex__`` of its own (instance attributes, which
``copy`` and ``pickle`` consult before the class), and both produce what the same call gives
under DDP: a module of the user's class, with its own hooks and attributes, but none of
shardpar's, and every parameter and persistent buffer holding the current full-precision
values (``full_state_dict()``; tied parameters stay tied). Gradients are not copied, nor
methods declared with ``register_forward_method`` (the copy's are its class's plain methods).
Because the values come from ``full_state_dict()``, the copy is a collective: every rank
makes it, as every rank calls ``state_dict()``.

A copy of the ``ShardedModule`` itself is refused by name (see ``module.py``): a second set of
engines over the same process groups would pair its collectives with the first.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from torch import nn

from ..core.param_guard import metadata_only
from .forward_methods import ForwardMethod

if TYPE_CHECKING:
    from .surface import ModuleSurface

COPY_HOOKS = ("__deepcopy__", "__reduce_ex__")
"""The instance attributes through which ``copy`` and ``pickle`` reach :func:`plain_copy`."""


def copy_hooks(surface: "ModuleSurface", marks: tuple[str, ...]) -> dict[str, Any]:
    """The instance attributes that give the managed module its plain copies; ``marks`` are the
    other instance attributes set on it, which a copy must not carry."""
    return {
        "__deepcopy__": lambda memo: plain_copy(surface, memo, marks),
        "__reduce_ex__": lambda protocol: plain_copy(surface, {}, marks).__reduce_ex__(protocol),
    }


def plain_copy(surface: "ModuleSurface", memo: dict[int, Any], marks: tuple[str, ...]) -> nn.Module:
    """See [Note: plain copies]."""
    module = surface.engine.module
    full = surface.full_state_dict()  # collective: every rank copies
    # deepcopy takes what ``memo`` already holds for an object instead of copying it: fresh
    # plain Parameters with the full values (one per Parameter object, so tied ones stay tied)...
    for name, param in module.named_parameters():
        with metadata_only():  # a stage-3 parameter's metadata, not its (absent) values
            requires_grad = param.requires_grad
        memo[id(param)] = nn.Parameter(full[name].clone(), requires_grad=requires_grad)
    for name, buffer in module.named_buffers():
        if name in full:  # persistent: back in the dtype the model was built with
            memo[id(buffer)] = full[name].clone()
    # ... and each hook dict the engine registered into, without the engine's entries.
    ours: dict[int, tuple[dict, set[int]]] = {}
    for handle in surface.hook_handles:
        for ref in (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())):
            hooks = ref()
            if hooks is not None:
                ours.setdefault(id(hooks), (hooks, set()))[1].add(handle.id)
    for hooks, ids in ours.values():
        memo[id(hooks)] = type(hooks)((k, copy.deepcopy(v, memo)) for k, v in hooks.items() if k not in ids)
    saved = {key: module.__dict__.pop(key) for key in (*marks, *COPY_HOOKS) if key in module.__dict__}
    declared = [(sub, {k: v for k, v in sub.__dict__.items() if isinstance(v, ForwardMethod)}) for sub in module.modules()]
    for sub, methods in declared:
        for key in methods:
            del sub.__dict__[key]
    try:
        return copy.deepcopy(module, memo)
    finally:
        module.__dict__.update(saved)
        for sub, methods in declared:
            sub.__dict__.update(methods)

