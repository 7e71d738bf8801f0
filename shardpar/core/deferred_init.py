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
  whose tied parameters wait for a later module), never the whole model. An init that writes
  a parameter of a unit already sharded (an ancestor's init reaching into a finished unit)
  raises, naming the parameter.
- At stages 0-2 the whole module is materialised (every rank keeps every parameter anyway).

What differs from the module's constructor: ``reset_parameters()`` is what ``nn.Linear`` and
friends call in ``__init__``, so layers initialised there get the same distributions, but a
constructor that initialises in its own way (``nn.init.normal_`` on a weight in ``__init__``,
Hugging Face's ``post_init``) is not replayed: pass that logic as ``init_fn``. Buffers computed
in ``__init__`` (rotary frequencies) must be set by the init too: Hugging Face's
``_init_weights`` does it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import devices as D
from .element_order import is_dense, row_major_strides

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


class InitWalk:
    """``module.apply(init)``, one visit at a time (see the Note)."""

    def __init__(self, module: nn.Module, init_fn: InitFn | None, group: Any,
                 device: torch.device | None = None) -> None:
        """``device``: where the model trains (None: :func:`target_device`); rank 0's generator
        state travels to the other ranks on the device the group's object collectives use."""
        self.module = module
        self.init_fn = init_fn
        self.visits = list(_apply_order(module))
        self.done = 0
        self.buffer_names = {id(b): n for n, b in module.named_buffers(remove_duplicate=False)}
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
        self._buffer_checks: list[tuple[str, torch.Tensor]] = []
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
        unset = sorted({name for name, buffer in self._buffer_checks if _unset(buffer).any()})
        if unset:
            raise ValueError(
                f"shardpar.wrap of a meta-device model: no initialisation set the buffer(s) {', '.join(unset)}; "
                "buffers computed in a constructor are not rebuilt, so set them in init_fn"
            )
        for module in self.module.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != device:
                    module._buffers[name] = buffer.to(device)

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
                    torch.utils.swap_tensors(param, nn.Parameter(_fresh(param), requires_grad=param.requires_grad))
                self._materialized.add(id(param))
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.is_meta:
                known = self._fresh_buffers.get(id(buffer))
                if known is None:  # the first module holding it: a buffer registered twice stays one tensor
                    known = self._fresh_buffers[id(buffer)] = (buffer, _fresh(buffer))
                    self._buffer_checks.append((self.buffer_names.get(id(buffer), name), known[1]))
                module._buffers[name] = known[1]
        with torch.no_grad():
            if self.init_fn is not None:
                self.init_fn(module)
            elif callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()


def materialise_whole(module: nn.Module, init_fn: InitFn | None, group: Any,
                      device: torch.device | None = None) -> None:
    """Stages 0-2: the whole module, initialised as the Note says, then moved to ``device``
    (None: :func:`target_device`)."""
    device = device if device is not None else target_device(group)
    walk = InitWalk(module, init_fn, group, device)
    walk.finish(torch.device("cpu"))
    walk.check_initialised(list(module.named_parameters()))
    if device.type != "cpu":
        module.to(device)
