"""The collective layer's verbs: with ``tagged_gather.py`` beside it, the only code of shardpar
that calls ``torch.distributed``'s collectives (through ``compat`` where a torch older than
the newest names them otherwise).

Functions are named by what they do and carry no training logic. Each works unchanged at
world size 1 without any process group (the collective is then the identity), returns a
:class:`Handle` when ``async_op=True``, and records what it moved in a :class:`CommStats`
when one is passed.

The rest of the layer lives beside it, each in a module of its own, and what callers use of
it is re-exported here, so ``C.name`` reaches it: ``process_group.py`` (the default group,
world size and rank, sibling groups), ``backend_traits.py`` (what a backend can do),
``comm_stats.py`` (:class:`CommStats`, [Note: byte accounting]), ``handle.py``
(:class:`Handle`) and ``tagged_gather.py`` (stage 3's gathers, [Note: tagged all-gather]).

[Note: gloo reduce-scatter and all-gather]
gloo's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are several times slower than its
all-reduce on the same buffer (measured in docs/benchmarks.md), while its all-to-all and
broadcast are fast. On gloo we therefore build them from those: reduce-scatter is an
all-to-all (rank r receives every rank's chunk r) followed by a local sum, and all-gather is
one broadcast per rank of its own chunk. Each rank still sends S·(N-1)/N bytes, so
[Note: byte accounting] in comm_stats.py holds; the only cost is a scratch buffer of S bytes
for the all-to-all.
NCCL and other backends keep the native collectives.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
import torch.distributed as dist

from . import compat, devices, host, watch
from .backend_traits import backend_averages, traits
from .comm_stats import ALL_RANKS, REPLICA_GROUP, SHARD_GROUP, CommStats, merge_snapshots, record_traffic
from .handle import Handle
from .process_group import ProcessGroup, get_rank, get_world_size, is_initialized, retire_sibling_group, sibling_group
from .tagged_gather import (
    GatheredTags,
    TaggedAllGather,
    all_gather_tagged,
    all_gather_tags,
    gather_target,
    tagged_buffer,
)

__all__ = [
    # the verbs
    "all_reduce",
    "reduce_scatter",
    "ReduceScatterPlan",
    "all_gather",
    "broadcast",
    "all_gather_objects",
    "broadcast_object",
    "barrier",
    "send",
    "recv",
    # from the modules beside this one
    "ALL_RANKS",
    "REPLICA_GROUP",
    "SHARD_GROUP",
    "CommStats",
    "merge_snapshots",
    "GatheredTags",
    "Handle",
    "TaggedAllGather",
    "all_gather_tagged",
    "all_gather_tags",
    "backend_averages",
    "gather_target",
    "get_rank",
    "get_world_size",
    "is_initialized",
    "retire_sibling_group",
    "sibling_group",
    "tagged_buffer",
    "traits",
]

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "avg": "AVG"}
"""``avg`` only where :func:`backend_averages` says the backend has it."""


# --------------------------------------------------------------------------- collectives


def all_reduce(
    tensor: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    stats: CommStats | None = None,
    padding_numel: int = 0,
    op: str = "sum",
    kind: str = "all_reduce",
) -> Handle:
    """Sum (or max, min, or average where :func:`backend_averages`) ``tensor`` across ranks, in
    place. ``kind`` is the key its bytes are counted under in ``stats``."""
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce: op must be one of {', '.join(_REDUCE_OPS)}, got {op!r}")
    world_size = get_world_size(group)
    record_traffic(stats, kind, tensor, padding_numel, world_size)
    if world_size == 1:
        return Handle()
    work = dist.all_reduce(tensor, op=_reduce_op("all_reduce", op, group, tensor.device), group=group, async_op=True)
    return _finish(Handle(work, op=kind if kind != "all_reduce" else f"all_reduce ({op})", group=group), async_op)


def _reduce_op(collective: str, op: str, group: ProcessGroup | None, device: torch.device) -> Any:
    """The ``dist.ReduceOp`` of ``op``; ``avg`` only where the backend has it."""
    if op == "avg" and not backend_averages(group, device):
        raise ValueError(f"{collective}: the {dist.get_backend(group)} backend has no average; sum and divide")
    return getattr(dist.ReduceOp, _REDUCE_OPS[op])


def _split_collective(
    op: str,
    output: torch.Tensor,
    input: torch.Tensor,
    group: ProcessGroup | None,
    stats: CommStats | None,
    padding_numel: int,
    kind: str | None = None,
) -> int:
    """What reduce-scatter and all-gather share before moving data: check that the full
    tensor (reduce-scatter's input, all-gather's output) is N times the other, record the
    traffic (under ``kind``, default the op), and at world size 1 complete the op (a copy,
    unless ``output`` already is ``input``). Returns the world size."""
    world_size = get_world_size(group)
    names = ("input", "output") if op == "reduce_scatter" else ("output", "input")
    full, part = (input, output) if op == "reduce_scatter" else (output, input)
    if full.numel() != part.numel() * world_size:
        raise ValueError(
            f"{op}: {names[0]} has {full.numel()} elements, expected "
            f"{world_size} x {part.numel()} ({names[1]} size x world size)"
        )
    record_traffic(stats, kind or op, full, padding_numel, world_size)
    if world_size == 1 and output.data_ptr() != input.data_ptr():
        output.copy_(input)
    return world_size


def _finish(handle: Handle, async_op: bool) -> Handle:
    if not async_op:
        handle.wait()
    return handle


def reduce_scatter(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    stats: CommStats | None = None,
    padding_numel: int = 0,
    op: str = "sum",
) -> Handle:
    """Sum ``input`` (1-D, numel = N·output.numel()) across ranks; rank r receives slice r.
    ``op="avg"`` averages instead, on backends that have it (:func:`backend_averages`).

    ``output`` may be rank r's own slice of ``input`` (an in-place reduce-scatter). One
    reduce-scatter; :class:`ReduceScatterPlan` prepares those of one size on one group once.
    """
    plan = ReduceScatterPlan(input, group=group, stats=stats, padding_numel=padding_numel, op=op)
    return _finish(plan.start(output, input), async_op)


class ReduceScatterPlan:
    """Reduce-scatters of one size, dtype and device on one group, with what is the same from
    one to the next worked out once (the world size, the reduce op, whether the backend's is
    emulated, [Note: gloo reduce-scatter and all-gather], and the bytes counted): a bucket is
    reduce-scattered every step (stages 1-3), and each of these was a call per reduction.
    :meth:`start` is :func:`reduce_scatter` with ``async_op=True``."""

    def __init__(
        self,
        like: torch.Tensor,
        *,
        group: ProcessGroup | None = None,
        stats: CommStats | None = None,
        padding_numel: int = 0,
        op: str = "sum",
    ) -> None:
        """``like``: a tensor of the inputs' size, dtype and device (its values are not read)."""
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter: op must be 'sum' or 'avg', got {op!r}")
        self.world_size = get_world_size(group)
        self.numel = like.numel()
        self.group, self.stats = group, stats
        element = like.element_size()
        self._counted = ((self.numel - padding_numel) * element, padding_numel * element)
        multi_rank = self.world_size > 1
        self._reduce_op = _reduce_op("reduce_scatter", op, group, like.device) if multi_rank else None
        self._emulated = multi_rank and traits(group, like.device).emulated_split

    def start(self, output: torch.Tensor, input: torch.Tensor) -> Handle:
        world_size = self.world_size
        if input.numel() != self.numel or output.numel() * world_size != self.numel:
            raise ValueError(
                f"reduce_scatter: input has {input.numel()} elements, expected "
                f"{world_size} x {output.numel()} (output size x world size)"
                + (f" and the {self.numel} it was planned for" if input.numel() != self.numel else "")
            )
        if self.stats is not None:  # the collective's bytes
            self.stats.record_bytes("reduce_scatter", *self._counted, world_size)
        if world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Handle()
        if not self._emulated:
            work = compat.reduce_scatter_single(output, input, op=self._reduce_op, group=self.group, async_op=True)
            return Handle(work, op="reduce_scatter", group=self.group)
        # See [Note: gloo reduce-scatter and all-gather]. The sum reads only `received`, so
        # `output` may alias `input`.
        received = torch.empty_like(input)
        chunks = received.view(world_size, -1)

        def sum_received() -> None:
            # Chained adds: about twice as fast on CPU as torch.sum over the chunk dimension.
            torch.add(chunks[0], chunks[1], out=output)
            for chunk in chunks[2:]:
                output.add_(chunk)

        work = dist.all_to_all_single(received, input, group=self.group, async_op=True)
        return Handle(work, then=sum_received, op="reduce_scatter", group=self.group)


def all_gather(
    output: torch.Tensor,
    input: torch.Tensor,
    *,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    stats: CommStats | None = None,
    padding_numel: int = 0,
    kind: str = "all_gather",
) -> Handle:
    """Concatenate every rank's ``input`` (1-D) into ``output`` in rank order.

    ``input`` may be rank r's own slice of ``output`` (an in-place all-gather). ``kind`` is
    the key its bytes are counted under in ``stats``.
    """
    world_size = _split_collective("all_gather", output, input, group, stats, padding_numel, kind)
    if world_size == 1:
        return Handle()
    if not traits(group, output.device).emulated_split:
        work = compat.all_gather_single(output, input, group=group, async_op=True)
        return _finish(Handle(work, op="all_gather", group=group), async_op)
    # See [Note: gloo reduce-scatter and all-gather]: every rank broadcasts its own chunk.
    chunks = output.view(world_size, -1)
    own = chunks[get_rank(group)]
    if own.data_ptr() != input.data_ptr():
        own.copy_(input)
    works = [compat.broadcast(chunk, group_src=src, group=group, async_op=True) for src, chunk in enumerate(chunks)]
    return _finish(Handle(works, op="all_gather", group=group), async_op)


def broadcast(
    tensor: torch.Tensor,
    src: int = 0,
    *,
    group: ProcessGroup | None = None,
    async_op: bool = False,
    stats: CommStats | None = None,
) -> Handle:
    """Overwrite ``tensor`` on every rank with rank ``src``'s (a group rank)."""
    world_size = get_world_size(group)
    record_traffic(stats, "broadcast", tensor, 0, world_size)
    if world_size == 1:
        return Handle()
    work = compat.broadcast(tensor, group_src=src, group=group, async_op=True)
    return _finish(Handle(work, op=f"broadcast from rank {src}", group=group), async_op)


def all_gather_objects(
    obj: Any,
    *,
    group: ProcessGroup | None = None,
    device: torch.device | None = None,
    stats: CommStats | None = None,
    kind: str = "control",
) -> list[Any]:
    """Every rank's ``obj`` (small, picklable metadata such as a model signature): two
    all-gathers (sizes, then the pickles padded to the longest) whose waits are bounded like
    any other, counted under ``kind`` in ``stats`` (the pickles' padding as padding).
    ``device``: the caller's (the engine's, the module's); the bytes travel on the CPU where
    the group has a CPU backend, else there ([Note: object collectives] in devices.py)."""
    world_size = get_world_size(group)
    if world_size == 1:
        return [obj]
    device = devices.object_device(group, device)
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    sizes = torch.zeros(world_size, dtype=torch.int64, device=device)
    all_gather(sizes, host.to_device([payload.numel()], torch.int64, device), group=group, stats=stats, kind=kind)
    sizes = sizes.cpu()
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()].copy_(payload)
    gathered = torch.empty(world_size * longest, dtype=torch.uint8, device=device)
    all_gather(
        gathered, padded, group=group, stats=stats, padding_numel=world_size * longest - int(sizes.sum()), kind=kind
    )
    rows = gathered.view(world_size, longest).cpu()
    return [pickle.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(world_size)]


def broadcast_object(
    obj: Any, src: int = 0, *, group: ProcessGroup | None = None, device: torch.device | None = None
) -> Any:
    """Rank ``src``'s ``obj`` (a group rank; small and picklable: a path, a decision) on every
    rank; what the other ranks pass is ignored, never pickled. Two broadcasts (the size, then
    the pickle) whose waits are bounded like any other; ``device`` as in
    :func:`all_gather_objects`."""
    if get_world_size(group) == 1:
        return obj
    device = devices.object_device(group, device)
    sending = get_rank(group) == src
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8) if sending else None
    size = host.to_device([payload.numel() if payload is not None else 0], torch.int64, device)
    broadcast(size, src, group=group)
    received = (
        payload.to(device) if payload is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    )
    broadcast(received, src, group=group)
    return obj if sending else pickle.loads(received.cpu().numpy().tobytes())


def barrier(group: ProcessGroup | None = None) -> None:
    if get_world_size(group) > 1:
        Handle(dist.barrier(group=group, async_op=True), op="barrier", group=group).wait()


def send(tensor: torch.Tensor, dst: int, *, group: ProcessGroup | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` (a group rank), blocking; the peer calls :func:`recv`.

    Point-to-point, for moving one tensor to one rank (e.g. a full export gathering piece by
    piece on rank 0) where a collective would move it to every rank."""
    work = compat.isend(tensor, group_dst=dst, group=group)
    watch.point_to_point(group)
    Handle(work, op=f"send to rank {dst}", group=group, collective=False).wait()


def recv(tensor: torch.Tensor, src: int, *, group: ProcessGroup | None = None) -> None:
    """Receive into ``tensor`` what rank ``src`` (a group rank) sends with :func:`send`."""
    work = compat.irecv(tensor, group_src=src, group=group)
    watch.point_to_point(group)
    Handle(work, op=f"recv from rank {src}", group=group, collective=False).wait()
