"""How the engine's module hooks are made: run eagerly, and marked as the engine's.

Hooks are excluded from compilation (``torch.compiler.disable``), because they launch
collectives: where compiled code calls one (``torch.compile`` of the whole wrapped model) it is
a graph break, and under ``fullgraph=True`` an error, so none is placed inside a compiled module
([Note: compiled modules] in core/units.py). Each is marked, so that a method declared with
``shardpar.register_forward_method`` can run the engine's hooks around it and no others
([Note: forward methods] in facade/forward_methods.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

FORWARD_HOOK_MARK = "_shardpar_forward_hook"
"""Set on every forward hook an engine registers: what a registered method runs."""


def engine_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as one of the engine's hooks: never compiled, and marked."""
    hook: Callable[..., Any] = torch.compiler.disable(fn)  # type: ignore[no-untyped-call]  # torch.compiler.disable is unannotated
    setattr(hook, FORWARD_HOOK_MARK, True)
    return hook
