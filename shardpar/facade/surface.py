"""The wrapped module's own ``nn.Module`` surface while an engine manages it.

[Note: the module surface]
Scripts call torch's methods on the model they wrapped, not only on the ``ShardedModule``:
``model.module.state_dict()``, ``module.zero_grad()``, ``module.to(...)``, ``copy.deepcopy``,
``torch.save``, a submodule's ``load_state_dict``. While an engine manages the module those
must speak of the real values (masters, shards), so :class:`ModuleSurface` routes them:
instance attributes on the module (``zero_grad`` clears the engine's gradients, ``_apply``
refuses moves, ``__deepcopy__``/``__reduce_ex__`` give plain copies) and on it and every
submodule ``state_dict``/``load_state_dict``: torch's own, run on the full values and written
back ([Note: full values in the module] in module_state.py). It is built over the engine by
the ``ShardedModule`` and undone when the engine closes; the engine knows it only as
something attached (:meth:`Engine.attach`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..engines import Engine
from . import plain_copy
from .module_state import ModuleState


class ModuleSurface:
    """See [Note: the module surface]."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.state = ModuleState(engine)
        module = engine.module

        def _apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
            self.state.refuse_moves(fn)  # .to()/.half()...
            return module

        root: dict[str, Any] = {
            "zero_grad": lambda set_to_none=True: engine.zero_grad(
                set_to_none=set_to_none
            ),  # the module's own clears ours
            "_apply": _apply,
        }
        marks = (*root, "state_dict", "load_state_dict", *engine.module_attributes)
        root.update(plain_copy.copy_hooks(self, marks=marks))  # copy.deepcopy / torch.save
        self.attributes: list[tuple[nn.Module, str]] = []
        """``(module, name)`` of every instance attribute this surface set (undone at close)."""
        for sub in module.modules():
            # torch's own state_dict / load_state_dict, on full values ([Note: full values in the
            # module]); torch's recursion into children finds the values shown already.
            values = {
                "state_dict": self.state.state_dict_of(sub),
                "load_state_dict": self.state.load_state_dict_of(sub),
            }
            if sub is module:
                values.update(root)
            for name, value in values.items():
                setattr(sub, name, value)
                self.attributes.append((sub, name))
        engine.attach(self)

    @property
    def hook_handles(self) -> list[Any]:
        """Every hook on the module that a plain copy leaves out: the engine's."""
        return self.engine.hook_handles

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return self.state.full_state_dict()

    def close(self) -> None:
        for sub, name in self.attributes:
            sub.__dict__.pop(name, None)
        self.attributes.clear()
