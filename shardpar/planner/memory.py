"""The memory model: the bytes of model state one rank holds at each stage
(:func:`estimate_memory`).

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

With fp32 Adam this is docs/design.md's 16Ψ ("Memory and traffic"), 8Ψ+8Ψ/N, 4Ψ+12Ψ/N and 16Ψ/N. Under hybrid sharding
(``shard_group_size=G``) the state is sharded over the G ranks of a shard group, not N: read G
for N everywhere in this note (padding to a multiple of G included); stage 0 ignores G. Frozen parameters
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

Whole-tensor ownership ([Note: whole-tensor ownership] in core/layout.py; ``whole_tensors``):
a tensor an optimizer updates whole lies in one rank's slice of its bucket, so a bucket with
owned tensors has slices of S elements, the smallest multiple of its granule that holds them
balanced (``BufferLayout._place_owned``), and padding N·S less its tensors' elements, which
counts in P above like any padding. The rank r updating L_r elements (its elementwise slice
pieces plus the tensors it owns, over every layout) holds k·L_r of state; the ranks differ by
up to one tensor, so the estimate is the heaviest rank's, k·max_r L_r, where k·Ψ/N is the
average (it is what ``memory_stats()`` reports on that rank: take the max over ranks). The
planner builds the engine's layouts for this ([Note: planned ownership] in shapes.py); without
``whole_tensors`` it gives the average k·Ψ/N.

Stage 3 workspace: units are gathered around each use ([Note: units] in core/units.py), so
besides the parameters the wrapped module registers itself (gathered for its whole forward
and backward: the *held* unit) at most the unit computing and the one being prefetched are
gathered: held + the two largest units. Two is the default prefetch of one unit ahead; the
planner takes no prefetch option, and with ``forward_prefetch_units``/``backward_prefetch_units``
at k_f/k_b the engine gathers 1 + max(k_f, k_b) at its peak. Gradient staging holds the held
unit's + up to three units (2 reductions in flight + 1 collecting), as stage 2 does with
buckets. Given only a parameter count the units are unknown: we assume units of
``largest_unit_params`` (default Ψ/10) and nothing held.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from ..comm import collectives as C
from ..comm.sharding_groups import resolve_shard_group_size
from ..comm.tagged_gather import TAG_BYTES
from ..config import MixedPrecision, MixedPrecisionOption, WrapPolicy
from .shapes import ModelOrCount, check_world_and_stage, model_shape

OPTIMIZER_STATE_BYTES: dict[str, int] = {
    "adamw": 8,  # exp_avg + exp_avg_sq
    "adam": 8,
    "sgd": 0,  # momentum=0: no state
    "sgd_momentum": 4,  # momentum_buffer
    "adagrad": 4,  # sum
    "rmsprop": 4,  # square_avg
    "rmsprop_momentum": 8,  # square_avg + momentum_buffer
    "muon": 4,  # momentum_buffer (torch.optim.Muon; the matrices' optimizer, owned whole at stages 1-3)
}
"""Optimizer-state bytes per fp32 parameter element (per-tensor scalars such as Adam's
``step`` are ignored)."""

_OPTIMIZER_CLASS_NAMES: dict[type, str] = {
    torch.optim.AdamW: "adamw",
    torch.optim.Adam: "adam",
    torch.optim.SGD: "sgd",  # the class alone cannot say whether momentum is on
    torch.optim.Adagrad: "adagrad",
    torch.optim.RMSprop: "rmsprop",
    **({torch.optim.Muon: "muon"} if hasattr(torch.optim, "Muon") else {}),  # torch >= 2.9
}

STAGING_BUCKETS = 3
"""Stage 2/3 gradient staging alive at once: 2 reductions in flight + 1 collecting
(``GradientShardEngine.max_buckets_in_flight`` + 1)."""

GATHERED_UNITS = 2
"""Stage 3 units gathered at once besides the held one: the one computing + one prefetched
(the default ``prefetch_units=1``)."""


def _largest(values: list[float], count: int) -> float:
    return sum(sorted(values, reverse=True)[:count])


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
    shard_group_size: int = 0
    """G: the ranks that share the sharded state (the world size under full sharding; 1 at
    stage 0, which shards nothing)."""

    @property
    def model_state(self) -> int:
        """params + grads + optimizer state: the "model-state memory" of docs/design.md, "Memory and traffic"."""
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
    shard_group_size: int | str | None = None,
    whole_tensors: Collection[str] | None = None,
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
    runs NCCL, else off). ``shard_group_size``: G, as ``wrap`` takes it (None: G = N; ``"node"``:
    ``LOCAL_WORLD_SIZE``): sharded state divides by G, not N; ignored at stage 0.
    ``whole_tensors``: names of the trainable parameters an optimizer updates whole (Muon's
    matrices, Adafactor's tensors: what ``shardpar.optimizer`` owns whole at stages 1-3); the
    layouts are then the engine's after it owns them, and ``optimizer_state`` is the heaviest
    rank's, k times the elements it updates ([Note: planned ownership] in shapes.py). Ignored
    at stage 0, for a parameter count, and for stage 3's units where ``largest_unit_params``
    assumes them.

    The model is [Note: storage model]: padding counts where the engines store it, and
    activations are not model state.
    """
    check_world_and_stage(world_size, stage)
    name, k = _state_bytes_per_element(optimizer)
    mp = MixedPrecision.from_option(mixed_precision)
    # The ranks that share the sharded state, and whose multiple the layouts are padded to: the
    # shard group's G (N under full sharding); stage 0 shards nothing and pads to N.
    shard_size = resolve_shard_group_size(shard_group_size, world_size)
    n = 1 if stage == 0 else shard_size
    shape = model_shape(
        model_or_param_count,
        world_size if stage == 0 else n,
        bucket_cap_mb,
        largest_unit_params,
        wrap_policy,
        min_unit_params,
        align_for_bandwidth,
        whole_tensors if stage else None,
    )
    psi, d = shape.trainable, shape.stored_bytes
    p = mp.param_dtype.itemsize if mp is not None and mp.param_dtype is not None else d
    r = (mp.reduce_dtype.itemsize if mp.reduce_dtype is not None else 4) if mp is not None else d
    master = mp is not None and p != d  # a separate fp32 copy for the optimizer to update

    optimizer_state = k * (d / 4) * psi / n  # the state has the master's dtype
    loads = shape.unit_loads if stage == 3 else shape.bucket_loads
    if whole_tensors is not None and stage and loads:  # the heaviest rank's: owners make them uneven
        optimizer_state = k * (d / 4) * max(loads)
    if stage == 3:
        held = [u for u in shape.units if u.held]
        others = [u for u in shape.units if not u.held]
        stored = psi + sum(u.trainable_padding for u in shape.units)  # Ψ + P
        params = d * stored / n + sum(u.frozen_stored_bytes for u in shape.units) / n
        grads = d * stored / n
        gathered = sum(p * u.trainable_stored + u.frozen_stored_bytes for u in held) + _largest(
            [p * u.trainable_stored + u.frozen_stored_bytes for u in others], GATHERED_UNITS
        )
        staging = r * (
            sum(u.trainable_stored for u in held) + _largest([u.trainable_stored for u in others], STAGING_BUCKETS)
        )
        # A gather in flight besides the one computing holds its receive buffers: on gloo up to
        # N-1 messages of the largest shard (tagged_gather.TaggedAllGather); elsewhere only the
        # 16·N bytes of tags (left out) since the payload lands in the unit's own buffer.
        largest_shard = max([p * u.trainable_stored / n for u in shape.units] or [0])
        tolerant = C.is_initialized() and C.get_world_size() > 1 and C.traits(None).tolerant_gathers
        receive = (n - 1) * (TAG_BYTES + largest_shard) if tolerant else 0
        workspace = gathered + staging + receive
    else:
        stored = psi + shape.bucket_padding  # Ψ + P
        # Frozen parameters: as created, plus the compute copy when mixed precision casts them.
        params = (
            p * stored + (d * stored / n if master else 0) + shape.frozen_bytes + (p * shape.frozen if master else 0)
        )
        # r != d: the reduced gradients are copied to the master dtype for the optimizer.
        grads = (r * stored + (d * stored / n if r != d else 0)) if stage < 2 else d * stored / n
        workspace = r * _largest(list(shape.buckets), STAGING_BUCKETS) if stage == 2 else 0
    parts = (round(params), round(grads), round(optimizer_state), round(workspace))
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
        shard_group_size=n,
    )
