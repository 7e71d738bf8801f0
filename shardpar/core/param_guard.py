"""Guarded parameters: what happens when code touches a parameter whose values are not here.

[Note: guarded parameters]
Between steps a stage-3 parameter has no values on this rank (its unit is sharded), and at
stages 1-2 a parameter's values may still be arriving (the all-gather after ``step()`` is
completed lazily, just before first use). The ``Parameter`` objects must stay the user's
own (optimizers and param groups hold them; ``shape``/``ndim`` are what people group on), so
the values cannot be swapped for another object. Instead, while a parameter is not usable,
its Python class is switched to :class:`GuardedParameter`, a ``nn.Parameter`` subclass whose
``__torch_function__`` runs the guard before any operation that reads values:

- a *pending* parameter (stages 1-2) waits for its all-gather, then the operation proceeds;
- a *sharded* parameter (stage 3) raises an error that names the parameter and its unit.

Each parameter's guard -- the object that says what a read does -- is kept in a table by the
parameter's id, not on the parameter: a flat group registers one guard per parameter once
(it looks at the group's state: pending while gathering, sharded while sharded), so a
transition only switches classes, with no attribute set or deleted per parameter (twice per
unit per step at stage 3), and an unguarded parameter carries nothing of the engine's (a
pickled or deep-copied parameter takes none of it along). Metadata (``shape``, ``dtype``,
``requires_grad``, ``numel()``, ``repr``...) never needs values and passes through. When the
values are back the class is switched back, so compute inside forward pays nothing
(``nn.Parameter`` disables ``__torch_function__``), and ``torch.compile`` of blocks only ever
sees plain parameters. ``isinstance(p, nn.Parameter)`` holds throughout. Operations that
bypass Python (autograd's saved tensors, code inside ``DisableTorchFunctionSubclass``) cannot
be guarded; for those a sharded parameter has no storage (its ``.data`` is its view of its
unit's full buffer, whose storage is freed: [Note: flat parameter groups] in flat_param.py),
so they never read freed memory or another unit's values: torch refuses some of them ("data
is not allocated yet": matrix products, ``tolist``), and an elementwise kernel ends the process. So
stage 3 makes sure its own backward never gets there: a unit is gathered before its backward
reads it, held gathered where no hook could tell when that is ([Note: one step at stage 3]
in gatherer.py, "output that hides its tensors").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from torch import nn
from torch.utils._pytree import tree_flatten


class Guard(Protocol):
    def on_access(self, param: nn.Parameter, operation: str) -> None:
        """Called before an operation reads ``param``'s values: make them valid (and unguard
        the parameter) or raise."""


# Tensor methods that read metadata only (the property getters/setters, ``shape`` and the
# like, arrive as ``__get__``/``__set__``).
_METADATA = frozenset(
    {
        "__get__",
        "__set__",
        "__hash__",
        "numel",
        "nelement",
        "size",
        "dim",
        "ndimension",
        "element_size",
        "is_floating_point",
        "is_complex",
        "is_contiguous",
        "stride",
        "requires_grad_",
        "data_ptr",
        "untyped_storage",
        "storage_offset",
        "get_device",
        "__len__",
        "type",
        "is_shared",
        "is_pinned",
        "register_hook",
        "register_post_accumulate_grad_hook",
        "__dir__",
    }
)


_VIEWS = frozenset({"T", "mT", "H", "mH", "data", "real", "imag"})
"""Tensor properties that return views of the values (read later, outside any guard)."""

_ALLOWED: set[str] = set()
"""Operations let through for now (see :func:`allow`)."""


class allow:
    """Within this context, the named operations pass guards without reading values (e.g.
    ``detach`` while ``nn.Module.state_dict`` collects entries that are replaced by full
    tensors afterwards)."""

    def __init__(self, *operations: str) -> None:
        self.operations = set(operations) - _ALLOWED

    def __enter__(self) -> None:
        _ALLOWED.update(self.operations)

    def __exit__(self, *exc: Any) -> None:
        _ALLOWED.difference_update(self.operations)


_GUARDS: dict[int, Guard] = {}
"""id of a parameter -> its guard (see the note): read only while the parameter is guarded.
Whoever registers guards takes them out when its parameters may go (:func:`forget_guards`):
the table holds no parameter, so an id here is a live parameter's."""


def set_guard(param: nn.Parameter, reason: Guard) -> None:
    """``reason`` is ``param``'s guard from now on, whenever it is guarded. Nothing is switched."""
    _GUARDS[id(param)] = reason


def forget_guards(registered: Sequence[tuple[int, Guard]]) -> None:
    """Take out the guards registered as ``(id of the parameter, guard)``, where no other
    guard replaced them since (a relayout registers new ones for the same parameters)."""
    for key, reason in registered:
        if _GUARDS.get(key) is reason:
            del _GUARDS[key]


def guard_of(param: nn.Parameter) -> Guard | None:
    """The guard of ``param`` if it is guarded now."""
    return _GUARDS.get(id(param)) if type(param) is GuardedParameter else None


class GuardedParameter(nn.Parameter):
    """The class a parameter has while its values are not usable; see the note above."""

    _shardpar_class: type

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name == "__repr__":
            param = args[0]
            return (
                f"Parameter(shape={tuple(param.shape)}, dtype={param.dtype}, requires_grad={param.requires_grad}, "
                f"values not on this rank right now: {_GUARDS.get(id(param))})"
            )
        if name in ("__get__", "__set__"):
            descriptor: Any = getattr(func, "__self__", None)  # the property a getter/setter belongs to
            if getattr(descriptor, "__name__", "") in _VIEWS:
                name = descriptor.__name__  # a view that reads the values later: guarded like an operation
        if name not in _METADATA and name not in _ALLOWED:
            leaves, _ = tree_flatten((args, kwargs))
            for leaf in leaves:
                if isinstance(leaf, GuardedParameter):
                    reason = _GUARDS.get(id(leaf))
                    if reason is None:
                        raise RuntimeError(
                            f"a parameter of shape {tuple(leaf.shape)} was read ({name}) while it has no values "
                            "on this rank, and the shardpar engine that held them no longer exists"
                        )
                    reason.on_access(leaf, name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def metadata_only() -> Any:
    """A context in which guarded parameters are not guarded: for loops over many parameters
    that touch only metadata and ``.grad`` (``requires_grad`` checks, putting gradients on
    and taking them off), so each access skips a trip through ``__torch_function__``. Never
    read values inside it."""
    return torch._C.DisableTorchFunctionSubclass()


def guard(param: nn.Parameter, reason: Guard) -> None:
    """Switch ``param`` to :class:`GuardedParameter` with ``reason`` as its guard (idempotent;
    the guard is replaced)."""
    set_guard(param, reason)
    guard_all((param,))


def unguard(param: nn.Parameter) -> None:
    """Give ``param`` back its own class (its guard stays registered, for the next time)."""
    if type(param) is GuardedParameter:
        param.__class__ = param._shardpar_class


def guard_all(params: Sequence[nn.Parameter]) -> None:
    """Switch each of ``params``, whose guards are registered (:func:`set_guard`), to
    :class:`GuardedParameter`: a flat group's transition, in one call rather than one per
    parameter, and with nothing but the class switched (twice per unit per step at stage 3):
    each parameter's own class is recorded the first time, to be given back by :func:`unguard`
    (again only after something replaced the parameter's ``__dict__``, as
    ``torch.utils.swap_tensors`` does when a meta-device model is materialised)."""
    for param in params:
        if type(param) is not GuardedParameter:
            if "_shardpar_class" not in param.__dict__:
                cast(GuardedParameter, param)._shardpar_class = type(param)
            param.__class__ = GuardedParameter


def unguard_all(params: Sequence[nn.Parameter]) -> None:
    """:func:`unguard` each of ``params``, in one call."""
    for param in params:
        if type(param) is GuardedParameter:
            param.__class__ = param._shardpar_class


def is_guarded(param: nn.Parameter) -> bool:
    return type(param) is GuardedParameter
