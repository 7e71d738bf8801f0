"""The collective layer: the only module of shardpar that calls ``torch.distributed``'s
collectives (through ``compat`` where a torch older than the newest names them otherwise).

Functions are named by what they do and carry no training logic. Each works unchanged at
world size 1 without any process group (the collective is then the identity), returns a
:class:`Handle` when ``async_op=True``, and records what it moved in a :class:`CommStats`
when one is passed.

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
([Note: tagged all-gather]) and gloo delivers the shorter message into them, so a counter
that prices each rank's posted tensor counts about 10% more at stage 3 than moves
(issue #32). At N > 2 gloo's broadcast tree forwards the whole posted buffer, so there its
real traffic for gathers of units smaller than the largest exceeds the ring model.

Every collective an engine issues from the end of ``wrap`` on in training is counted, under
the kinds of ``_SEND_FACTOR``: forward, backward, ``clip_grad_norm_``, ``GradScaler`` and
``step()``, the one-off agreements of the first steps included; tests/test_comm_stats.py
checks the sum against a counter wrapped around ``torch.distributed``, exactly. Not
counted: ``wrap``'s own set-up, state dicts, checkpoints and the reports of an error.

[Note: gloo reduce-scatter and all-gather]
gloo's ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are several times slower than its
all-reduce on the same buffer (measured in docs/benchmarks.md), while its all-to-all and
broadcast are fast. On gloo we therefore build them from those: reduce-scatter is an
all-to-all (rank r receives every rank's chunk r) followed by a local sum, and all-gather is
one broadcast per rank of its own chunk. Each rank still sends S·(N-1)/N bytes, so the
accounting above holds; the only cost is a scratch buffer of S bytes for the all-to-all.
NCCL and other backends keep the native collectives.

[Note: tagged all-gather]
Stage 3 gathers units in the order each rank's forward and backward run them, so a
rank-dependent order pairs one rank's gather of unit A with another's of unit B: wrong
values if the sizes agree, and if they differ gloo aborts the process (a receiver getting
more bytes than it posted). :func:`all_gather_tagged` makes that impossible to miss and
impossible to crash on, without an extra collective: every rank prefixes its shard with a
16-byte tag (what it is gathering) and receives every peer's message into a buffer as large
as the largest shard of any unit, so a message of another unit always fits (gloo accepts a
shorter message than posted). After the wait every rank holds every rank's tag and can
compare; only if they agree is the payload copied out into the unit's full buffer. On gloo
the exchange is one broadcast per rank of its tagged shard (as the untagged all-gather: the
bytes each rank sends are the ring model's, S·(N-1)/N of the gathered tensor); other
backends use their all-gather on the tagged buffers, which cannot survive a size mismatch
(NCCL would hang until the timeout).

The copy out is one more pass over every gathered byte, so on gloo a message is received
straight into the full buffer where that is safe (:func:`gather_target` leaves 16 bytes of
room in front of it): peer src's window is then ``[src·S - 16, (src+1)·S)`` of the full
buffer's bytes, its tag landing in the 16 bytes before its chunk. That is safe only when the
window is exactly one message long (the shard is the largest one, so a mismatched message
still fits, and gloo's broadcast tree, which forwards the whole posted buffer at N > 2,
forwards nothing but the message) and its first 16 bytes belong to nobody else: the room in
front (src = 0) or this rank's own chunk (src = rank + 1, when a chunk is at least 16 bytes),
which is written only after every tag was read. The windows of one rank are then disjoint.
Every other peer still goes through the receive buffer. At N = 2 every peer of a
largest-shard unit is received in place; on a mismatch the full buffer's contents are
undefined (the caller raises or gathers again).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import os
import pickle
import struct
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from . import compat, devices, host, watch

ProcessGroup = Any  # torch's ProcessGroup; kept loose so world size 1 needs no torch.distributed

# [Note: no group outlives destroy_process_group]
# After ``dist.destroy_process_group()`` nothing of shardpar's may hold a process group, as
# nothing of plain torch's does: a group still referenced keeps its backend's threads running
# into the interpreter's exit, where gloo's can abort a run that finished ("terminate called
# without an active exception"). Three things held them:
# - some torch modules give their functions ``group=group.WORLD`` as a default argument,
#   evaluated once at import, so importing them after ``init_process_group`` keeps that group
#   alive for good; ``torch.compiler.disable`` (which shardpar's hooks need) imports them
#   through Dynamo at the first wrap. They are imported here instead, with shardpar, when no
#   group exists yet and the default is None (milliseconds);
# - the parameter hooks held the engine, which holds the group (see [Note: hooks hold their
#   owner weakly] in core/reducer.py);
# - the sibling groups below are kept per parent group, weakly.
# tests/test_lifetime.py checks that the groups are freed at every stage.
_IMPORTED_BEFORE_ANY_GROUP = (
    "torch.distributed.nn.functional",
    "torch.distributed._shard.sharded_tensor",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops.embedding",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops.embedding_bag",
)
if dist.is_available():
    for _name in _IMPORTED_BEFORE_ANY_GROUP:
        try:
            importlib.import_module(_name)
        except ImportError:  # another torch version's layout: the lifetime test says what to list
            pass

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
_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN", "avg": "AVG"}
"""``avg`` only where :func:`backend_averages` says the backend has it."""


@dataclass(frozen=True)
class BackendTraits:
    """What the backend that serves one device type of a group can do, as the functions here
    use it. Read per device type ([Note: a rank's device] in devices.py): a
    ``"cpu:gloo,cuda:nccl"`` group runs NCCL for CUDA tensors and gloo for CPU ones."""

    backend: str
    averages: bool
    """``ReduceOp.AVG`` divides by N inside the collective (NCCL); elsewhere the caller divides."""
    emulated_split: bool
    """Reduce-scatter and all-gather are built from all-to-all and broadcasts (gloo: see
    [Note: gloo reduce-scatter and all-gather]); else the backend's own collectives."""
    tolerant_gathers: bool
    """A receiver may post more bytes than a sender sends (gloo's broadcast), so a tagged gather
    of units of different sizes completes and shows the mismatch. Where it may not (NCCL: a
    mismatch hangs), no rank may post a gather it does not know the others post too: see
    [Note: deferred tag checks] in core/unit_order.py."""
    aligns: bool
    """Layouts are aligned for bandwidth when ``align_for_bandwidth`` is None ([Note: alignment])."""


_KNOWN_BACKENDS = {
    "gloo": BackendTraits("gloo", averages=False, emulated_split=True, tolerant_gathers=True, aligns=False),
    "nccl": BackendTraits("nccl", averages=True, emulated_split=False, tolerant_gathers=False, aligns=True),
}
_forced_native = False


@contextlib.contextmanager
def forcing_native_paths() -> Iterator[None]:
    """Within, every backend is treated as one without gloo's emulated collectives or tolerant
    gathers: the code paths NCCL takes run on gloo, whose native collectives serve them (tests)."""
    global _forced_native
    before, _forced_native = _forced_native, True
    try:
        yield
    finally:
        _forced_native = before


def traits(group: ProcessGroup | None, device: torch.device | None = None) -> BackendTraits:
    """What the backend of ``group`` (None: the default group, which must exist) for tensors on
    ``device`` can do (None: the group's CUDA backend if it has one, else its only one). A
    backend shardpar does not know is taken at its weakest: no average, native collectives,
    no tolerance of a size mismatch."""
    served = devices.group_backends(group)
    if device is not None and device.type in served:
        name = served[device.type]
    elif device is None and "cuda" in served:
        name = served["cuda"]
    else:
        name = str(dist.get_backend(group)).lower()
    found = _KNOWN_BACKENDS.get(name) or BackendTraits(name, averages=False, emulated_split=False,
                                                       tolerant_gathers=False, aligns=True)
    if _forced_native:
        found = dataclasses.replace(found, emulated_split=False, tolerant_gathers=False)
    return found


def backend_averages(group: ProcessGroup | None, device: torch.device | None = None) -> bool:
    """Whether the backend divides by N inside the collective (``ReduceOp.AVG``): NCCL does,
    gloo does not (there the caller divides in a pass of its own)."""
    return get_world_size(group) > 1 and traits(group, device).averages


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


class Handle:
    """An in-flight collective. ``wait()`` blocks until it is done and returns what the
    finishing step returned (None for most ops); calling it twice is fine. Waits are bounded
    and failures explained as [Note: ranks out of step] in ``shardpar.comm.watch`` says."""

    def __init__(
        self, work: Any = None, then: Callable[[], Any] | None = None, *, op: str = "collective",
        group: ProcessGroup | None = None, issued: int | None = None, collective: bool = True,
    ) -> None:
        """``work``: one torch work object, a list of them, or None (already done); ``then``
        runs once after every work finished (e.g. a local sum that completes the op);
        ``op`` and ``group`` name the collective in error reports. ``issued``: the count of
        ``group``'s collectives after the last work (:func:`watch.issued`), if not the count
        now (another collective was issued on ``group`` since). ``collective`` False: a
        point-to-point operation, which has no place in that count."""
        self._works = [] if work is None else list(work) if isinstance(work, (list, tuple)) else [work]
        self._then = then
        self._result: Any = None
        self._op = op
        self._group = group
        self._issued = issued if issued is not None or not self._works or not collective else watch.issued(group)

    def wait(self) -> Any:
        while self._works:
            # The works were issued one after the other on the group, so the first one left is
            # the one numbered len(works) - 1 before the last ([Note: stalled waits] in watch).
            number = None if self._issued is None else self._issued - len(self._works) + 1
            watch.wait(self._works[0], op=self._op, group=self._group, number=number)
            self._works.pop(0)
        if self._then is not None:
            then, self._then = self._then, None
            self._result = then()
        return self._result

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


# --------------------------------------------------------------------------- process group


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def launched_world_size() -> int:
    """World size torchrun (or another launcher) announced through the environment."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU, as torch itself picks."""
    return compat.default_backend_for_device(device.type)


def init_default_group(device: torch.device, timeout_s: float) -> None:
    """Create the default process group from torchrun's environment, if there is none yet.

    Does nothing when a group exists (the script made it) or when no launcher announced a
    world size above one: a plain ``python train.py`` runs at world size 1 with no group.
    """
    if is_initialized() or launched_world_size() <= 1:
        return
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {var} is not; launch with "
                "torchrun (which sets RANK, MASTER_ADDR and MASTER_PORT) or call "
                "torch.distributed.init_process_group yourself"
            )
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        bound = devices.rank_device().device  # cuda:LOCAL_RANK where visible; one GPU per rank: cuda:0
        torch.cuda.set_device(bound)
        kwargs["device_id"] = bound
    backend = backend_for(device)
    timeout = backend_timeout(timeout_s, backend)
    store = attempt_store(timeout)
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=launched_world_size())
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)


def backend_timeout(timeout_s: float, backend: str) -> datetime.timedelta:
    """The timeout to give a process group that shardpar's ``timeout_s`` governs.

    On gloo shardpar bounds its own waits by ``timeout_s`` and then names the ranks (see
    [Note: ranks out of step] in ``watch``); gloo's own timeout, which closes the connections
    and says only "Application timeout", gets a margin so that it never fires first. It still
    ends collectives shardpar does not wait on (a script's own), a moment later. NCCL's
    watchdog is the only bound there, so it gets ``timeout_s`` itself.
    """
    margin = watch.GLOO_MARGIN_S if backend == dist.Backend.GLOO else 0.0
    return datetime.timedelta(seconds=timeout_s + margin)


def attempt_store(timeout: datetime.timedelta) -> Any:
    """Under torchrun, the agent's store in a namespace of this restart attempt (else None).

    [Note: one store namespace per restart]
    torchrun's agent hosts the TCPStore every attempt of an elastic job rendezvouses in, and
    it outlives the attempts; ``init_process_group`` (env://) writes and reads the same keys
    each time. A rank of a restarted attempt that looks up a peer before that peer re-joined
    reads the dead process's address and fails ("Gloo connectFullMesh failed ... Connection
    refused"), so a restart works or not by chance. Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` gives every attempt its own.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), launched_world_size(),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"shardpar/attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


# --------------------------------------------------------------------------- collectives


def _record(
    stats: CommStats | None, op: str, tensor: torch.Tensor, padding_numel: int, world_size: int
) -> None:
    if stats is not None:
        stats.record(op, tensor.numel(), padding_numel, tensor.element_size(), world_size)


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
    _record(stats, kind, tensor, padding_numel, world_size)
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
    _record(stats, kind or op, full, padding_numel, world_size)
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

    ``output`` may be rank r's own slice of ``input`` (an in-place reduce-scatter).
    """
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce_scatter: op must be 'sum' or 'avg', got {op!r}")
    world_size = _split_collective("reduce_scatter", output, input, group, stats, padding_numel)
    if world_size == 1:
        return Handle()
    reduce_op = _reduce_op("reduce_scatter", op, group, input.device)
    if not traits(group, input.device).emulated_split:
        work = compat.reduce_scatter_single(output, input, op=reduce_op, group=group, async_op=True)
        return _finish(Handle(work, op="reduce_scatter", group=group), async_op)
    # See [Note: gloo reduce-scatter and all-gather]. The sum reads only `received`, so
    # `output` may alias `input`.
    received = torch.empty_like(input)
    chunks = received.view(world_size, -1)

    def sum_received() -> None:
        # Chained adds: about twice as fast on CPU as torch.sum over the chunk dimension.
        torch.add(chunks[0], chunks[1], out=output)
        for chunk in chunks[2:]:
            output.add_(chunk)

    work = dist.all_to_all_single(received, input, group=group, async_op=True)
    return _finish(Handle(work, then=sum_received, op="reduce_scatter", group=group), async_op)


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


TAG_BYTES = 16
"""Bytes of the tag each rank prefixes to its shard in :func:`all_gather_tagged`."""


def gather_target(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 1-D tensor of ``numel`` elements of ``dtype`` with ``TAG_BYTES`` of room in front of it
    in its storage, so that :func:`all_gather_tagged` can receive peers' tagged messages
    straight into it (see [Note: tagged all-gather]). Resizing its storage to
    ``TAG_BYTES + numel * element size`` allocates it again after a ``resize_(0)``."""
    element = torch.empty((), dtype=dtype).element_size()
    room = TAG_BYTES // element
    return torch.empty(room + numel, dtype=dtype, device=device)[room:]


def _room_in_front(full: torch.Tensor) -> torch.Tensor | None:
    """The bytes of ``full``'s storage from ``TAG_BYTES`` before ``full`` to its end, or None
    when ``full`` has no such room (it is not a :func:`gather_target`)."""
    start = full.storage_offset() * full.element_size() - TAG_BYTES
    if start < 0 or not full.is_contiguous():
        return None
    storage_bytes = torch.empty(0, dtype=torch.uint8, device=full.device).set_(full.untyped_storage())
    return storage_bytes[start : start + TAG_BYTES + full.numel() * full.element_size()]


def tagged_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A byte buffer with room for a tag in front of ``numel`` elements of ``dtype``, and the
    1-D view of those elements: a shard kept in one is sent by :func:`all_gather_tagged`
    without a copy."""
    element = torch.empty((), dtype=dtype).element_size()
    buffer = torch.empty(TAG_BYTES + numel * element, dtype=torch.uint8, device=device)
    return buffer, buffer[TAG_BYTES:].view(dtype)


def all_gather_tagged(
    full: torch.Tensor,
    send: torch.Tensor,
    tag: Sequence[int],
    *,
    max_shard_bytes: int,
    group: ProcessGroup | None = None,
    stats: CommStats | None = None,
    padding_numel: int = 0,
    what: str = "",
    kind: str = "all_gather",
) -> Handle:
    """All-gather every rank's shard into ``full`` (1-D, N x the shard's elements) with a tag
    per rank; see [Note: tagged all-gather]. ``send`` is a :func:`tagged_buffer` holding this
    rank's shard (the tag is written into it here); ``tag`` is two int64s. Asynchronous:
    ``wait()`` returns every rank's tag (a list of N two-int lists); ``full`` holds the
    gathered payload only when every rank sent the tag this rank sent (otherwise its contents
    are undefined; the caller decides what a mismatch means). ``full`` made by
    :func:`gather_target` receives peers in place where that is safe. ``what`` names the
    payload in reports (``unit 'blocks.0'``), ``kind`` the key its bytes are counted under in
    ``stats`` (the tags as padding). One gather; :class:`TaggedAllGather` prepares the gathers
    into one ``full`` buffer once."""
    payload_bytes = send.numel() - TAG_BYTES
    return TaggedAllGather(full, payload_bytes, max_shard_bytes=max_shard_bytes, group=group, stats=stats,
                           padding_numel=padding_numel, what=what, kind=kind).start(send, tag)


_TAG = struct.Struct("=2q")
"""A tag's 16 bytes as two native int64s, as ``tag.view(torch.uint8)`` lays them out."""


class TaggedAllGather:
    """Tagged all-gathers ([Note: tagged all-gather]) into one ``full`` buffer, each rank
    sending ``payload_bytes``, with what is the same from one gather to the next (the group's
    rank and backend, the in-place windows, the byte counts) worked out once: stage 3 gathers
    every unit twice per step. The windows are views of ``full``'s storage, so they follow it
    through a ``resize_(0)`` and back; make one while ``full``'s storage is allocated."""

    def __init__(self, full: torch.Tensor, payload_bytes: int, *, max_shard_bytes: int,
                 group: ProcessGroup | None = None, stats: CommStats | None = None, padding_numel: int = 0,
                 what: str = "", kind: str = "all_gather") -> None:
        self.world_size, self.rank = get_world_size(group), get_rank(group)
        if full.numel() * full.element_size() != payload_bytes * self.world_size:
            raise ValueError(f"all_gather_tagged: output of {full.numel()} x {full.dtype} is not "
                             f"{self.world_size} x the {payload_bytes} payload bytes sent")
        assert payload_bytes <= max_shard_bytes, "max_shard_bytes must cover this shard"
        self.payload_bytes, self.max_shard_bytes = payload_bytes, max_shard_bytes
        self.group, self.stats, self.kind = group, stats, kind
        element = full.element_size()
        self._counted = ((full.numel() - padding_numel) * element, padding_numel * element + self.world_size * TAG_BYTES)
        self._full_bytes = full.view(torch.uint8)
        self._chunk_bytes = self._full_bytes.view(self.world_size, -1)
        self._gloo = self.world_size > 1 and traits(group, full.device).tolerant_gathers
        """Broadcasts into buffers sized for the largest shard; else the backend's all-gathers
        (see [Note: tagged all-gather]): a tag all-gather, then the payload in place."""
        # Peers received straight into ``full`` (gloo only; the rest through a receive buffer).
        self._in_place = (in_place_windows(full, self.rank, self.world_size, payload_bytes, max_shard_bytes)
                          if self._gloo else {})
        self._peers = [src for src in range(self.world_size) if src != self.rank]
        self._through_buffer = [src for src in self._peers if src not in self._in_place]
        self.receive_bytes = (len(self._through_buffer) * (TAG_BYTES + max_shard_bytes) if self._gloo
                              else self.world_size * TAG_BYTES if self.world_size > 1 else 0)
        """Bytes of receive buffers one gather holds while in flight (the planner counts them too)."""
        self._op = f"tagged all_gather of {what}" if what else "tagged all_gather"

    def start(self, send: torch.Tensor, tag: Sequence[int]) -> Handle:
        """Send ``send`` (a :func:`tagged_buffer` of ``payload_bytes``) tagged with ``tag``."""
        assert send.numel() - TAG_BYTES == self.payload_bytes, "send another size than prepared"
        mine = list(tag)
        assert len(mine) == TAG_BYTES // 8, "a tag is two int64s"
        if self.stats is not None:
            self.stats.record_bytes(self.kind, *self._counted, self.world_size)
        own = send[TAG_BYTES:]
        if self.world_size == 1:
            self._chunk_bytes[0].copy_(own)
            return Handle(then=lambda: [mine])
        if not self._gloo:
            return self._start_native(own, mine)
        send[:TAG_BYTES].copy_(host.to_device(mine, torch.int64, send.device).view(torch.uint8))
        # One broadcast per rank of its tagged shard, received in place where the note says
        # it is safe and otherwise into a buffer sized for the largest shard, so another
        # unit's message always fits.
        windows: list[torch.Tensor | None] = [None] * self.world_size
        if self._through_buffer:
            received = torch.empty(len(self._through_buffer), TAG_BYTES + self.max_shard_bytes, dtype=torch.uint8,
                                   device=send.device)
            for src, row in zip(self._through_buffer, received):
                windows[src] = row
        for src, window in self._in_place.items():
            windows[src] = window
        works = [compat.broadcast(send if src == self.rank else windows[src], group_src=src, group=self.group,
                                async_op=True) for src in range(self.world_size)]

        def check_then_copy() -> list[list[int]]:
            # Every tag is read before anything is written: a peer's tag may sit in this rank's
            # chunk. One read of the peers' tags, as bytes (a window need not be aligned for int64).
            peers = [windows[src][:TAG_BYTES] for src in self._peers]
            raw = [host.read_host(peers[0])] if len(peers) == 1 else host.read_host(torch.stack(peers))
            tags = [mine] * self.world_size
            for src, tag_bytes in zip(self._peers, raw):
                tags[src] = list(_TAG.unpack(bytes(tag_bytes)))
            if all(t == mine for t in tags):
                for src in self._through_buffer:
                    self._chunk_bytes[src].copy_(windows[src][TAG_BYTES : TAG_BYTES + self.payload_bytes])
                self._chunk_bytes[self.rank].copy_(own)
            return tags

        return Handle(works, then=check_then_copy, op=self._op, group=self.group)

    def _start_native(self, own: torch.Tensor, mine: list[int]) -> Handle:
        """Other backends: every rank's tag by a 16-byte all-gather, then the payload by an
        all-gather straight into ``full`` (this rank's chunk is its input: no receive buffer,
        no copy out). Every rank must post the same payload size: the gatherer makes sure
        before it starts one ([Note: deferred tag checks] in core/unit_order.py). ``wait()``
        returns the tags as :class:`GatheredTags`, read when the caller chooses; ``full``
        holds the gathered payload only if they agree."""
        device = own.device
        tags = torch.empty(self.world_size * 2, dtype=torch.int64, device=device)
        tag_work = compat.all_gather_single(tags, host.to_device(mine, torch.int64, device), group=self.group,
                                               async_op=True)
        gathered = GatheredTags(tag_work, tags, op=self._op, group=self.group)
        self._chunk_bytes[self.rank].copy_(own)
        work = compat.all_gather_single(self._full_bytes, self._chunk_bytes[self.rank], group=self.group,
                                           async_op=True)
        payload_number = None if gathered.number is None else gathered.number + 1
        if device.type != "cpu":
            return Handle([work], then=lambda: gathered, op=self._op, group=self.group)

        # On the CPU a wait blocks the host (on a GPU only the stream), and a payload another
        # rank never posted would block it until the timeout: the tags, which every rank posted,
        # are read first, and a mismatch is returned at once for the caller to raise.
        def payload_if_tags_agree() -> "list[list[int]] | GatheredTags":
            rows = gathered.rows_now()
            if any(row != mine for row in rows):
                return rows
            watch.wait(work, op=self._op, group=self.group, number=payload_number)
            return gathered

        return Handle([tag_work], then=payload_if_tags_agree, op=self._op, group=self.group, issued=gathered.number)


def all_gather_tags(tag: Sequence[int], *, group: ProcessGroup | None, device: torch.device,
                    stats: CommStats | None = None, kind: str = "control") -> Handle:
    """Every rank's ``tag`` (two ints) alone, by one all-gather; ``wait()`` returns them as N
    two-int lists, read on the host (it waits for the device: set-up and probes only). Its
    bytes are counted under ``kind`` in ``stats``."""
    world_size = get_world_size(group)
    if world_size == 1:
        return Handle(then=lambda: [list(tag)])
    tags = torch.empty(world_size * 2, dtype=torch.int64, device=device)
    _record(stats, kind, tags, 0, world_size)
    work = compat.all_gather_single(tags, host.to_device(list(tag), torch.int64, device), group=group,
                                       async_op=True)

    return Handle(work, then=lambda: _tag_rows(host.DeviceToHost(tags).values()), op="tag all_gather", group=group)


def _tag_rows(values: list[int]) -> list[list[int]]:
    """N ranks' tags (two ints each, back to back) as N two-int lists."""
    return [values[i : i + 2] for i in range(0, len(values), 2)]


class GatheredTags:
    """Every rank's tag of one tagged gather on a backend without tolerant gathers, on its way
    to the host: on a GPU copied to pinned memory on a side stream that waits for the tag
    all-gather alone (not for the payload, nor for anything queued after it), so the tags of
    a gather whose payload never completes (another rank raised) still arrive; on the CPU the
    all-gather's own work. Read with :meth:`rows` (blocking) once :meth:`ready` says so, or
    where the caller must know ([Note: deferred tag checks] in core/unit_order.py)."""

    def __init__(self, work: Any, tags: torch.Tensor, *, op: str, group: ProcessGroup | None) -> None:
        self._op, self._group = op, group
        self.number = watch.issued(group)
        """The tag all-gather's number on ``group`` (made right after it: :func:`watch.issued`)."""
        self._work: Any = None
        self._tags = tags
        self._read: host.DeviceToHost | None = None
        if tags.device.type == "cuda":
            stream = _tag_stream(tags.device)
            tags.record_stream(stream)
            with torch.cuda.stream(stream):
                work.wait()  # the side stream waits for the tags, the host does not
                self._read = host.DeviceToHost(tags, stream=stream)
        else:
            self._work = work

    def ready(self) -> bool:
        """Whether :meth:`rows` would return without waiting."""
        if self._work is not None:
            return self._work.is_completed() and not host.reads_deferred()
        assert self._read is not None
        return self._read.ready()

    def rows_now(self) -> list[list[int]]:
        """The tags of a CPU gather whose tag all-gather completed, read without marking them read."""
        return _tag_rows(host.read_host(self._tags))

    def rows(self) -> list[list[int]]:
        """Every rank's tag (N two-int lists), waiting for them if need be."""
        if self._work is not None:
            watch.wait(self._work, op=self._op, group=self._group, number=self.number)
            self._work = None
            self._read = host.DeviceToHost(self._tags)
        assert self._read is not None
        return _tag_rows(self._read.values())


_TAG_STREAMS: dict[torch.device, Any] = {}


def _tag_stream(device: torch.device) -> Any:
    """One side stream per GPU for the copies of gather tags to the host."""
    if device not in _TAG_STREAMS:
        _TAG_STREAMS[device] = torch.cuda.Stream(device=device)
    return _TAG_STREAMS[device]


def in_place_windows(full: torch.Tensor, rank: int, world_size: int, payload_bytes: int,
                     max_shard_bytes: int) -> dict[int, torch.Tensor]:
    """The peers whose tagged message ``full`` can receive in place, each with its window (the
    16 bytes before the peer's chunk and the chunk); see [Note: tagged all-gather]."""
    if payload_bytes != max_shard_bytes or payload_bytes < TAG_BYTES:
        return {}  # a window longer than its chunk, or a tag longer than a chunk, would overlap another
    room = _room_in_front(full)
    if room is None:
        return {}
    peers = [src for src in (0, rank + 1) if src != rank and src < world_size]
    return {src: room[src * payload_bytes : (src + 1) * payload_bytes + TAG_BYTES] for src in peers}


_SIBLING_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""Parent group -> its sibling. Weak in the parent, so a sibling lives no longer than its parent
(the default group too, once ``destroy_process_group`` dropped it; a later default group is
another key): [Note: no group outlives destroy_process_group]."""


def sibling_group(group: ProcessGroup | None, timeout_s: float) -> ProcessGroup | None:
    """A second process group over the same ranks as ``group`` (created once per parent),
    so that two independent streams of collectives (stage 3's gathers and its gradient
    reductions) can never be paired with each other when ranks issue them in a different
    interleaving. None at world size 1."""
    if get_world_size(group) == 1:
        return None
    parent = group if group is not None else dist.group.WORLD
    if parent not in _SIBLING_GROUPS:
        _SIBLING_GROUPS[parent] = dist.new_group(
            ranks=dist.get_process_group_ranks(parent), timeout=backend_timeout(timeout_s, dist.get_backend(parent)),
            use_local_synchronization=True,
        )
    return _SIBLING_GROUPS[parent]


def retire_sibling_group(group: ProcessGroup | None) -> None:
    """Forget the sibling of ``group`` after its collectives fell out of step (some ranks may
    have gathers outstanding that will never be matched): the next :func:`sibling_group`
    call creates a fresh one. Every rank retires it at the same point, since every rank sees
    the same mismatch."""
    parent = group if group is not None else dist.group.WORLD
    if parent is not None:
        _SIBLING_GROUPS.pop(parent, None)


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
    _record(stats, "broadcast", tensor, 0, world_size)
    if world_size == 1:
        return Handle()
    work = compat.broadcast(tensor, group_src=src, group=group, async_op=True)
    return _finish(Handle(work, op=f"broadcast from rank {src}", group=group), async_op)


def all_gather_objects(obj: Any, *, group: ProcessGroup | None = None, device: torch.device | None = None,
                       stats: CommStats | None = None, kind: str = "control") -> list[Any]:
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
    all_gather(gathered, padded, group=group, stats=stats, padding_numel=world_size * longest - int(sizes.sum()),
               kind=kind)
    rows = gathered.view(world_size, longest).cpu()
    return [pickle.loads(bytes(rows[r, : int(sizes[r])].tolist())) for r in range(world_size)]


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
