"""Initialising a module built on the meta device, one module at a time, as ``apply`` would.

[Note: deferred initialisation]
``shardpar.wrap`` of a module built under ``torch.device("meta")`` gives every parameter and
buffer its values here. The contract is a one-process reference: build the model on CPU, then
``torch.manual_seed(s); model.apply(init)``, where ``init`` is the ``init_fn`` passed to wrap or,
without one, each submodule's own ``reset_parameters()`` (modules without one are skipped).
The values are those bit for bit, at every stage and world size:

- :class:`InitWalk` replays ``apply``'s visits in its order (children before parents, a module
  shared by two parents visited twice) on the global CPU generator, which every rank first
  sets to rank 0's state, so every rank computes the same values without any broadcast.
- A module's own parameters and buffers are materialised on CPU just before its first visit
  (``torch.utils.swap_tensors``, so the Parameter objects users hold stay the same), with the
  strides they have on the meta device (a model made ``channels_last`` there keeps that
  format, and the init fills it as it would fill that model on CPU), filled
  with NaN (floating point) or the dtype's minimum (integers), so that anything no init wrote
  is found afterwards and named: a module without ``reset_parameters`` and an ``init_fn``
  that skips it is an error, not garbage values.
- At stage 3 the walk advances only as far as the unit being built needs: a unit is complete
  once every module that holds one of its parameters (tied ones included) and the unit's own
  module have been visited. Its values are then copied into its shard and its CPU copy freed,
  so a rank holds its shards plus the parameters of the unit being initialised (and of units
  whose tied parameters wait for a later module), never the whole model. An init that reads
  or writes a parameter of a unit already sharded (an ancestor's init reaching into a
  finished unit) raises, naming the init's module, the parameter and its unit.
- At stages 0-2 the whole module is materialised (every rank keeps every parameter anyway).

An init may also re-assign, as torchtitan, Hugging Face and timm init code does (see [Note:
re-assignment in an init]).

What differs from the module's constructor: ``reset_parameters()`` is what ``nn.Linear`` and
friends call in ``__init__``, so layers initialised there get the same distributions, but a
constructor that initialises in its own way (``nn.init.normal_`` on a weight in ``__init__``,
Hugging Face's ``post_init``) is not replayed: pass that logic as ``init_fn``. Buffers computed
in ``__init__`` (rotary frequencies) must be set by the init too: Hugging Face's
``_init_weights`` does it.

[Note: re-assignment in an init]
The reference run (``model.apply(init)`` on the CPU-built model) lets an init replace tensors
instead of writing into them, and the values must still be the reference's:

- A buffer re-assigned (``self.cache = self._precompute_cache()``, torchtitan's RoPE; a
  registered name keeps its persistence) is the module's buffer from then on, whatever its
  shape and dtype, as on CPU: buffers are not sharded, so nothing was planned from the meta
  one. The check that every buffer was set therefore looks at what each module holds at the
  end, not at the tensors the walk put there: a slot still holding the walk's tensor with
  the unset marker, or a meta tensor, is unset.
- A parameter's ``.data`` re-assigned (``module.weight.data = torch.empty(...).normal_()``)
  keeps the Parameter object, so the shards (stage 3) and flat buffers (stages 0-2) read the
  new values (it may have other strides: they are read by logical index). Its shape and dtype must be the meta-built ones: units, buckets and
  the planner's figures were made from those before any value existed (at stage 3 the
  shards are allocated before the init runs), so a different one is refused by name.
- Replacing a Parameter object (``module.weight = nn.Parameter(...)``), setting it to None,
  or adding a parameter cannot be honoured: ties, the engine's inventory and the shards hold
  the objects the model was built with, and the new object's values would be dropped. Nor can
  two Parameter objects sharing one storage (``head.weight.data = embed.weight.data``): each
  gets its own place in a flat buffer, and they would train apart. Each is refused by name, right after the visit that did it (at stage 3 before its unit's shard
  is filled), with what to write instead.
- Writing ``.data`` of a parameter whose stage-3 unit is already sharded (as any write or
  read of it) goes through that parameter's guard; the walk turns its error into one that
  names the init's module, the parameter and its unit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import devices as D
from .element_order import is_dense, row_major_strides
from .flat_param import ShardedParameterAccess
from .param_guard import is_guarded

InitFn = Callable[[nn.Module], Any]


@dataclass(frozen=True)
class DeferredInit:
    """What a stage-3 engine needs to build its shards from an initialisation."""

    init_fn: InitFn | None
    device: torch.device


def target_device(group: Any = None) -> torch.device:
    """Where a meta-built model trains: this rank's GPU if there is one (and the group has a
    backend for it), else the CPU; ``shardpar.wrap`` asks once the group exists
    ([Note: a rank's device] in ``shardpar/comm/devices.py``). Values are always computed on
    CPU (the reference is a CPU run) and copied there."""
    return D.training_device(group)


def _apply_order(module: nn.Module) -> Iterator[nn.Module]:
    for child in module.children():
        yield from _apply_order(child)
    yield module


def _unset(tensor: torch.Tensor) -> torch.Tensor:
    """The marker that says "no init wrote this element"."""
    if tensor.is_floating_point() or tensor.is_complex():
        return torch.isnan(tensor)
    if tensor.dtype == torch.bool:
        return torch.zeros_like(tensor, dtype=torch.bool)  # no spare value: not checked
    return tensor == torch.iinfo(tensor.dtype).min


def _fresh(like: torch.Tensor) -> torch.Tensor:
    # With the meta tensor's strides where they are a dense layout: a model converted to
    # channels_last on the meta device keeps that memory format ([Note: element order] in
    # element_order.py), and a random init fills such a tensor in memory order, as it does on CPU.
    strides = tuple(like.stride())
    if not is_dense(like.shape, strides):
        strides = row_major_strides(like.shape)
    value = torch.empty_strided(like.shape, strides, dtype=like.dtype, device="cpu")
    if value.is_floating_point() or value.is_complex():
        value.fill_(float("nan"))
    elif value.dtype == torch.bool:
        value.fill_(False)
    else:
        value.fill_(torch.iinfo(value.dtype).min)
    return value


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class _AsBuilt:
    """A module's parameter slots as built on the meta device (see [Note: re-assignment in an init])."""

    name: str
    """The module's qualified name ("" for the root)."""
    params: dict[str, nn.Parameter | None]
    """Slot name -> the Parameter object the constructor registered (None: an empty slot)."""
    shapes: dict[str, tuple[torch.Size, torch.dtype]]
    """Slot name -> the meta parameter's shape and dtype."""


class InitWalk:
    """``module.apply(init)``, one visit at a time (see the Note)."""

    def __init__(
        self, module: nn.Module, init_fn: InitFn | None, group: Any, device: torch.device | None = None
    ) -> None:
        """``device``: where the model trains (None: :func:`target_device`); rank 0's generator
        state travels to the other ranks on the device the group's object collectives use."""
        self.module = module
        self.init_fn = init_fn
        self.visits = list(_apply_order(module))
        self.done = 0
        self._as_built: dict[nn.Module, _AsBuilt] = {
            sub: _AsBuilt(
                name,
                dict(sub._parameters),
                {n: (p.shape, p.dtype) for n, p in sub._parameters.items() if p is not None},
            )
            for name, sub in module.named_modules()
        }
        self._holders: dict[int, list[int]] = {}
        self._last_visit: dict[int, int] = {}
        for index, visited in enumerate(self.visits):
            self._last_visit[id(visited)] = index
            for param in visited._parameters.values():
                if param is not None:
                    self._holders.setdefault(id(param), []).append(index)
        self._materialized: set[int] = set()
        self._fresh_buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """id of a meta buffer -> (that buffer, kept so the id stays its own; its CPU replacement)."""
        state = torch.get_rng_state()
        if C.get_world_size(group) > 1:  # every rank draws rank 0's numbers
            shared = state.to(D.object_device(group, device if device is not None else target_device(group)))
            C.broadcast(shared, 0, group=group)
            state = shared.cpu()
        torch.set_rng_state(state)

    # ------------------------------------------------------------------ where each parameter is written

    def visits_holding(self, param: nn.Parameter) -> list[int]:
        """Indices of the visits to modules that hold ``param`` directly."""
        return self._holders.get(id(param), [])

    def last_visit_of(self, module: nn.Module) -> int:
        return self._last_visit[id(module)]

    # ------------------------------------------------------------------ running

    def advance_to(self, index: int) -> None:
        """Run every visit up to and including ``index``."""
        while self.done <= min(index, len(self.visits) - 1):
            self._visit(self.visits[self.done])
            self.done += 1

    def finish(self, device: torch.device) -> None:
        """Run the remaining visits, check that every buffer was set, move buffers to ``device``."""
        self.advance_to(len(self.visits) - 1)
        unset = self._unset_buffers()
        if unset:
            raise ValueError(
                f"shardpar.wrap of a meta-device model: no initialisation set the buffer(s) {', '.join(unset)}; "
                "buffers computed in a constructor are not rebuilt, so set them in init_fn"
            )
        for module in self.module.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)

    def _unset_buffers(self) -> list[str]:
        """Qualified names of the buffer slots no init set: what each module holds now (an init
        may have re-assigned it; see [Note: re-assignment in an init])."""
        placed = {id(fresh) for _, fresh in self._fresh_buffers.values()}
        unset = set()
        for prefix, module in self.module.named_modules():
            for name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                if buffer.is_meta or (id(buffer) in placed and bool(_unset(buffer).any())):
                    unset.add(_qualified(prefix, name))
        return sorted(unset)

    def check_initialised(self, named: list[tuple[str, nn.Parameter]]) -> None:
        unset = [name for name, param in named if _unset(param.data).any()]
        if unset:
            how = "init_fn" if self.init_fn is not None else "reset_parameters() (no init_fn was given)"
            raise ValueError(
                f"shardpar.wrap of a meta-device model: {how} left parameter(s) {', '.join(unset)} without values; "
                "pass an init_fn that initialises every parameter, e.g. a Hugging Face model's _init_weights"
            )

    def _visit(self, module: nn.Module) -> None:
        for param in module._parameters.values():
            if param is not None and id(param) not in self._materialized:
                if param.is_meta:
                    fresh = nn.Parameter(_fresh(param), requires_grad=param.requires_grad)
                    torch.utils.swap_tensors(param, fresh)  # type: ignore[no-untyped-call]  # untyped in torch
                self._materialized.add(id(param))
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                known = self._fresh_buffers.get(id(buffer))
                if known is None:  # the first module holding it: a buffer registered twice stays one tensor
                    known = self._fresh_buffers[id(buffer)] = (buffer, _fresh(buffer))
                module._buffers[name] = known[1]
        try:
            with torch.no_grad():
                if self.init_fn is not None:
                    self.init_fn(module)
                elif callable(getattr(module, "reset_parameters", None)):
                    # nn.Module.__getattr__ is typed as returning a Tensor or a Module
                    module.reset_parameters()  # type: ignore[operator]
        except ShardedParameterAccess as error:  # what an init did, not a forward: say so
            raise ValueError(
                f"shardpar.wrap of a meta-device model at stage 3: {self._init_name(module)} read or wrote parameter "
                f"'{error.name}', whose unit '{error.unit}' was already initialised and sharded (a unit is built once "
                "its own module, every module holding one of its parameters and its parent, unless that is the root "
                "or a container, were visited); "
                "initialise a parameter from the init of its own module or of its unit's parent, put both modules "
                "in one unit (wrap_policy), or wrap at stage 0-2"
            ) from error
        self._check_parameter_slots(module)

    def _check_parameter_slots(self, visited: nn.Module) -> None:
        """Refuse, by name, what the init of ``visited`` did to parameters that cannot be honoured
        ([Note: re-assignment in an init]). Every module under ``visited`` has been visited
        (children come first), so each of its parameters holds values by now."""
        storages: dict[int, tuple[str, nn.Parameter]] = {}
        """Storage address -> the first parameter found in it: two Parameter objects may not share one."""
        for module in visited.modules():
            built = self._as_built.get(module)
            prefix = built.name if built is not None else f"{self._as_built[visited].name}.<a module the init added>"
            for name in dict.fromkeys([*(built.params if built is not None else ()), *module._parameters]):
                label = f"'{_qualified(prefix, name)}' ({type(module).__name__}.{name})"
                problem = _slot_problem(built, name, module._parameters.get(name), label, storages)
                if problem is not None:
                    what, remedy = problem
                    raise ValueError(
                        f"shardpar.wrap of a meta-device model: {self._init_name(visited)} {what.format(label)}; "
                        f"{remedy.format(name=name)}"
                    )

    def _init_name(self, visited: nn.Module) -> str:
        how = "init_fn" if self.init_fn is not None else "reset_parameters()"
        where = self._as_built[visited].name
        module = f"module '{where}'" if where else "the root module"
        return f"{how} of {module} ({type(visited).__name__})"


_PLANNED = "the shards and buckets are planned from the model as built on the meta device"
_SHARED_STORAGE = (
    "shardpar keeps each parameter in its own place in a flat buffer, so the two would train apart; "
    "tie them by registration in the constructor (module.{name} = other_module.{name}, one Parameter) "
    "or copy the values (param.copy_(other))"
)


def _slot_problem(
    built: _AsBuilt | None,
    name: str,
    now: nn.Parameter | None,
    label: str,
    storages: dict[int, tuple[str, nn.Parameter]],
) -> tuple[str, str] | None:
    """(what happened, with {} for the parameter; what to do instead) where slot ``name`` of a
    module (``built``: as built; None: a module the init added) holds what cannot be kept."""
    was = built.params.get(name) if built is not None else None
    if now is not was:
        return _slot_change(was, now)
    if now is None or is_guarded(now):  # an empty slot; a sharded unit's parameter (its guard polices it)
        return None
    assert built is not None, "a slot the constructor filled"
    changed = _data_change(now, *built.shapes[name])
    if changed is not None or now.numel() == 0:
        return changed
    first = storages.setdefault(now.untyped_storage().data_ptr(), (label, now))
    if first[1] is not now:
        return (
            f"made parameter {{}} share its storage with parameter {first[0]} (a .data assignment of the "
            "other's tensor)",
            _SHARED_STORAGE,
        )
    return None


def _slot_change(was: nn.Parameter | None, now: nn.Parameter | None) -> tuple[str, str]:
    """(what happened, with {} for the parameter; what to do instead) when a slot holds another object."""
    if was is None:
        return (
            "added parameter {}",
            f"{_PLANNED}, so register it in the constructor and only initialise it in the init",
        )
    if now is None:
        return ("set parameter {} to None", f"{_PLANNED}, so remove it in the constructor instead")
    return (
        "replaced parameter {} by a new nn.Parameter",
        "shardpar keeps the Parameter objects the model was built with (ties, optimizers and the shards hold "
        "them), so initialise it in place (nn.init.*, param.copy_(values)) or assign values of the same shape "
        "and dtype to its .data (module.{name}.data = values)",
    )


def _data_change(param: nn.Parameter, shape: torch.Size, dtype: torch.dtype) -> tuple[str, str] | None:
    """(what happened; what to do instead) when a parameter's ``.data`` cannot be kept, else None."""
    if param.shape != shape or param.dtype != dtype:
        return (
            f"assigned a tensor of shape {list(param.shape)} and dtype {param.dtype} to parameter {{}}, built "
            f"with shape {list(shape)} and dtype {dtype}",
            f"{_PLANNED}, so build it with that shape and dtype there (e.g. model.to(dtype) before wrap), or "
            "write values of the built shape into it (param.copy_(values) casts the dtype)",
        )
    return None


def materialise_whole(
    module: nn.Module, init_fn: InitFn | None, group: Any, device: torch.device | None = None
) -> None:
    """Stages 0-2: the whole module, initialised as the Note says, then moved to ``device``
    (None: :func:`target_device`)."""
    device = device if device is not None else target_device(group)
    walk = InitWalk(module, init_fn, group, device)
    walk.finish(torch.device("cpu"))
    walk.check_initialised(list(module.named_parameters()))
    if device.type != "cpu":
        module.to(device)
