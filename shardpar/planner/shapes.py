"""What every estimate reads first: the stage and world size, checked, and the model's shape
(trainable and frozen counts, dtypes, gradient buckets, stage-3 units) laid out as the
engines would lay it out (see [Note: storage model] in memory.py), or assumed from a bare
parameter count.

[Note: planned ownership]
Given ``whole_tensors`` (the trainable parameters an optimizer updates whole: [Note:
whole-tensor ownership] in core/layout.py), the planner lays the model out as the engine ends
up after ``shardpar.optimizer`` owns them (``Engine.own_whole``): every stage 0-2 buffer
(one per dtype, in dtype order) again in its order with those names owned whole, and at stage
3 every trainable flat group (units last first, each group one bucket), the elements each rank
updates (``BufferLayout.rank_loads``) running across the layouts in that order, as the
storages' ``whole_layouts`` run them. So the buckets' members, owners, slice sizes and padding
are the engine's, and so are the elements each rank updates, which the optimizer state of
the heaviest rank is read from. One call owning every name is modelled: several
``shardpar.optimizer`` calls that each own some names place the later ones around the earlier
ones' owners, which may differ by a slice granule.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Union

import torch
from torch import nn

from ..config import WrapPolicy
from ..core.inventory import group_by_dtype
from ..core.layout import Alignment, BufferLayout, alignment_for
from ..core.units import ROOT, UnitPlan, encloses, plan_units

STAGES = (0, 1, 2, 3)

DEFAULT_UNITS = 10
"""Stage-3 units assumed when only a parameter count is given (units of Ψ/10)."""

ASSUMED_TENSOR_NUMEL = 1_000_000
"""Given only a parameter count, the used-flag all-reduce assumes one tensor per this many
parameters (it is a few bytes either way)."""

ModelOrCount = Union[nn.Module, int]


def check_world_and_stage(world_size: int, stage: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


@dataclass(frozen=True)
class UnitShape:
    trainable: int
    """Trainable elements of the unit."""
    frozen_bytes: int
    """Bytes of its frozen parameters (gathered with it at stage 3)."""
    flats: int
    """Flat groups it gathers (one per dtype and trainable/frozen): all-gather calls per use."""
    trainable_flats: int
    """Of which trainable: reduce-scatter calls."""
    uses: int = 1
    """Times its hook modules run per forward (each one gathers it)."""
    held: bool = False
    """Registered on the wrapped module itself: gathered for its whole forward and backward."""
    kept: bool = False
    """Its forward ends last (the last hook module registered, or one enclosing it): it stays
    gathered into backward, one gather fewer per step ([Note: kept for backward] in
    core/gatherer.py)."""
    trainable_padding: int = 0
    """Padding elements of its trainable flat groups (stored, gathered and reduced with them)."""
    frozen_padding_bytes: int = 0
    """Bytes of padding of its frozen flat groups, in their dtypes."""

    @property
    def trainable_stored(self) -> int:
        """Elements its trainable flat groups hold: payload and padding."""
        return self.trainable + self.trainable_padding

    @property
    def frozen_stored_bytes(self) -> int:
        return self.frozen_bytes + self.frozen_padding_bytes


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a model: counts, dtypes, buckets, units."""

    trainable: int
    frozen: int
    frozen_bytes: int
    stored_bytes: float
    """Bytes per trainable element as stored (the master dtype; 4 for fp32)."""
    buckets: tuple[int, ...]
    """Elements per stage 0-2 gradient bucket, padding included."""
    units: tuple[UnitShape, ...]
    """Stage 3 units."""
    bucket_padding: int = 0
    """Padding elements of the stage 0-2 buffers (all buckets)."""
    trainable_tensors: int = 0
    """Trainable parameter tensors (one used-flag each)."""
    buffer_bytes: int = 0
    float_buffer_numel: int = 0
    """Elements of floating-point buffers (cast to ``MixedPrecision.buffer_dtype``)."""
    float_buffer_bytes: int = 0
    buffer_count: int = 0
    measured: bool = False
    """True when read from a module, False when assumed from a count."""
    bucket_loads: tuple[int, ...] = ()
    """Elements of parameters each rank updates at stages 1-2, over all buffers; from a module
    only (``BufferLayout.rank_loads``, [Note: planned ownership])."""
    unit_loads: tuple[int, ...] = ()
    """The same at stage 3, over all trainable flat groups; from a module's own units only."""


def _bucket_cap_numel(bucket_cap_mb: float, element_size: float) -> int:
    # Same rule as ReplicatedStorage: the cap is MiB of the buffer's dtype.
    return max(1, int(int(bucket_cap_mb * 1024 * 1024) // element_size))


def _layout(
    shapes: list[tuple[str, torch.Size]], world_size: int, cap: int | None, alignment: Alignment
) -> BufferLayout:
    """The layout an engine would build for these tensors (see [Note: storage model] in memory.py)."""
    return BufferLayout(shapes, world_size, cap, **alignment._asdict())


class _OwnedLayouts:
    """Layouts built one after another with ``whole`` owned whole, the elements each rank
    updates running across them in the order they are built ([Note: planned ownership])."""

    def __init__(self, world_size: int, alignment: Alignment, whole: frozenset[str]) -> None:
        self.world_size = world_size
        self.alignment = alignment
        self.whole = whole
        self.loads = [0] * world_size

    def next(self, shapes: list[tuple[str, torch.Size]], cap: int | None, owned_apart: bool) -> BufferLayout:
        """The next layout, as ``whole_layouts`` builds it: owners where its tensors are in
        ``whole`` (none yet, so each goes by the loads so far)."""
        names = {name for name, _ in shapes}
        layout = BufferLayout(
            shapes,
            self.world_size,
            cap,
            **self.alignment._asdict(),
            whole=self.whole & names,
            loads=self.loads,
            owned_apart=owned_apart,
        )
        self.loads = [sum(pair) for pair in zip(self.loads, layout.rank_loads())]
        return layout


def _last_hook_module(module: nn.Module, plans: list[UnitPlan]) -> str:
    """The units' hook module registered last: taken as the one whose forward runs last, as
    modules usually run in the order they are registered."""
    position = {name: i for i, (name, _) in enumerate(module.named_modules())}
    return max((m for plan in plans for m in plan.hook_modules), key=lambda m: position.get(m, -1), default=ROOT)


def _unit_of_count(numel: int, world_size: int, alignment: Alignment) -> UnitShape:
    padding = _layout([("unit", torch.Size([numel]))], world_size, None, alignment).padding
    return UnitShape(numel, 0, 1, 1, trainable_padding=padding)


def _shape_of_count(
    trainable: int, bucket_cap_mb: float, largest_unit_params: int | None, world_size: int, alignment: Alignment
) -> ModelShape:
    if isinstance(trainable, bool) or not isinstance(trainable, int) or trainable < 1:
        raise ValueError(f"parameter count must be a positive int or an nn.Module, got {trainable!r}")
    return _laid_out_count(trainable, bucket_cap_mb, largest_unit_params, world_size, alignment)


@functools.lru_cache(maxsize=64)  # a plan asks for the same shape per stage and estimate (stage_choice.py)
def _laid_out_count(
    trainable: int, bucket_cap_mb: float, largest_unit_params: int | None, world_size: int, alignment: Alignment
) -> ModelShape:
    cap = _bucket_cap_numel(bucket_cap_mb, 4)
    full, rest = divmod(trainable, cap)
    chunks = (cap,) * full + ((rest,) if rest else ())  # one tensor per bucket
    layout = _layout([(f"b{i}", torch.Size([n])) for i, n in enumerate(chunks)], world_size, cap, alignment)
    unit = largest_unit_params if largest_unit_params is not None else -(-trainable // DEFAULT_UNITS)
    unit = min(unit, trainable)
    whole, rest = divmod(trainable, unit)
    units = tuple(_unit_of_count(n, world_size, alignment) for n in (unit,) * whole + ((rest,) if rest else ()))
    tensors = max(1, -(-trainable // ASSUMED_TENSOR_NUMEL))
    return ModelShape(
        trainable,
        0,
        0,
        4.0,
        tuple(b.range.size for b in layout.buckets),
        units,
        bucket_padding=layout.padding,
        trainable_tensors=tensors,
    )


def _flat_paddings(
    named: list[tuple[str, nn.Parameter]], world_size: int, alignment: Alignment
) -> list[tuple[int, int]]:
    """(padding elements, element size) of each flat group (one per dtype) stage 3 makes of
    ``named``, laid out as ShardedStorage lays them out (reversed)."""
    return [
        (
            _layout([(n, p.shape) for n, p in reversed(group)], world_size, None, alignment).padding,
            group[0][1].element_size(),
        )
        for group in (group_by_dtype(named) if named else [])
    ]


def _owned_unit_paddings(plans: list[UnitPlan], params: dict[str, nn.Parameter], owned: _OwnedLayouts) -> list[int]:
    """Padding elements of each unit's trainable flat groups laid out with ``owned.whole``
    owned whole: ``ShardedStorage.whole_layouts`` over its trainable groups, units last first
    and each unit's groups in dtype order, each one bucket ([Note: planned ownership])."""
    paddings = [0] * len(plans)
    for index in reversed(range(len(plans))):
        train = [(n, params[n]) for n in plans[index].params if params[n].requires_grad]
        for group in group_by_dtype(train) if train else []:
            paddings[index] += owned.next([(n, p.shape) for n, p in reversed(group)], None, owned_apart=False).padding
    return paddings


def _whole_names(whole_tensors: Collection[str] | None, named: list[tuple[str, nn.Parameter]]) -> frozenset[str]:
    """``whole_tensors`` checked against the module's parameters; the trainable ones."""
    if whole_tensors is None:
        return frozenset()
    if isinstance(whole_tensors, str):
        raise ValueError(f"whole_tensors must be a collection of parameter names, got the string {whole_tensors!r}")
    names = dict(named)
    unknown = sorted(set(whole_tensors) - names.keys())
    if unknown:
        raise ValueError(
            f"whole_tensors names no parameter of the module: {', '.join(unknown)} (use the names of "
            "module.named_parameters(), each tied parameter under its first name)"
        )
    return frozenset(name for name in whole_tensors if names[name].requires_grad)


def _shape_of_module(
    module: nn.Module,
    bucket_cap_mb: float,
    largest_unit_params: int | None,
    wrap_policy: WrapPolicy,
    min_unit_params: int,
    world_size: int,
    alignment: Alignment,
    whole_tensors: Collection[str] | None,
) -> ModelShape:
    named = list(module.named_parameters())  # each tied parameter once, as the engines see it
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError("the module has no parameter with requires_grad=True; nothing to plan for")
    whole = _whole_names(whole_tensors, named)
    psi = sum(p.numel() for _, p in trainable)
    stored = sum(p.numel() * p.element_size() for _, p in trainable) / psi
    buckets: list[int] = []
    bucket_padding = 0
    owned_buffers = _OwnedLayouts(world_size, alignment, whole)
    for group in group_by_dtype(trainable):  # one flat buffer per dtype, as the engines build
        layout = owned_buffers.next(
            [(n, p.shape) for n, p in reversed(group)],
            _bucket_cap_numel(bucket_cap_mb, group[0][1].element_size()),
            owned_apart=True,
        )
        buckets += [b.range.size for b in layout.buckets]
        bucket_padding += layout.padding
    buffers = list(module.buffers())
    unit_loads: tuple[int, ...] = ()
    if largest_unit_params is not None:
        units = _shape_of_count(psi, bucket_cap_mb, largest_unit_params, world_size, alignment).units
    else:
        params = dict(named)
        shapes = []
        plans = plan_units(module, wrap_policy, min_unit_params)
        last = _last_hook_module(module, plans)
        owned_units = _OwnedLayouts(world_size, alignment, whole)
        owned_paddings = _owned_unit_paddings(plans, params, owned_units)
        unit_loads = tuple(owned_units.loads)
        for plan, owned_padding in zip(plans, owned_paddings):
            mine = [(n, params[n]) for n in plan.params]
            train = [x for x in mine if x[1].requires_grad]
            frozen = [x for x in mine if not x[1].requires_grad]
            t_flats = len(group_by_dtype(train)) if train else 0
            f_flats = len(group_by_dtype(frozen)) if frozen else 0
            shapes.append(
                UnitShape(
                    sum(p.numel() for _, p in train),
                    sum(p.numel() * p.element_size() for _, p in frozen),
                    t_flats + f_flats,
                    t_flats,
                    uses=len(plan.hook_modules),
                    held=ROOT in plan.hook_modules,
                    kept=any(encloses(m, last) for m in plan.hook_modules),
                    trainable_padding=owned_padding,
                    frozen_padding_bytes=sum(pad * size for pad, size in _flat_paddings(frozen, world_size, alignment)),
                )
            )
        units = tuple(shapes)
    return ModelShape(
        trainable=psi,
        frozen=sum(p.numel() for _, p in named if not p.requires_grad),
        frozen_bytes=sum(p.numel() * p.element_size() for _, p in named if not p.requires_grad),
        stored_bytes=stored,
        buckets=tuple(buckets),
        units=units,
        bucket_padding=bucket_padding,
        trainable_tensors=len(trainable),
        buffer_bytes=sum(b.numel() * b.element_size() for b in buffers),
        float_buffer_numel=sum(b.numel() for b in buffers if b.is_floating_point()),
        float_buffer_bytes=sum(b.numel() * b.element_size() for b in buffers if b.is_floating_point()),
        buffer_count=len(buffers),
        measured=True,
        bucket_loads=tuple(owned_buffers.loads),
        unit_loads=unit_loads,
    )


def model_shape(
    model_or_count: ModelOrCount,
    world_size: int,
    bucket_cap_mb: float = 25.0,
    largest_unit_params: int | None = None,
    wrap_policy: WrapPolicy = None,
    min_unit_params: int = 100_000,
    align_for_bandwidth: bool | None = None,
    whole_tensors: Collection[str] | None = None,
) -> ModelShape:
    """The model laid out on ``world_size`` ranks; ``whole_tensors`` (a module only) owned
    whole, see [Note: planned ownership]."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    if largest_unit_params is not None and (isinstance(largest_unit_params, bool) or largest_unit_params < 1):
        raise ValueError(f"largest_unit_params must be a positive int, got {largest_unit_params!r}")
    if align_for_bandwidth is not None and not isinstance(align_for_bandwidth, bool):
        raise ValueError(f"align_for_bandwidth must be None, True or False, got {align_for_bandwidth!r}")
    # The engines' choice, from the same function (None: on if the default group runs NCCL).
    alignment = alignment_for(align_for_bandwidth, None, world_size)
    if isinstance(model_or_count, nn.Module):
        return _shape_of_module(
            model_or_count,
            bucket_cap_mb,
            largest_unit_params,
            wrap_policy,
            min_unit_params,
            world_size,
            alignment,
            whole_tensors,
        )
    return _shape_of_count(model_or_count, bucket_cap_mb, largest_unit_params, world_size, alignment)
