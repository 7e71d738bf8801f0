"""What the collectives moved: per-kind traffic counters, priced by the ring model.

Every collective of ``collectives.py`` and ``tagged_gather.py`` records what it moved in the
caller's :class:`CommStats` when one is passed; an engine's ``comm_stats()`` reads one.

[Note: byte accounting]
We count the bytes *one rank sends* under the bandwidth-optimal (ring) algorithms, because
that is what the ZeRO cost model in docs/design.md ("Memory and traffic") is written in and what a user can compare
across backends: for a tensor of S bytes on N ranks,

    all-reduce       2·S·(N-1)/N
    reduce-scatter     S·(N-1)/N      (S = the full, unscattered input)
    all-gather         S·(N-1)/N      (S = the full, gathered output)
    broadcast          S·(N-1)/N      (scatter + all-gather pipelining; setup only)

Callers say how many of the elements are padding (buckets are padded to a multiple of N,
and aligned layouts leave gaps in front of tensors too: [Note: alignment] in
``core/layout.py``), so payload and padding are reported separately and the payload
matches the closed form.

S is what the collective carries, not what a rank posts: a broadcast's is the source's
tensor. gloo's tagged gathers post receive buffers as large as the largest shard
([Note: tagged all-gather] in tagged_gather.py) and gloo delivers the shorter message into
them, so a counter that prices each rank's posted tensor counts about 10% more at stage 3
than moves (issue #32). At N > 2 gloo's broadcast tree forwards the whole posted buffer, so there its
real traffic for gathers of units smaller than the largest exceeds the ring model.

Every collective an engine issues from the end of ``wrap`` on in training is counted, under
the kinds of ``SEND_FACTOR``: forward, backward, ``clip_grad_norm_``, ``GradScaler`` and
``step()`` (with a closure, the mean of its loss per call), the one-off agreements of the first steps included; tests/test_comm_stats.py
checks the sum against a counter wrapped around ``torch.distributed``, exactly. Not
counted: ``wrap``'s own set-up, state dicts, checkpoints and the reports of an error.

[Note: one description of a step's collectives]
The planner predicts what the engines count, so both price collectives with one function,
:func:`ring_sent_bytes`, and the planner describes a step as :class:`Collective` values (a
kind on a group, its bytes and calls) that :func:`tally` sums into the same shape a
:class:`CommStats` snapshot has, one per group ([Note: communication model] in
planner/communication.py). Groups are named by their role under hybrid sharding
([Note: sharding groups] in sharding_groups.py): ``"shard_group"`` (the G ranks sharing one
copy of the model state: gathers and reduce-scatters), ``"replica_group"`` (the R ranks
holding the same shard: its all-reduce) and ``"all_ranks"`` (every rank of the wrap's group:
stage 0's all-reduce, the used-parameter flags, buffer broadcasts, agreements). Under full
sharding the shard group is all ranks, and still counted as ``"shard_group"``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

# Ring-algorithm multiplier of S·(N-1)/N per collective kind (see the note above).
# "used_flags" is the all-reduce that tells every rank which parameters got a gradient on
# some rank (see the reducer), counted apart from gradient traffic; "rebuild" the one-off
# all-gathers that move sharded values to rebuilt buckets ([Note: bucket rebuild]);
# "clip_norm" clip_grad_norm_'s all-reduce of the partial norms (stages 1-3), "found_inf"
# GradScaler's of its overflow flag; "control" the gathers that carry no model values, only
# agreement between ranks (pickles of a size no closed form gives): the launch order of the
# first synchronising backward, the bucket rebuild's proposal, stage 3's tag probes and fillers.
SEND_FACTOR = {
    "all_reduce": 2,
    "reduce_scatter": 1,
    "all_gather": 1,
    "broadcast": 1,
    "used_flags": 2,
    "rebuild": 1,
    "clip_norm": 2,
    "found_inf": 2,
    "control": 1,
    "closure_loss": 2,
}


SHARD_GROUP = "shard_group"
REPLICA_GROUP = "replica_group"
ALL_RANKS = "all_ranks"
GROUPS = (SHARD_GROUP, REPLICA_GROUP, ALL_RANKS)
"""The groups a step's collectives run on, by role ([Note: one description of a step's collectives])."""


def ring_sent_bytes(op: str, nbytes: float, group_size: int) -> float:
    """Bytes one rank sends for collectives of kind ``op`` carrying ``nbytes`` (S, summed over
    calls) on ``group_size`` ranks, by the ring model of [Note: byte accounting]."""
    return _ring(nbytes, SEND_FACTOR[op], group_size)


def _ring(nbytes: float, factor: int, group_size: int) -> float:
    return nbytes * factor * (group_size - 1) / group_size


@dataclass(frozen=True)
class Collective:
    """Collectives of one kind on one group in a training step: ``calls`` of them carrying
    ``payload_bytes`` + ``padding_bytes`` in all (S of [Note: byte accounting], summed)."""

    op: str
    """A kind of ``SEND_FACTOR``."""
    group: str
    """One of ``GROUPS``."""
    group_size: int
    payload_bytes: float
    padding_bytes: float = 0.0
    calls: int = 1

    @property
    def sent_bytes(self) -> float:
        return ring_sent_bytes(self.op, self.payload_bytes, self.group_size)

    @property
    def padding_sent_bytes(self) -> float:
        return ring_sent_bytes(self.op, self.padding_bytes, self.group_size)


@dataclass
class OpTraffic:
    """Traffic of one collective kind. Totals are integers and divided once when read, so
    sums over many calls stay exact (live counts are whole bytes; the planner's :func:`tally`
    sums its model's bytes, which may be fractional, hence ``float``)."""

    factor: int
    """Ring multiplier of S·(N-1)/N for this kind (see the note above)."""
    world_size: int
    calls: int = 0
    payload_bytes: float = 0
    """Bytes of real data the op ran over (S without padding), summed over calls."""
    padding_bytes: float = 0

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sent for the payload, by the ring model."""
        return _ring(self.payload_bytes, self.factor, self.world_size)

    @property
    def padding_sent_bytes(self) -> float:
        return _ring(self.padding_bytes, self.factor, self.world_size)

    def as_dict(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "payload_bytes": self.payload_bytes,
            "padding_bytes": self.padding_bytes,
            "sent_bytes": self.sent_bytes,
            "padding_sent_bytes": self.padding_sent_bytes,
        }


class CommStats:
    """Per-op traffic counters; one instance per engine so each reports its own traffic."""

    def __init__(self) -> None:
        self.ops: dict[str, OpTraffic] = {}

    def record(self, op: str, numel: int, padding_numel: int, element_size: int, world_size: int) -> None:
        self.record_bytes(op, (numel - padding_numel) * element_size, padding_numel * element_size, world_size)

    def record_bytes(
        self, op: str, payload_bytes: float, padding_bytes: float, world_size: int, calls: int = 1
    ) -> None:
        traffic = self.ops.get(op)
        if traffic is None:  # the kind's first call since a reset (made only then, not per call)
            traffic = self.ops[op] = OpTraffic(factor=SEND_FACTOR[op], world_size=world_size)
        assert traffic.world_size == world_size, "one CommStats counts one process group"
        traffic.calls += calls
        traffic.payload_bytes += payload_bytes
        traffic.padding_bytes += padding_bytes

    def reset(self) -> None:
        self.ops.clear()

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{op: {calls, payload_bytes, padding_bytes, sent_bytes, padding_sent_bytes}}`` plus
        a ``"total"`` entry summing ``sent_bytes`` and ``padding_sent_bytes`` over ops."""
        out = {op: t.as_dict() for op, t in sorted(self.ops.items())}
        out["total"] = {
            "sent_bytes": sum(t.sent_bytes for t in self.ops.values()),
            "padding_sent_bytes": sum(t.padding_sent_bytes for t in self.ops.values()),
        }
        return out


def record_traffic(stats: CommStats | None, op: str, tensor: torch.Tensor, padding_numel: int, world_size: int) -> None:
    """Count ``tensor`` (``padding_numel`` of its elements padding) under ``op`` in ``stats``, if any."""
    if stats is not None:  # record the collective's bytes
        element = tensor.element_size()
        stats.record_bytes(op, (tensor.numel() - padding_numel) * element, padding_numel * element, world_size)


def merge_snapshots(snapshots: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Several :meth:`CommStats.snapshot` results (one per group) as one: each op's counts
    and bytes summed over the groups it ran on, and the totals."""
    out: dict[str, dict[str, float]] = {}
    for snapshot in snapshots:
        for op, stats in snapshot.items():
            if op == "total":
                continue
            merged = out.setdefault(op, dict.fromkeys(stats, 0))
            for key, value in stats.items():
                merged[key] += value
    out = dict(sorted(out.items()))
    out["total"] = {key: sum(s["total"][key] for s in snapshots) for key in ("sent_bytes", "padding_sent_bytes")}
    return out


def tally(collectives: Iterable[Collective]) -> dict[str, dict[str, dict[str, float]]]:
    """``{group: snapshot}``: the collectives summed per group, each as a :class:`CommStats`
    snapshot ([Note: one description of a step's collectives])."""
    by_group: dict[str, CommStats] = {}
    for c in collectives:
        by_group.setdefault(c.group, CommStats()).record_bytes(
            c.op, c.payload_bytes, c.padding_bytes, c.group_size, c.calls
        )
    return {group: stats.snapshot() for group, stats in by_group.items()}
