"""The communication model: the bytes one rank sends per training step at each stage, and
the seconds that takes (:func:`estimate_communication`).

[Note: communication model]
Bytes one rank sends per step by the ring algorithms (see [Note: byte accounting] in
``shardpar/comm/comm_stats.py``; S = bytes of a tensor, f = (N-1)/N): all-reduce 2·S·f,
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
of [Note: storage model] in memory.py, in the dtype of each collective, plus the tags) is predicted apart,
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

import torch

from ..comm.tagged_gather import TAG_BYTES
from ..config import WrapPolicy
from ..core.training_state import TrainingState
from .shapes import ModelOrCount, UnitShape, check_world_and_stage, model_shape


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
    check_world_and_stage(world_size, stage)
    for option, value in (("reduce_bytes", reduce_bytes), ("gather_bytes", gather_bytes),
                          ("bandwidth_gbps", bandwidth_gbps)):
        if value is not None and not value > 0:
            raise ValueError(f"{option} must be > 0, got {value!r}")
    if latency_us is not None and latency_us < 0:
        raise ValueError(f"latency_us must be >= 0, got {latency_us!r}")
    if buckets is not None and (isinstance(buckets, bool) or buckets < 1):
        raise ValueError(f"buckets must be a positive int, got {buckets!r}")
    shape = model_shape(param_count, world_size, bucket_cap_mb, None, wrap_policy, min_unit_params,
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

        def gathers(u: UnitShape) -> int:
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
        # Every gather of a flat group also carries one tag per rank (see [Note: tagged all-gather]
        # in comm/tagged_gather.py).
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
