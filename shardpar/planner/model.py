"""The memory planner and communication model: what one rank holds and sends at each stage.

``estimate_memory`` predicts the bytes of model state per rank (parameters, gradients,
optimizer state, workspace), ``choose_stage`` picks the lowest stage that fits a per-rank
budget, and ``estimate_communication`` predicts the bytes each rank sends per step and,
given a bandwidth and latency, the seconds that takes. All three are *models*: closed
forms of what the engines store and move, checked against the engines' own reports in
``tests/test_planner.py``; ``docs/planner.md`` explains how to use them.

[Note: storage model]
Ψ = trainable parameters, N = world size, k = optimizer-state bytes per fp32 element
(AdamW 8, SGD with momentum 4, ...), d = bytes of the stored (master) parameters (4 for
fp32), p = bytes of the compute parameters, r = bytes of the reduced gradients. Without
mixed precision p = r = d and there is no separate master copy. Per rank:

    stage   params                  grads     optimizer   workspace
    0       pΨ (+ dΨ master)        rΨ        kΨ          0
    1       pΨ (+ dΨ/N master)      rΨ        kΨ/N        0
    2       pΨ (+ dΨ/N master)      dΨ/N      kΨ/N        staging: ≤3 buckets (2 in flight + 1 collecting), in r
    3       dΨ/N                    dΨ/N      kΨ/N        gathered units in p + gradient staging of units in r

With fp32 Adam this is DESIGN.md's 16Ψ, 8Ψ+8Ψ/N, 4Ψ+12Ψ/N and 16Ψ/N. Frozen parameters
add their own bytes to ``params`` (full at stages 0-2, 1/N at stage 3) and nothing else.
Padding counts where the engines store it: the Ψ of params, grads and workspace is the
layouts' size, Ψ + P, where P is the padding of the real buffers or units at world size N
(every bucket and unit padded to a multiple of N, fewer than N elements each; aligned for
NCCL also up to 63 elements in front of each tensor and buckets of lcm(N, 128): [Note:
alignment] in core/layout.py). The planner builds the same layouts as the engines, so P is
exact for a module; for a bare count each bucket and unit is taken as one tensor. Optimizer
state covers the parameters only (padding is part of no piece). Not modelled: activations,
the stage-1 carry shard that exists only while accumulating across reduced backwards (see
core/reduce_strategies.py), allocator caching and fragmentation.

Stage 3 workspace: units are gathered around each use ([Note: units] in core/units.py), so
besides the parameters the wrapped module registers itself (gathered for its whole forward
and backward: the *held* unit) at most the unit computing and the one being prefetched are
gathered: held + the two largest units. Two is the default prefetch of one unit ahead; the
planner takes no prefetch option, and with ``forward_prefetch_units``/``backward_prefetch_units``
at k_f/k_b the engine gathers 1 + max(k_f, k_b) at its peak. Gradient staging holds the held
unit's + up to three units (2 reductions in flight + 1 collecting), as stage 2 does with
buckets. Given only a parameter count the units are unknown: we assume units of
``largest_unit_params`` (default Ψ/10) and nothing held.

[Note: communication model]
Bytes one rank sends per step by the ring algorithms (see [Note: byte accounting] in
``shardpar.collectives``; S = bytes of a tensor, f = (N-1)/N): all-reduce 2·S·f,
reduce-scatter S·f, all-gather S·f. Per step:

    stage 0     all-reduce of every gradient bucket           2Ψ·r·f
    stage 1, 2  reduce-scatter of every bucket + all-gather    Ψ·r·f + Ψ·g·f
                of the updated parameters after the step
    stage 3     all-gather of every unit before each use in    2Ψ·g·f + Ψ·r·f
                forward and again before its backward,         (1Ψ·g·f + Ψ·r·f without
                reduce-scatter of its gradients                resharding after forward)

with g = bytes of the gathered parameters (= r unless mixed precision gathers in p). A unit
used k times per forward (a tied embedding/head: k = 2) is gathered k times as often. With
resharding after forward, the units whose forward ends last stay gathered into backward and
are gathered once less ([Note: kept for backward] in core/gatherer.py): from a module, the
unit of the hook module registered last and the units enclosing it (the root's own unit);
from a bare count, none (2Ψ·g·f is then an upper bound by one unit's gather). Each
gather also carries a 16-byte tag per rank (counted as padding). Every stage adds one
all-reduce per step of a 4-byte flag per trainable tensor plus three counters and their
negatives (the reducer's "used_flags", [Note: used parameters] in core/used_flags.py; the
counters are [Note: ranks out of step]'s), and broadcasts buffers. Padding (the layouts' P
of [Note: storage model], in the dtype of each collective, plus the tags) is predicted apart,
as ``comm_stats()`` reports it: ``padding_sent_bytes``. Buckets are counted as laid out at
wrap; the first backward may rebuild them ([Note: bucket rebuild] in core/rebuild.py: other
calls, the same payload bytes, with alignment other padding, and a one-off all-gather of what
is sharded in the old layout, not modelled here). Time follows the α-β model:
``calls·latency + bytes/bandwidth`` (bytes with padding: it is sent too), one call per
bucket or unit and collective. It is the communication time if nothing overlapped; the
engines overlap gradient collectives with backward and stage 3 prefetches gathers, so the
time a step actually waits is lower. It ignores congestion, hierarchical (intra/inter-node) topologies
and the ring latency growing with N (fold that into ``latency_us`` if it matters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

import torch
from torch import nn

from ..comm import collectives as C
from ..comm.collectives import TAG_BYTES
from ..core.inventory import group_by_dtype
from ..core.layout import Alignment, BufferLayout, alignment_for
from ..core.training_state import TrainingState
from ..core.units import ROOT, encloses, plan_units
from ..config import MixedPrecision, MixedPrecisionOption, WrapPolicy
from ..sizes import parse_bytes, parse_count

__all__ = [
    "CommEstimate",
    "MemoryEstimate",
    "OPTIMIZER_STATE_BYTES",
    "choose_stage",
    "estimate_communication",
    "estimate_memory",
    "format_both",
    "format_bytes",
    "parse_bytes",
    "parse_count",
]

STAGES = (0, 1, 2, 3)

OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8,  # exp_avg + exp_avg_sq
    "adam": 8,
    "sgd": 0,  # momentum=0: no state
    "sgd_momentum": 4,  # momentum_buffer
    "adagrad": 4,  # sum
    "rmsprop": 4,  # square_avg
    "rmsprop_momentum": 8,  # square_avg + momentum_buffer
}
"""Optimizer-state bytes per fp32 parameter element (per-tensor scalars such as Adam's
``step`` are ignored)."""

_OPTIMIZER_CLASS_NAMES: dict[type, str] = {
    torch.optim.AdamW: "adamw",
    torch.optim.Adam: "adam",
    torch.optim.SGD: "sgd",  # the class alone cannot say whether momentum is on
    torch.optim.Adagrad: "adagrad",
    torch.optim.RMSprop: "rmsprop",
}

DEFAULT_UNITS = 10
"""Stage-3 units assumed when only a parameter count is given (units of Ψ/10)."""

STAGING_BUCKETS = 3
"""Stage 2/3 gradient staging alive at once: 2 reductions in flight + 1 collecting
(``GradientShardEngine.max_buckets_in_flight`` + 1)."""

GATHERED_UNITS = 2
"""Stage 3 units gathered at once besides the held one: the one computing + one prefetched
(the default ``prefetch_units=1``)."""

ASSUMED_TENSOR_NUMEL = 1_000_000
"""Given only a parameter count, the used-flag all-reduce assumes one tensor per this many
parameters (it is a few bytes either way)."""

ModelOrCount = Union[nn.Module, int]


# --------------------------------------------------------------------------- model shape


@dataclass(frozen=True)
class _UnitShape:
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
    gathered into backward, one gather fewer per step ([Note: kept for backward])."""
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
class _ModelShape:
    """What the planner needs to know about a model: counts, dtypes, buckets, units."""

    trainable: int
    frozen: int
    frozen_bytes: int
    stored_bytes: float
    """Bytes per trainable element as stored (the master dtype; 4 for fp32)."""
    buckets: tuple[int, ...]
    """Elements per stage 0-2 gradient bucket, padding included."""
    units: tuple[_UnitShape, ...]
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


def _bucket_cap_numel(bucket_cap_mb: float, element_size: float) -> int:
    # Same rule as ReplicatedStorage: the cap is MiB of the buffer's dtype.
    return max(1, int(int(bucket_cap_mb * 1024 * 1024) // element_size))


def _layout(shapes: list[tuple[str, torch.Size]], world_size: int, cap: int | None,
            alignment: Alignment) -> BufferLayout:
    """The layout an engine would build for these tensors (see [Note: storage model])."""
    return BufferLayout(shapes, world_size, cap, **alignment._asdict())


def _last_hook_module(module: nn.Module, plans: list) -> str:
    """The units' hook module registered last: taken as the one whose forward runs last, as
    modules usually run in the order they are registered."""
    position = {name: i for i, (name, _) in enumerate(module.named_modules())}
    return max((m for plan in plans for m in plan.hook_modules), key=lambda m: position.get(m, -1), default=ROOT)


def _unit_of_count(numel: int, world_size: int, alignment: Alignment) -> _UnitShape:
    padding = _layout([("unit", torch.Size([numel]))], world_size, None, alignment).padding
    return _UnitShape(numel, 0, 1, 1, trainable_padding=padding)


def _shape_of_count(
    trainable: int, bucket_cap_mb: float, largest_unit_params: int | None, world_size: int, alignment: Alignment
) -> _ModelShape:
    if isinstance(trainable, bool) or not isinstance(trainable, int) or trainable < 1:
        raise ValueError(f"parameter count must be a positive int or an nn.Module, got {trainable!r}")
    cap = _bucket_cap_numel(bucket_cap_mb, 4)
    full, rest = divmod(trainable, cap)
    chunks = (cap,) * full + ((rest,) if rest else ())  # one tensor per bucket
    layout = _layout([(f"b{i}", torch.Size([n])) for i, n in enumerate(chunks)], world_size, cap, alignment)
    unit = largest_unit_params if largest_unit_params is not None else -(-trainable // DEFAULT_UNITS)
    unit = min(unit, trainable)
    whole, rest = divmod(trainable, unit)
    units = tuple(_unit_of_count(n, world_size, alignment) for n in (unit,) * whole + ((rest,) if rest else ()))
    tensors = max(1, -(-trainable // ASSUMED_TENSOR_NUMEL))
    return _ModelShape(trainable, 0, 0, 4.0, tuple(b.range.size for b in layout.buckets), units,
                       bucket_padding=layout.padding, trainable_tensors=tensors)


def _flat_paddings(
    named: list[tuple[str, nn.Parameter]], world_size: int, alignment: Alignment
) -> list[tuple[int, int]]:
    """(padding elements, element size) of each flat group (one per dtype) stage 3 makes of
    ``named``, laid out as ShardedStorage lays them out (reversed)."""
    return [
        (_layout([(n, p.shape) for n, p in reversed(group)], world_size, None, alignment).padding,
         group[0][1].element_size())
        for group in (group_by_dtype(named) if named else [])
    ]


def _shape_of_module(
    module: nn.Module,
    bucket_cap_mb: float,
    largest_unit_params: int | None,
    wrap_policy: WrapPolicy,
    min_unit_params: int,
    world_size: int,
    alignment: Alignment,
) -> _ModelShape:
    named = list(module.named_parameters())  # each tied parameter once, as the engines see it
    trainable = [(n, p) for n, p in named if p.requires_grad]
    if not trainable:
        raise ValueError("the module has no parameter with requires_grad=True; nothing to plan for")
    psi = sum(p.numel() for _, p in trainable)
    stored = sum(p.numel() * p.element_size() for _, p in trainable) / psi
    buckets: list[int] = []
    bucket_padding = 0
    for group in group_by_dtype(trainable):  # one flat buffer per dtype, as the engines build
        layout = _layout([(n, p.shape) for n, p in reversed(group)], world_size,
                         _bucket_cap_numel(bucket_cap_mb, group[0][1].element_size()), alignment)
        buckets += [b.range.size for b in layout.buckets]
        bucket_padding += layout.padding
    buffers = list(module.buffers())
    if largest_unit_params is not None:
        units = _shape_of_count(psi, bucket_cap_mb, largest_unit_params, world_size, alignment).units
    else:
        params = dict(named)
        shapes = []
        plans = plan_units(module, wrap_policy, min_unit_params)
        last = _last_hook_module(module, plans)
        for plan in plans:
            mine = [(n, params[n]) for n in plan.params]
            train = [x for x in mine if x[1].requires_grad]
            frozen = [x for x in mine if not x[1].requires_grad]
            t_flats = len(group_by_dtype(train)) if train else 0
            f_flats = len(group_by_dtype(frozen)) if frozen else 0
            shapes.append(_UnitShape(
                sum(p.numel() for _, p in train),
                sum(p.numel() * p.element_size() for _, p in frozen),
                t_flats + f_flats,
                t_flats,
                uses=len(plan.hook_modules),
                held=ROOT in plan.hook_modules,
                kept=any(encloses(m, last) for m in plan.hook_modules),
                trainable_padding=sum(pad for pad, _ in _flat_paddings(train, world_size, alignment)),
                frozen_padding_bytes=sum(pad * size for pad, size in _flat_paddings(frozen, world_size, alignment)),
            ))
        units = tuple(shapes)
    return _ModelShape(
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
    )


def _model_shape(
    model_or_count: ModelOrCount,
    world_size: int,
    bucket_cap_mb: float = 25.0,
    largest_unit_params: int | None = None,
    wrap_policy: WrapPolicy = None,
    min_unit_params: int = 100_000,
    align_for_bandwidth: bool | None = None,
) -> _ModelShape:
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    if largest_unit_params is not None and (isinstance(largest_unit_params, bool) or largest_unit_params < 1):
        raise ValueError(f"largest_unit_params must be a positive int, got {largest_unit_params!r}")
    if align_for_bandwidth is not None and not isinstance(align_for_bandwidth, bool):
        raise ValueError(f"align_for_bandwidth must be None, True or False, got {align_for_bandwidth!r}")
    # The engines' choice, from the same function (None: on if the default group runs NCCL).
    alignment = alignment_for(align_for_bandwidth, None, world_size)
    if isinstance(model_or_count, nn.Module):
        return _shape_of_module(model_or_count, bucket_cap_mb, largest_unit_params, wrap_policy, min_unit_params,
                                world_size, alignment)
    return _shape_of_count(model_or_count, bucket_cap_mb, largest_unit_params, world_size, alignment)


def _largest(values: list[int], count: int) -> int:
    return sum(sorted(values, reverse=True)[:count])


# --------------------------------------------------------------------------- memory


def _state_bytes_per_element(optimizer: Any) -> tuple[str, int]:
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        name = _OPTIMIZER_CLASS_NAMES.get(optimizer)
        if name is None:
            raise ValueError(
                f"the planner does not know the state size of {optimizer.__qualname__}; "
                f"pass one of {', '.join(OPTIMIZER_STATE_BYTES)} instead"
            )
        return name, OPTIMIZER_STATE_BYTES[name]
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZER_STATE_BYTES:
        return optimizer.lower(), OPTIMIZER_STATE_BYTES[optimizer.lower()]
    raise ValueError(
        f"optimizer={optimizer!r} is not known to the planner; use one of "
        f"{', '.join(OPTIMIZER_STATE_BYTES)} or a torch.optim class among "
        f"{', '.join(c.__name__ for c in _OPTIMIZER_CLASS_NAMES)}"
    )


def _check_world_and_stage(world_size: int, stage: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage!r}")


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted bytes of model state on one rank (see [Note: storage model]) and the
    inputs they were computed from."""

    params: int
    """Parameters: compute copy, master copy (mixed precision) and frozen parameters."""
    grads: int
    """Gradients kept between backward and the optimizer step."""
    optimizer_state: int
    workspace: int
    """Transient buffers at their peak: gradient staging (stages 2-3), gathered units (3)."""
    total: int
    param_count: int
    """Ψ: trainable parameters."""
    frozen_param_count: int
    world_size: int
    stage: int
    optimizer: str
    optimizer_bytes_per_param: int
    """k: optimizer-state bytes per fp32 element."""
    param_bytes: float
    """p: bytes per element of the compute parameters."""
    reduce_bytes: float
    """r: bytes per element of reduced gradients."""
    master_bytes: float
    """d: bytes per element of stored parameters (4 for fp32; the master copy under mixed
    precision)."""
    mixed_precision: MixedPrecision | None
    bucket_cap_mb: float
    units_from_model: bool
    """True when buckets and stage-3 units were read from a module, False when assumed."""
    startup_built: int = 0
    """Upper bound of the bytes a rank holds while ``wrap`` starts a model built in full on it:
    at stage 3 the whole model (stored dtype), the parameter shards and one unit's values being
    sharded, or the final params + grads if larger; at stages 0-2 the params + grads. The
    optimizer state comes later, at the first step."""
    startup_meta: int = 0
    """The same for a model built on the meta device ([Note: deferred initialisation]): at
    stage 3 the final params + grads plus the largest unit being initialised (on CPU); at
    stages 0-2 as ``startup_built``."""

    @property
    def model_state(self) -> int:
        """params + grads + optimizer state: DESIGN.md's "model-state memory"."""
        return self.params + self.grads + self.optimizer_state

    def as_dict(self) -> dict[str, int]:
        """The per-kind bytes under the keys ``ShardedModule.memory_stats()`` uses."""
        return {
            "params": self.params,
            "grads": self.grads,
            "optimizer_state": self.optimizer_state,
            "workspace": self.workspace,
            "total": self.total,
        }


def estimate_memory(
    model_or_param_count: ModelOrCount,
    world_size: int,
    stage: int,
    optimizer: Any = "adamw",
    mixed_precision: MixedPrecisionOption = None,
    bucket_cap_mb: float = 25.0,
    largest_unit_params: int | None = None,
    *,
    wrap_policy: WrapPolicy = None,
    min_unit_params: int = 100_000,
    align_for_bandwidth: bool | None = None,
) -> MemoryEstimate:
    """Bytes of model state one rank holds at ``stage`` on ``world_size`` ranks.

    ``model_or_param_count``: an ``nn.Module`` (trainable parameters Ψ counted once even if
    tied, frozen parameters separately, real dtypes, the real gradient buckets for
    ``bucket_cap_mb`` and the real stage-3 units for ``wrap_policy``/``min_unit_params`` as
    ``shardpar.wrap`` would build them; a module on the meta device works and costs no
    memory) or an int Ψ (fp32, no frozen parameters, stage-3 units of Ψ/10 unless
    ``largest_unit_params`` says otherwise, which also overrides a module's units).
    ``optimizer``: a name in ``OPTIMIZER_STATE_BYTES`` or a torch.optim class (``SGD`` is
    taken without momentum; say ``"sgd_momentum"``). ``mixed_precision``: as ``wrap`` takes
    it; ``"bf16"``/``"fp16"`` compute in half precision and reduce in fp32.
    ``align_for_bandwidth``: as ``wrap`` takes it (None: on when the default process group
    runs NCCL, else off).

    The model is [Note: storage model]: padding counts where the engines store it, and
    activations are not model state.
    """
    _check_world_and_stage(world_size, stage)
    name, k = _state_bytes_per_element(optimizer)
    mp = MixedPrecision.from_option(mixed_precision)
    shape = _model_shape(model_or_param_count, world_size, bucket_cap_mb, largest_unit_params, wrap_policy,
                         min_unit_params, align_for_bandwidth)
    n, psi, d = world_size, shape.trainable, shape.stored_bytes
    p = mp.param_dtype.itemsize if mp is not None and mp.param_dtype is not None else d
    r = (mp.reduce_dtype.itemsize if mp.reduce_dtype is not None else 4) if mp is not None else d
    master = mp is not None and p != d  # a separate fp32 copy for the optimizer to update

    shards = 1 if stage == 0 else n  # how many ranks share the optimizer's tensors
    optimizer_state = k * (d / 4) * psi / shards  # the state has the master's dtype
    if stage == 3:
        held = [u for u in shape.units if u.held]
        others = [u for u in shape.units if not u.held]
        stored = psi + sum(u.trainable_padding for u in shape.units)  # Ψ + P
        params = d * stored / n + sum(u.frozen_stored_bytes for u in shape.units) / n
        grads = d * stored / n
        gathered = sum(p * u.trainable_stored + u.frozen_stored_bytes for u in held) + _largest(
            [p * u.trainable_stored + u.frozen_stored_bytes for u in others], GATHERED_UNITS)
        staging = r * (sum(u.trainable_stored for u in held)
                       + _largest([u.trainable_stored for u in others], STAGING_BUCKETS))
        # A gather in flight besides the one computing holds its receive buffers: on gloo up to
        # N-1 messages of the largest shard (collectives.TaggedAllGather); elsewhere only the
        # 16·N bytes of tags (left out) since the payload lands in the unit's own buffer.
        largest_shard = max([p * u.trainable_stored / n for u in shape.units] or [0])
        tolerant = C.is_initialized() and C.get_world_size() > 1 and C.traits(None).tolerant_gathers
        receive = (n - 1) * (C.TAG_BYTES + largest_shard) if tolerant else 0
        workspace = gathered + staging + receive
    else:
        stored = psi + shape.bucket_padding  # Ψ + P
        # Frozen parameters: as created, plus the compute copy when mixed precision casts them.
        params = p * stored + (d * stored / shards if master else 0) + shape.frozen_bytes + (
            p * shape.frozen if master else 0)
        # r != d: the reduced gradients are copied to the master dtype for the optimizer.
        grads = (r * stored + (d * stored / shards if r != d else 0)) if stage < 2 else d * stored / n
        workspace = r * _largest(list(shape.buckets), STAGING_BUCKETS) if stage == 2 else 0
    parts = [round(x) for x in (params, grads, optimizer_state, workspace)]
    startup_built = startup_meta = params + grads
    if stage == 3:
        largest_unit = max((d * u.trainable + u.frozen_bytes for u in shape.units), default=0)
        startup_meta = params + grads + largest_unit
        # Built in full: the live model, the shards made so far, and one unit's values in flight.
        startup_built = max(d * psi + shape.frozen_bytes + largest_unit + params, params + grads)
    return MemoryEstimate(
        *parts,
        total=sum(parts),
        param_count=psi,
        frozen_param_count=shape.frozen,
        world_size=world_size,
        stage=stage,
        optimizer=name,
        optimizer_bytes_per_param=k,
        param_bytes=p,
        reduce_bytes=r,
        master_bytes=d,
        mixed_precision=mp,
        bucket_cap_mb=bucket_cap_mb,
        units_from_model=shape.measured and largest_unit_params is None,
        startup_built=round(startup_built),
        startup_meta=round(startup_meta),
    )


def choose_stage(
    model_or_param_count: ModelOrCount, world_size: int, memory_budget: int | str, **kwargs: Any
) -> int:
    """The lowest stage whose estimated ``total`` fits ``memory_budget`` bytes per rank.

    ``memory_budget`` is an int of bytes or a string such as ``"24GB"`` (decimal) or
    ``"512MiB"`` (binary); ``kwargs`` go to :func:`estimate_memory`. Lower stages move
    fewer bytes per step, so the lowest that fits is the fastest. Raises ValueError naming
    the budget and the smallest requirement when no stage fits.
    """
    if memory_budget is None:
        raise ValueError("stage='auto' needs memory_budget (bytes per rank, e.g. '24GB')")
    budget = parse_bytes(memory_budget)
    estimates = [estimate_memory(model_or_param_count, world_size, s, **kwargs) for s in STAGES]
    for estimate in estimates:
        if estimate.total <= budget:
            return estimate.stage
    smallest = min(estimates, key=lambda e: e.total)
    raise ValueError(
        f"no stage fits the memory budget of {format_both(budget)} per rank at world size "
        f"{world_size}: the smallest estimate is {format_both(smallest.total)} (stage "
        f"{smallest.stage}); add ranks, raise the budget"
        + (" or use mixed_precision='bf16'" if kwargs.get("mixed_precision") is None else "")
    )


# --------------------------------------------------------------------------- communication


@dataclass(frozen=True)
class CommEstimate:
    """Predicted bytes one rank sends per training step (see [Note: communication model])
    and, given a bandwidth, the seconds that takes if nothing overlapped."""

    all_reduce_bytes: float
    reduce_scatter_bytes: float
    all_gather_bytes: float
    broadcast_bytes: float
    """Module buffers broadcast from rank 0, once per step (0 for a count)."""
    used_flags_bytes: float
    """The per-step all-reduce of which parameters got gradients (a count assumes one tensor
    per ``ASSUMED_TENSOR_NUMEL`` parameters)."""
    sent_bytes: float
    """Sum of the above: comparable with ``comm_stats()["total"]["sent_bytes"]``."""
    calls: int
    """Collectives issued per step (one per bucket or unit flat and kind)."""
    seconds: float | None
    """``calls·latency + (sent_bytes + padding_sent_bytes)/bandwidth``; None without a bandwidth."""
    param_count: int
    world_size: int
    stage: int
    reduce_bytes: float
    gather_bytes: float
    bandwidth_gbps: float | None
    latency_us: float | None
    reshard_after_forward: bool
    padding_sent_bytes: float = 0.0
    """Padding sent (buckets' and units' padding, stage-3 gather tags): comparable with
    ``comm_stats()["total"]["padding_sent_bytes"]``."""
    padding_by_op: dict[str, float] = field(default_factory=dict)
    """``padding_sent_bytes`` per collective kind (nonzero only)."""

    def as_dict(self) -> dict[str, float]:
        """Sent bytes per collective kind, under ``comm_stats()``'s op names (nonzero only)."""
        ops = {
            "all_reduce": self.all_reduce_bytes,
            "reduce_scatter": self.reduce_scatter_bytes,
            "all_gather": self.all_gather_bytes,
            "broadcast": self.broadcast_bytes,
            "used_flags": self.used_flags_bytes,
        }
        return {op: sent for op, sent in ops.items() if sent}

    def padding_as_dict(self) -> dict[str, float]:
        """Padding sent per collective kind, as ``comm_stats()[op]["padding_sent_bytes"]``."""
        return dict(self.padding_by_op)


def estimate_communication(
    param_count: ModelOrCount,
    world_size: int,
    stage: int,
    reduce_bytes: float = 4,
    gather_bytes: float | None = None,
    bandwidth_gbps: float | None = None,
    latency_us: float | None = None,
    buckets: int | None = None,
    reshard_after_forward: bool = True,
    *,
    bucket_cap_mb: float = 25.0,
    wrap_policy: WrapPolicy = None,
    min_unit_params: int = 100_000,
    buffer_dtype: torch.dtype | None = None,
    align_for_bandwidth: bool | None = None,
) -> CommEstimate:
    """Bytes each rank sends per step (one forward, one backward, one optimizer step) by
    the ring model, and the α-β time: a model, see [Note: communication model].

    ``param_count``: Ψ, or an ``nn.Module`` (then the real bucket and unit counts, frozen
    parameters gathered at stage 3 and buffer broadcasts are included). ``reduce_bytes``:
    bytes per element of reduced gradients (4 = fp32); ``gather_bytes``: of gathered
    parameters (default ``reduce_bytes``; 2 when mixed precision gathers bf16).
    ``bandwidth_gbps``: per-rank bandwidth in GB/s (decimal, 1e9 bytes/s);
    ``latency_us``: fixed cost per collective. ``buckets``: collectives per kind per step
    (gradient buckets at stages 0-2, units at stage 3); default from the module, else
    ``ceil(4Ψ / bucket_cap_mb MiB)`` buckets and 10 units. ``buffer_dtype``: the
    ``MixedPrecision.buffer_dtype`` floating buffers are broadcast in (None: their own).
    ``align_for_bandwidth``: as ``wrap`` takes it; it changes the padding only.
    """
    _check_world_and_stage(world_size, stage)
    for option, value in (("reduce_bytes", reduce_bytes), ("gather_bytes", gather_bytes),
                          ("bandwidth_gbps", bandwidth_gbps)):
        if value is not None and not value > 0:
            raise ValueError(f"{option} must be > 0, got {value!r}")
    if latency_us is not None and latency_us < 0:
        raise ValueError(f"latency_us must be >= 0, got {latency_us!r}")
    if buckets is not None and (isinstance(buckets, bool) or buckets < 1):
        raise ValueError(f"buckets must be a positive int, got {buckets!r}")
    shape = _model_shape(param_count, world_size, bucket_cap_mb, None, wrap_policy, min_unit_params,
                         align_for_bandwidth)
    g = reduce_bytes if gather_bytes is None else gather_bytes
    psi, n = shape.trainable, world_size
    f = (n - 1) / n
    all_reduce = reduce_scatter = all_gather = 0.0
    padding: dict[str, float] = {}
    if stage == 0:
        calls = buckets or len(shape.buckets)
        all_reduce = 2 * psi * reduce_bytes * f
        padding["all_reduce"] = 2 * shape.bucket_padding * reduce_bytes * f
    elif stage in (1, 2):
        calls = 2 * (buckets or len(shape.buckets))
        reduce_scatter = psi * reduce_bytes * f
        all_gather = psi * g * f
        padding["reduce_scatter"] = shape.bucket_padding * reduce_bytes * f
        padding["all_gather"] = shape.bucket_padding * g * f
    else:
        units = shape.units

        def gathers(u: _UnitShape) -> int:
            """Gathers of the unit per step: each use in forward and again in backward, but
            once for a use whose unit stays gathered from forward into backward."""
            if not reshard_after_forward:
                return u.uses
            return 2 * u.uses - int(u.kept)

        if buckets:
            gather_calls = buckets * (2 if reshard_after_forward else 1)
        else:
            gather_calls = sum(gathers(u) * u.flats for u in units)
        scatter_calls = buckets or sum(u.trainable_flats for u in units)
        calls = gather_calls + scatter_calls
        reduce_scatter = psi * reduce_bytes * f
        # Frozen parameters are gathered in the gather dtype too when one is given.
        frozen_ratio = gather_bytes * shape.frozen / shape.frozen_bytes if gather_bytes is not None and shape.frozen else 1
        all_gather = sum(gathers(u) * (u.trainable * g + u.frozen_bytes * frozen_ratio) for u in units) * f
        padding["reduce_scatter"] = sum(u.trainable_padding for u in units) * reduce_bytes * f
        # Every gather of a flat group also carries one tag per rank (see [Note: tagged all-gather]).
        padding["all_gather"] = sum(
            gathers(u) * (u.trainable_padding * g + u.frozen_padding_bytes * frozen_ratio + u.flats * n * TAG_BYTES)
            for u in units) * f
    broadcast_bytes = shape.buffer_bytes
    if buffer_dtype is not None:  # floating buffers are broadcast in the cast dtype
        broadcast_bytes += shape.float_buffer_numel * buffer_dtype.itemsize - shape.float_buffer_bytes
    broadcast = broadcast_bytes * f
    used_flags = 2 * 4 * (shape.trainable_tensors + 2 * len(TrainingState.COUNTER_NAMES)) * f
    calls += shape.buffer_count + 1
    sent = all_reduce + reduce_scatter + all_gather + broadcast + used_flags
    padding = {op: sent_padding for op, sent_padding in padding.items() if sent_padding}
    padding_sent = sum(padding.values())
    seconds = None
    if bandwidth_gbps is not None:
        latency = (latency_us or 0.0) * 1e-6 * calls if n > 1 else 0.0
        seconds = latency + (sent + padding_sent) / (bandwidth_gbps * 1e9)
    return CommEstimate(
        all_reduce_bytes=all_reduce,
        reduce_scatter_bytes=reduce_scatter,
        all_gather_bytes=all_gather,
        broadcast_bytes=broadcast,
        used_flags_bytes=used_flags,
        sent_bytes=sent,
        calls=calls,
        seconds=seconds,
        param_count=psi,
        world_size=world_size,
        stage=stage,
        reduce_bytes=reduce_bytes,
        gather_bytes=g,
        bandwidth_gbps=bandwidth_gbps,
        latency_us=latency_us,
        reshard_after_forward=reshard_after_forward,
        padding_sent_bytes=padding_sent,
        padding_by_op=padding,
    )


# --------------------------------------------------------------------------- sizes, as people read them

def format_bytes(n: float, binary: bool = True) -> str:
    """``format_bytes(3 * 2**30)`` -> ``'3.00 GiB'``; ``binary=False`` -> decimal GB."""
    base, units = (1024.0, ("B", "KiB", "MiB", "GiB", "TiB", "PiB")) if binary else (
        1000.0, ("B", "kB", "MB", "GB", "TB", "PB"))
    value = float(n)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def format_both(n: float) -> str:
    """``'24.00 GB (22.35 GiB)'``: budgets are written in both bases, so show both."""
    return f"{format_bytes(n, binary=False)} ({format_bytes(n)})"
