"""The wrapped module's own ``nn.Module`` surface while an engine manages it.

[Note: the module surface]
Scripts call torch's methods on the model they wrapped, not only on the ``ShardedModule``:
``model.module.state_dict()``, ``module.zero_grad()``, ``module.to(...)``, ``copy.deepcopy``,
``torch.save``, a submodule's ``load_state_dict``. While an engine manages the module those
must speak of the real values (masters, shards), so :class:`ModuleSurface` routes them:
instance attributes on the module (``zero_grad`` clears the engine's gradients, ``_apply``
refuses moves, ``load_state_dict`` loads the masters where the parameters are compute copies
or placeholders, ``__deepcopy__``/``__reduce_ex__`` give plain copies) and state-dict hooks
(the full values in place of placeholders or compute copies). It is built over the engine by
the ``ShardedModule`` and undone when the engine closes; the engine knows it only as
something attached (:meth:`Engine.attach`).
"""

from __future__ import annotations

from typing import Any

from ..engines import Engine
from . import plain_copy
from .module_state import ModuleState


class ModuleSurface:
    """See [Note: the module surface]."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.state = ModuleState(engine)
        self.handles: list[Any] = []
        """The state-dict and load hooks this surface registered on the module."""
        source = engine.storage.state_dict_source(self.state)
        if source is not None:
            self.handles += self.state.install_state_dict_hooks(source)
        module = engine.module
        attributes: dict[str, Any] = {
            "zero_grad": lambda set_to_none=True: engine.zero_grad(set_to_none=set_to_none),  # the module's own clears ours
            "_apply": lambda fn, recurse=True: self.state.refuse_moves(fn) or module,  # .to()/.half()...
        }
        if not engine.storage.params_are_masters:
            # Its parameters are compute copies or placeholders: loading into them would be lost
            # at the next step (or raise), so the module's own load_state_dict loads the masters.
            attributes["load_state_dict"] = self.state.load_module_state
            self.handles += self.state.install_submodule_load_hooks()
        marks = (*attributes, *engine.module_attributes)
        attributes.update(plain_copy.copy_hooks(self, marks=marks))  # copy.deepcopy / torch.save
        for name, value in attributes.items():
            setattr(module, name, value)
        self.attributes = tuple(attributes)
        engine.attach(self)

    @property
    def hook_handles(self) -> list[Any]:
        """Every hook on the module that a plain copy leaves out: the engine's and this surface's."""
        return self.engine.hook_handles + self.handles

    def full_state_dict(self) -> dict:
        return self.state.full_state_dict()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for name in self.attributes:
            self.engine.module.__dict__.pop(name, None)
