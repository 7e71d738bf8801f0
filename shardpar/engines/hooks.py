"""How the engine's module hooks are made: run eagerly, and marked as the engine's.

Hooks run eagerly even inside ``torch.compile``d code, because they launch collectives. Each
is marked, so that a method declared with ``shardpar.register_forward_method`` can run the
engine's hooks around it and no others ([Note: forward methods] in facade/forward_methods.py).
"""

from __future__ import annotations

from typing import Callable

import torch

FORWARD_HOOK_MARK = "_shardpar_forward_hook"
"""Set on every forward hook an engine registers: what a registered method runs."""


def engine_hook(fn: Callable) -> Callable:
    """``fn`` as one of the engine's hooks: compiled code calls it eagerly, and it is marked."""
    hook = torch.compiler.disable(fn)
    setattr(hook, FORWARD_HOOK_MARK, True)
    return hook
