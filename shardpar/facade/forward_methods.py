"""Methods other than ``forward`` that run like it: :func:`register_forward_method`, as FSDP2's
``register_fsdp_forward_method``.

[Note: forward methods]
shardpar does its per-forward work in forward hooks on the modules it manages: on the wrapped
module (the training state, buffers, and at stage 3 the gather of the root's own unit) and at
stage 3 on each unit's hook and entry modules (their gathers; [Note: entry modules] in
core/units.py). A method other than ``forward`` runs none of the hooks of its own module, so
at stage 3 a parameter it reads directly (``self.pos[:t]`` in a ``generate`` of the root, a
block's ``self.gate`` in a block method) is sharded and the read raises. Registering the
method makes a call of it run the module's shardpar hooks around it, exactly as
``module(...)`` runs them around ``forward``: pre-hooks, the method, post-hooks, and the
hooks that run when a forward raises. Other hooks on the module (the user's) are not run, as
FSDP2 does not run them.

The hooks are looked up at each call, so a method may be registered before ``wrap`` as well as
after, and once the engine is closed the method is the plain method again; on a module no
engine manages it changes nothing (as FSDP2's, so one script serves both). A method that only
calls modules (a block's submodules) needs no registration: calling a module of a unit
gathers the unit. The registered method is an instance attribute that holds the module and
the method's name only, so ``copy.deepcopy`` and ``torch.save`` of the module still work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ..engines import Engine
from ..engines.hooks import FORWARD_HOOK_MARK


def _ours(hooks: dict[int, Callable[..., Any]]) -> list[tuple[int, Callable[..., Any]]]:
    return [(key, hook) for key, hook in hooks.items() if getattr(hook, FORWARD_HOOK_MARK, False)]


def call_as_forward(
    module: nn.Module, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """``method(*args, **kwargs)`` with ``module``'s shardpar forward hooks around it, in the
    order and with the conventions of ``nn.Module.__call__``."""
    pre_hooks = _ours(module._forward_pre_hooks)
    if not pre_hooks and not _ours(module._forward_hooks):
        return method(*args, **kwargs)
    called: set[int] = set()
    try:
        for key, hook in pre_hooks:
            if key in module._forward_pre_hooks_with_kwargs:
                result = hook(module, args, kwargs)
                if result is not None:
                    args, kwargs = result
            else:
                result = hook(module, args)
                if result is not None:
                    args = result if isinstance(result, tuple) else (result,)
        output = method(*args, **kwargs)
        for key, hook in _ours(module._forward_hooks):  # read now: a pre-hook may have added some
            called.add(key)
            if key in module._forward_hooks_with_kwargs:
                result = hook(module, args, kwargs, output)
            else:
                result = hook(module, args, output)
            if result is not None:
                output = result
        return output
    except Exception:
        for key, hook in _ours(module._forward_hooks):
            if key in module._forward_hooks_always_called and key not in called:
                hook(module, args, None)
        raise


class ForwardMethod:
    """What ``module.<name>`` is once registered (see [Note: forward methods])."""

    def __init__(self, module: nn.Module, name: str, original: Callable[..., Any] | None) -> None:
        self.module = module
        self.name = name
        self.original = original
        """The method if it was an instance attribute itself; None: the class's."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        method = (
            self.original if self.original is not None else getattr(type(self.module), self.name).__get__(self.module)
        )
        return call_as_forward(self.module, method, args, kwargs)

    def __repr__(self) -> str:
        return f"<{type(self.module).__name__}.{self.name}, run as a forward by shardpar>"


def register_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>(...)`` run like ``module(...)``: at stage 3 it gathers what
    ``module``'s forward gathers (the wrapped module: the root's own unit; a unit's module: the
    unit) and frees it after, and backward through its output works like backward through a
    forward's. Use it for a method other than ``forward`` that reads parameters of its module
    directly, e.g. a ``generate`` (FSDP2's ``register_fsdp_forward_method``). ``module``: the
    wrapped module, one of its submodules, or the ``ShardedModule``. See [Note: forward
    methods]."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"register_forward_method: module must be an nn.Module, got {type(module).__name__}")
    engine = module.__dict__.get("engine")
    if isinstance(engine, Engine) and module._modules.get("module") is engine.module:
        module = engine.module  # a ShardedModule: the method is its wrapped module's
    if not isinstance(method_name, str):
        raise TypeError(f"register_forward_method: method_name must be a str, got {type(method_name).__name__}")
    if method_name == "forward":
        raise ValueError("register_forward_method: 'forward' runs shardpar's hooks already; name another method")
    current = module.__dict__.get(method_name)
    if isinstance(current, ForwardMethod):
        return  # registered already
    method = getattr(module, method_name, None)
    if not callable(method) or isinstance(method, nn.Module):
        raise ValueError(f"register_forward_method: {type(module).__name__} has no method '{method_name}'")
    setattr(module, method_name, ForwardMethod(module, method_name, current))
