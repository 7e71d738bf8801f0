"""Plain torch code that needs full gradients fails loudly where shardpar keeps them elsewhere.

[Note: no full gradients at stages 1-3]
At stages 1-3 the reduced gradient of a parameter exists only as shards spread over the
ranks (stage 1's full buffer holds the reduced values in this rank's slice only); at stage 0
under mixed precision it sits in a reduce-dtype buffer that feeds fp32 master weights. DDP
scripts read ``param.grad`` in three common ways: a torch optimizer built over
``model.parameters()``, ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, and
gradient logging. With ``.grad`` left None each of them silently does nothing: the loss stays
flat and clipping returns 0. So, in those cases:

- After each synchronising backward, every parameter that got a gradient (and whose
  ``.grad`` is None) carries a :class:`ShardedGrad` as ``.grad``: a tensor of the
  parameter's shape and dtype, without storage, on which every operation raises
  :class:`shardpar.ShardedGradError` naming the parameter and what to call instead
  (``model.clip_grad_norm_``, ``shardpar.optimizer``). A parameter no rank used keeps None,
  as in torch. One placeholder per parameter and dtype, made once and reused. They are
  removed before anything could accumulate into them: at the start of the next forward and
  of the next backward, and by ``zero_grad``.
- A torch optimizer step pre-hook (:func:`refuse_sharded_params`, registered once per process
  by the engine's hook layer, engines/grad_placeholder_hooks.py) refuses, before anything changes, to step a torch optimizer that holds such a parameter, naming the optimizer class
  and the parameter. It also covers what the placeholders cannot: a step before any
  backward, and stage-3 parameters, whose storage an optimizer would read first.

The optimizer :func:`shardpar.optimizer` builds steps shard tensors or master copies, never
these parameters, so neither mechanism touches it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ShardedGradError
from .param_guard import metadata_only

_FIX = (
    "call model.clip_grad_norm_(...) instead of torch.nn.utils.clip_grad_norm_ (model.clip_grad_value_(...) "
    "instead of torch.nn.utils.clip_grad_value_), and build the optimizer with "
    "shardpar.optimizer(model, torch.optim.AdamW, ...) (same options and param groups) instead of "
    "torch.optim.AdamW(model.parameters(), ...)"
)
_WHOLE_GRADS_AT_STAGE_0 = (
    "Code that needs each parameter's whole gradient, such as per-parameter clipping (timm's adaptive "
    "gradient clipping, which reads p and p.grad one parameter at a time) or per-parameter gradient norms, "
    "has no shardpar counterpart: only stage 0 keeps whole gradients (in param.grad, without mixed precision), "
    "so run it at stage=0"
)


def where_grads_live(stage: int) -> str:
    """Why ``param.grad`` is not the gradient, for messages (stage 0: only under mixed precision)."""
    if stage == 0:
        return (
            "at stage 0 with mixed precision it is kept in the reduce dtype for fp32 master weights that only "
            "shardpar's optimizer updates"
        )
    return f"at stage {stage} it exists only as shards spread over the ranks, never whole"


class ShardedGrad(torch.Tensor):
    """Stands in ``param.grad`` where shardpar keeps the gradient elsewhere: the parameter's
    shape and dtype, no values; any operation raises."""

    _shardpar_name: str
    _shardpar_where: str

    @staticmethod
    def __new__(cls, param: nn.Parameter, name: str, where: str) -> ShardedGrad:
        grad = torch.Tensor._make_wrapper_subclass(
            cls, param.shape, dtype=param.dtype, device=param.device, requires_grad=False
        )
        grad._shardpar_name = name
        grad._shardpar_where = where
        return grad

    # torch's Tensor.__repr__ takes a keyword-only ``tensor_contents`` that it leaves untyped.
    def __repr__(self, *args: Any, **kwargs: Any) -> str:  # type: ignore[override]
        return f"ShardedGrad(parameter '{self._shardpar_name}': {self._shardpar_where}; only shardpar can read it)"

    # torch declares Tensor.__torch_dispatch__ as a plain function attribute, not the classmethod
    # every subclass must define, so mypy sees any real override as incompatible.
    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        first = next(a for a in (*args, *(kwargs or {}).values()) if isinstance(a, ShardedGrad))
        raise ShardedGradError(
            f"the gradient of parameter '{first._shardpar_name}' was read ({func}), but {first._shardpar_where}: "
            f"{_FIX}. {_WHOLE_GRADS_AT_STAGE_0}. See [Note: no full gradients at stages 1-3] in "
            "shardpar/core/grad_placeholders.py"
        )


class GradPlaceholderSet:
    """The placeholders of one engine: put on after a synchronising backward wherever
    ``.grad`` is None although the parameter got a gradient, taken off before anything
    accumulates again."""

    def __init__(self, named_params: Sequence[tuple[str, nn.Parameter]], where: str) -> None:
        self.params = dict(named_params)
        self.where = where
        self._made: dict[str, tuple[nn.Parameter, ShardedGrad]] = {}
        """Name -> the parameter and its placeholder, made at its first put_on (a parameter's
        dtype never changes after wrap)."""
        self._on: dict[str, tuple[nn.Parameter, ShardedGrad]] = {}
        """The placeholders put on and not taken off yet (each goes once per step: the walks
        over them are per parameter per step)."""
        claim_params(named_params, where)

    def put_on(self, names: Iterable[str]) -> None:
        made, on = self._made, self._on
        with metadata_only():
            for name in names:
                pair = made.get(name)
                if pair is None:
                    param = self.params[name]
                    pair = made[name] = (param, ShardedGrad(param, name, self.where))
                param, grad = pair
                if param.grad is None:
                    param.grad = grad
                    on[name] = pair

    def take_off(self, names: Iterable[str] | None = None) -> None:
        """Take the placeholders off (``names``: only those parameters')."""
        on = self._on
        if not on:
            return
        if names is None:  # (zero_grad of an optimizer over every parameter asks this way too)
            taken, self._on = on, {}
        else:
            taken = {name: on.pop(name) for name in [n for n in names if n in on]}
        with metadata_only():
            for param, grad in taken.values():
                if param.grad is grad:  # (else the user replaced it: theirs now)
                    param.grad = None


# --------------------------------------------------------------------------- torch optimizers

_OWNERS: dict[int, tuple[weakref.ref[nn.Parameter], str, str]] = {}
"""id of a parameter whose gradient shardpar keeps elsewhere -> (the parameter, its name, where)."""


def refuse_sharded_params(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """The torch optimizer step pre-hook (see the Note): refuse an optimizer over a claimed
    parameter. It runs in every torch optimizer's step (shardpar's own inner optimizers too),
    so the common case is one set test done in C, with no Python call per parameter; only an
    optimizer that shares an id with a claimed parameter is looked at one parameter at a time."""
    if not _OWNERS:
        return
    params = [param for group in optimizer.param_groups for param in group["params"]]
    if _OWNERS.keys().isdisjoint(map(id, params)):
        return
    for param in params:
        owner = _OWNERS.get(id(param))
        if owner is not None and owner[0]() is param:
            cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
            raise ShardedGradError(
                f"{cls} holds parameter '{owner[1]}' of a model wrapped by shardpar, whose gradient it cannot "
                f"see: {owner[2]}. Stepping it would change nothing. Build it with "
                f"shardpar.optimizer(model, {cls}, ...) instead: it takes the same options and param groups"
            )


def claim_params(named_params: Sequence[tuple[str, nn.Parameter]], where: str) -> None:
    """Record parameters whose gradient a torch optimizer cannot see, for
    :func:`refuse_sharded_params` (see the Note)."""
    for name, param in named_params:
        _OWNERS[id(param)] = (weakref.ref(param), name, where)
        weakref.finalize(param, _OWNERS.pop, id(param), None)
