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
values, buffers in the dtypes the model was built with (the copy is made inside
``model.gathered()``'s context; tied parameters stay tied). Gradients are not copied, nor
methods declared with ``register_forward_method`` (the copy's are its class's plain methods).
Because the values are gathered at stages 1-3, the copy is a collective: every rank makes it,
as every rank calls ``state_dict()``.

A copy of the ``ShardedModule`` itself is refused by name (see ``sharded_module.py``): a second set of
engines over the same process groups would pair its collectives with the first.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from torch import nn

from .forward_methods import ForwardMethod

if TYPE_CHECKING:
    from .surface import ModuleSurface

COPY_HOOKS = ("__deepcopy__", "__reduce_ex__")
"""The instance attributes through which ``copy`` and ``pickle`` reach :func:`plain_copy`."""


def copy_hooks(surface: ModuleSurface, marks: tuple[str, ...]) -> dict[str, Any]:
    """The instance attributes that give the managed module its plain copies; ``marks`` are the
    engine's own instance attributes on it, which a copy must not carry."""
    return {
        "__deepcopy__": lambda memo: plain_copy(surface, memo, marks),
        "__reduce_ex__": lambda protocol: plain_copy(surface, {}, marks).__reduce_ex__(protocol),
    }


def plain_copy(surface: ModuleSurface, memo: dict[int, Any], marks: tuple[str, ...]) -> nn.Module:
    """See [Note: plain copies]."""
    module = surface.engine.module
    # Inside full_values (collective: every rank copies) the parameters and buffers hold their
    # full, full-precision values in the model's dtypes, which the copy takes.
    with surface.state.full_values(writeback=False):
        # deepcopy takes what ``memo`` already holds for an object instead of copying it: fresh
        # plain Parameters (one per Parameter object, so tied ones stay tied)...
        for _, param in module.named_parameters():
            memo[id(param)] = nn.Parameter(param.data.clone(), requires_grad=param.requires_grad)
        # ... and each hook dict the engine registered into, without the engine's entries.
        ours: dict[int, tuple[dict[int, Any], set[int]]] = {}
        for handle in surface.hook_handles:
            for ref in (handle.hooks_dict_ref, *getattr(handle, "extra_dict_ref", ())):
                hooks = ref()
                if hooks is not None:
                    ours.setdefault(id(hooks), (hooks, set()))[1].add(handle.id)
        for hooks, ids in ours.values():
            memo[id(hooks)] = type(hooks)((k, copy.deepcopy(v, memo)) for k, v in hooks.items() if k not in ids)
        # The surface's and the engine's instance attributes, and declared forward methods, stay behind.
        saved = [(sub, key, sub.__dict__.pop(key)) for sub, key in surface.attributes if key in sub.__dict__]
        saved += [(module, key, module.__dict__.pop(key)) for key in marks if key in module.__dict__]
        saved += [
            (sub, key, sub.__dict__.pop(key))
            for sub in module.modules()
            for key, value in list(sub.__dict__.items())
            if isinstance(value, ForwardMethod)
        ]
        try:
            return copy.deepcopy(module, memo)
        finally:
            for sub, key, value in saved:
                sub.__dict__[key] = value
