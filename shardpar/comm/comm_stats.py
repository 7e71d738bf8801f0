"""What the collectives moved: per-kind traffic counters, priced by the ring model.

Every collective of ``collectives.py`` and ``tagged_gather.py`` records what it moved in the
caller's :class:`CommStats` when one is passed; an engine's ``comm_stats()`` reads one.

[Note: byte accounting]
We count the bytes *one rank sends* under the bandwidth-optimal (ring) algorithms, because
that is what the ZeRO cost model in DESIGN.md is written in and what a user can compare
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
the kinds of ``_SEND_FACTOR``: forward, backward, ``clip_grad_norm_``, ``GradScaler`` and
``step()``, the one-off agreements of the first steps included; tests/test_comm_stats.py
checks the sum against a counter wrapped around ``torch.distributed``, exactly. Not
counted: ``wrap``'s own set-up, state dicts, checkpoints and the reports of an error.
"""

from __future__ import annotations

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
_SEND_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "used_flags": 2, "rebuild": 1,
                "clip_norm": 2, "found_inf": 2, "control": 1}


@dataclass
class OpTraffic:
    """Traffic of one collective kind. Totals are integers and divided once when read, so
    sums over many calls stay exact."""

    factor: int
    """Ring multiplier of S·(N-1)/N for this kind (see the note above)."""
    world_size: int
    calls: int = 0
    payload_bytes: int = 0
    """Bytes of real data the op ran over (S without padding), summed over calls."""
    padding_bytes: int = 0

    @property
    def sent_bytes(self) -> float:
        """Bytes this rank sent for the payload, by the ring model."""
        return self.payload_bytes * self.factor * (self.world_size - 1) / self.world_size

    @property
    def padding_sent_bytes(self) -> float:
        return self.padding_bytes * self.factor * (self.world_size - 1) / self.world_size

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

    def record_bytes(self, op: str, payload_bytes: int, padding_bytes: int, world_size: int) -> None:
        traffic = self.ops.setdefault(op, OpTraffic(factor=_SEND_FACTOR[op], world_size=world_size))
        assert traffic.world_size == world_size, "one CommStats counts one process group"
        traffic.calls += 1
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


def record_traffic(
    stats: CommStats | None, op: str, tensor: torch.Tensor, padding_numel: int, world_size: int
) -> None:
    """Count ``tensor`` (``padding_numel`` of its elements padding) under ``op`` in ``stats``, if any."""
    if stats is not None:
        stats.record(op, tensor.numel(), padding_numel, tensor.element_size(), world_size)
