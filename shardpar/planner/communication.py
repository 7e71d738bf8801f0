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
negatives (the ledger's "used_flags", [Note: used parameters] in core/gradient_ledger.py; the
counters are [Note: ranks out of step]'s), and broadcasts buffers. Padding (the layouts' P
of [Note: storage model] in memory.py, in the dtype of each collective, plus the tags) is predicted apart,
as ``comm_stats()`` reports it: ``padding_sent_bytes``. Buckets are counted as laid out at
wrap; the first backward may rebuild them ([Note: bucket rebuild] in core/rebuild.py: other
calls, the same payload bytes, with alignment other padding, and a one-off all-gather of what
is sharded in the old layout, not modelled here). Tensors owned whole (``whole_tensors``, [Note:
planned ownership] in shapes.py) add no collective and no payload: their buckets' slices grow to
hold them, and the collectives over those buckets send that padding (stages 1-2 per bucket:
reduce-scatter and all-gather of N·S elements, of which N·S less the tensors' elements
padding); the one-off all-gathers that move a bucket to its owned layout when the optimizer
is built (kind "rebuild") are not per step and not modelled. Time follows the α-β model:
``calls·latency + bytes/bandwidth`` (bytes with padding: it is sent too), one call per
bucket or unit and collective. It is the communication time if nothing overlapped; the
engines overlap gradient collectives with backward and stage 3 prefetches gathers, so the
time a step actually waits is lower. It ignores congestion, hierarchical (intra/inter-node) topologies
and the ring latency growing with N (fold that into ``latency_us`` if it matters).

Hybrid sharding (``shard_group_size=G``, R = N/G replicas; [Note: sharding groups] in
comm/sharding_groups.py): the gathers and reduce-scatters above run within a shard group, with
f_G = (G-1)/G for f, and each reduce-scatter is followed by an all-reduce of the owned shard
across the replica group, f_R = (R-1)/R:

    stage 1, 2  Ψ·r·f_G + Ψ·g·f_G within the shard group     + 2(Ψ/G)·r·f_R across replicas
    stage 3     2Ψ·g·f_G + Ψ·r·f_G within (kept units fewer)   + 2(Ψ/G)·r·f_R across replicas

Stage 0 ignores G. Buffers are laid out padded to a multiple of G (slice i of every bucket
and unit belongs to shard rank i), so P is the layouts' padding at G; a rank's all-reduce
across replicas carries its slice, bucket/G elements, whose padding depends on the slice (the
padding sits at the ends of tensors and buckets): the estimate gives the shard group's
average, exact in payload + padding. The step is described as :class:`Collective` values per
kind and group, priced by the ring function the engines' counters use and summed per group
into ``CommEstimate.by_group`` ([Note: one description of a step's collectives] in
comm/comm_stats.py). G = N is full sharding: the replica all-reduce vanishes and the totals
are the ones above.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from ..comm.comm_stats import ALL_RANKS, REPLICA_GROUP, SHARD_GROUP, Collective, tally
from ..comm.sharding_groups import resolve_shard_group_size
from ..comm.tagged_gather import TAG_BYTES
from ..config import WrapPolicy
from ..core.training_state import TrainingState
from .shapes import ModelOrCount, ModelShape, UnitShape, check_world_and_stage, model_shape


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
    shard_group_size: int = 0
    """G: ranks a shard group has (the world size under full sharding; stage 0 ignores it)."""
    collectives: tuple[Collective, ...] = ()
    """The step's collectives per kind and group, which every figure above sums."""

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

    @property
    def by_group(self) -> dict[str, dict[str, dict[str, float]]]:
        """Per group (``"shard_group"``, ``"replica_group"``, ``"all_ranks"``; only those used): what
        a ``CommStats`` snapshot holds, ``{op: {calls, payload_bytes, padding_bytes, sent_bytes,
        padding_sent_bytes}, "total": {sent_bytes, padding_sent_bytes}}``."""
        return tally(self.collectives)

    def sent_across_nodes(self, node_size: int) -> float:
        """Bytes sent (payload and padding) on groups whose ranks span more than one node of
        ``node_size`` consecutive ranks: the traffic that leaves a node when ranks are numbered
        node by node, as torchrun does."""
        spanning = group_spans_nodes(self.world_size, self.shard_group_size, node_size)
        return sum(c.sent_bytes + c.padding_sent_bytes for c in self.collectives if spanning[c.group])


def group_spans_nodes(world_size: int, shard_size: int, node_size: int) -> dict[str, bool]:
    """For each group, whether it holds ranks of two nodes of ``node_size`` consecutive ranks:
    a shard group (consecutive) when it is larger than a node or straddles a node's end; a
    replica group (stride G) whenever it has two ranks and there are two nodes; all ranks when
    there are two nodes."""
    if node_size < 1:
        raise ValueError(f"node_size must be a positive int, got {node_size!r}")
    nodes = world_size > node_size
    straddles = shard_size > node_size or node_size % shard_size != 0
    return {SHARD_GROUP: nodes and straddles, REPLICA_GROUP: nodes and world_size > shard_size, ALL_RANKS: nodes}


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
    shard_group_size: int | str | None = None,
    whole_tensors: Collection[str] | None = None,
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
    ``shard_group_size``: G, as ``wrap`` takes it (None: G = N, full sharding; ``"node"``:
    ``LOCAL_WORLD_SIZE``); ignored at stage 0. ``by_group`` splits the bytes by group.
    ``whole_tensors``: names of the trainable parameters an optimizer updates whole, as
    :func:`estimate_memory` takes them: the buckets and units are then laid out as the engine
    lays them out after owning them, whose extra padding every collective over them sends
    (ignored at stage 0 and for a parameter count).
    """
    check_world_and_stage(world_size, stage)
    for option, value in (
        ("reduce_bytes", reduce_bytes),
        ("gather_bytes", gather_bytes),
        ("bandwidth_gbps", bandwidth_gbps),
    ):
        if value is not None and not value > 0:
            raise ValueError(f"{option} must be > 0, got {value!r}")
    if latency_us is not None and latency_us < 0:
        raise ValueError(f"latency_us must be >= 0, got {latency_us!r}")
    if buckets is not None and (isinstance(buckets, bool) or buckets < 1):
        raise ValueError(f"buckets must be a positive int, got {buckets!r}")
    shard_size = resolve_shard_group_size(shard_group_size, world_size)
    shape = model_shape(
        param_count,
        world_size if stage == 0 else shard_size,
        bucket_cap_mb,
        None,
        wrap_policy,
        min_unit_params,
        align_for_bandwidth,
        whole_tensors if stage else None,
    )
    g = reduce_bytes if gather_bytes is None else gather_bytes
    if stage == 0:
        steps = [
            Collective(
                "all_reduce",
                ALL_RANKS,
                world_size,
                shape.trainable * reduce_bytes,
                shape.bucket_padding * reduce_bytes,
                buckets or len(shape.buckets),
            )
        ]
    elif stage in (1, 2):
        steps = _bucket_collectives(shape, shard_size, world_size, reduce_bytes, g, buckets)
    else:
        steps = _unit_collectives(
            shape, shard_size, world_size, reduce_bytes, gather_bytes, g, buckets, reshard_after_forward
        )
    steps += _every_step(shape, world_size, buffer_dtype)
    steps = [c for c in steps if c.calls]
    sent = {
        op: sum(c.sent_bytes for c in steps if c.op == op)
        for op in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "used_flags")
    }
    padding = {op: sum(c.padding_sent_bytes for c in steps if c.op == op) for op in sent}
    padding = {op: sent_padding for op, sent_padding in padding.items() if sent_padding}
    total, padding_sent, calls = sum(sent.values()), sum(padding.values()), sum(c.calls for c in steps)
    seconds = None
    if bandwidth_gbps is not None:
        latency = (latency_us or 0.0) * 1e-6 * calls if world_size > 1 else 0.0
        seconds = latency + (total + padding_sent) / (bandwidth_gbps * 1e9)
    return CommEstimate(
        all_reduce_bytes=sent["all_reduce"],
        reduce_scatter_bytes=sent["reduce_scatter"],
        all_gather_bytes=sent["all_gather"],
        broadcast_bytes=sent["broadcast"],
        used_flags_bytes=sent["used_flags"],
        sent_bytes=total,
        calls=calls,
        seconds=seconds,
        param_count=shape.trainable,
        world_size=world_size,
        stage=stage,
        reduce_bytes=reduce_bytes,
        gather_bytes=g,
        bandwidth_gbps=bandwidth_gbps,
        latency_us=latency_us,
        reshard_after_forward=reshard_after_forward,
        padding_sent_bytes=padding_sent,
        padding_by_op=padding,
        shard_group_size=shard_size,
        collectives=tuple(steps),
    )


def _across_replicas(reduce_scatter: Collective, shard_size: int, world_size: int) -> list[Collective]:
    """After each reduce-scatter in a shard group, the all-reduce of the owned shard (1/G of
    what was reduce-scattered) across the replica group; none under full sharding."""
    replicas = world_size // shard_size
    if replicas == 1:
        return []
    return [
        Collective(
            "all_reduce",
            REPLICA_GROUP,
            replicas,
            reduce_scatter.payload_bytes / shard_size,
            reduce_scatter.padding_bytes / shard_size,
            reduce_scatter.calls,
        )
    ]


def _bucket_collectives(
    shape: ModelShape, shard_size: int, world_size: int, r: float, g: float, buckets: int | None
) -> list[Collective]:
    """Stages 1-2: per bucket a reduce-scatter, then the gather of the updated parameters."""
    calls = buckets or len(shape.buckets)
    scatter = Collective(
        "reduce_scatter", SHARD_GROUP, shard_size, shape.trainable * r, shape.bucket_padding * r, calls
    )
    gather = Collective("all_gather", SHARD_GROUP, shard_size, shape.trainable * g, shape.bucket_padding * g, calls)
    return [scatter, *_across_replicas(scatter, shard_size, world_size), gather]


def _unit_collectives(
    shape: ModelShape,
    shard_size: int,
    world_size: int,
    r: float,
    gather_bytes: float | None,
    g: float,
    buckets: int | None,
    reshard_after_forward: bool,
) -> list[Collective]:
    """Stage 3: per unit its gathers around each use, and the reduce-scatter of its gradients."""
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
    # Frozen parameters are gathered in the gather dtype too when one is given.
    frozen_ratio = gather_bytes * shape.frozen / shape.frozen_bytes if gather_bytes is not None and shape.frozen else 1
    gather = Collective(
        "all_gather",
        SHARD_GROUP,
        shard_size,
        sum(gathers(u) * (u.trainable * g + u.frozen_bytes * frozen_ratio) for u in units),
        # Every gather of a flat group also carries one tag per rank (see [Note: tagged all-gather]
        # in comm/tagged_gather.py).
        sum(
            gathers(u)
            * (u.trainable_padding * g + u.frozen_padding_bytes * frozen_ratio + u.flats * shard_size * TAG_BYTES)
            for u in units
        ),
        gather_calls,
    )
    scatter = Collective(
        "reduce_scatter",
        SHARD_GROUP,
        shard_size,
        shape.trainable * r,
        sum(u.trainable_padding for u in units) * r,
        scatter_calls,
    )
    return [gather, scatter, *_across_replicas(scatter, shard_size, world_size)]


def _every_step(shape: ModelShape, world_size: int, buffer_dtype: torch.dtype | None) -> list[Collective]:
    """What every stage adds on all ranks: the buffers' broadcasts and the used-parameter
    flags with the step counters ([Note: ranks out of step])."""
    broadcast_bytes = shape.buffer_bytes
    if buffer_dtype is not None:  # floating buffers are broadcast in the cast dtype
        broadcast_bytes += shape.float_buffer_numel * buffer_dtype.itemsize - shape.float_buffer_bytes
    flags = 4 * (shape.trainable_tensors + 2 * len(TrainingState.COUNTER_NAMES))
    return [
        Collective("broadcast", ALL_RANKS, world_size, broadcast_bytes, 0, shape.buffer_count),
        Collective("used_flags", ALL_RANKS, world_size, flags, 0, 1),
    ]
