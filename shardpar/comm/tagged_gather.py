"""Tagged all-gathers: stage 3's gathers of units, each rank's shard carrying a tag that
says what it is, so that ranks gathering different units find out instead of mixing or
crashing.

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

import struct
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import compat, host, watch
from .backend_traits import traits
from .comm_stats import CommStats, record_traffic
from .handle import Handle
from .process_group import ProcessGroup, get_rank, get_world_size

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
    return TaggedAllGather(
        full,
        payload_bytes,
        max_shard_bytes=max_shard_bytes,
        group=group,
        stats=stats,
        padding_numel=padding_numel,
        what=what,
        kind=kind,
    ).start(send, tag)


_TAG = struct.Struct("=2q")
"""A tag's 16 bytes as two native int64s, as ``tag.view(torch.uint8)`` lays them out."""


class TaggedAllGather:
    """Tagged all-gathers ([Note: tagged all-gather]) into one ``full`` buffer, each rank
    sending ``payload_bytes``, with what is the same from one gather to the next (the group's
    rank and backend, the in-place windows, the byte counts) worked out once: stage 3 gathers
    every unit twice per step. The windows are views of ``full``'s storage, so they follow it
    through a ``resize_(0)`` and back; make one while ``full``'s storage is allocated."""

    def __init__(
        self,
        full: torch.Tensor,
        payload_bytes: int,
        *,
        max_shard_bytes: int,
        group: ProcessGroup | None = None,
        stats: CommStats | None = None,
        padding_numel: int = 0,
        what: str = "",
        kind: str = "all_gather",
    ) -> None:
        self.world_size, self.rank = get_world_size(group), get_rank(group)
        if full.numel() * full.element_size() != payload_bytes * self.world_size:
            raise ValueError(
                f"all_gather_tagged: output of {full.numel()} x {full.dtype} is not "
                f"{self.world_size} x the {payload_bytes} payload bytes sent"
            )
        assert payload_bytes <= max_shard_bytes, "max_shard_bytes must cover this shard"
        self.payload_bytes, self.max_shard_bytes = payload_bytes, max_shard_bytes
        self.group, self.stats, self.kind = group, stats, kind
        element = full.element_size()
        self._counted = (
            (full.numel() - padding_numel) * element,
            padding_numel * element + self.world_size * TAG_BYTES,
        )
        self._full_bytes = full.view(torch.uint8)
        self._chunk_bytes = self._full_bytes.view(self.world_size, -1)
        self._gloo = self.world_size > 1 and traits(group, full.device).tolerant_gathers
        """Broadcasts into buffers sized for the largest shard; else the backend's all-gathers
        (see [Note: tagged all-gather]): a tag all-gather, then the payload in place."""
        # Peers received straight into ``full`` (gloo only; the rest through a receive buffer).
        self._in_place = (
            in_place_windows(full, self.rank, self.world_size, payload_bytes, max_shard_bytes) if self._gloo else {}
        )
        self._peers = [src for src in range(self.world_size) if src != self.rank]
        self._through_buffer = [src for src in self._peers if src not in self._in_place]
        # Each rank's broadcast, its spelling chosen once (a gather issues one per rank).
        self._broadcasts = (
            [compat.broadcast_keywords(src, group) for src in range(self.world_size)] if self._gloo else []
        )
        self.receive_bytes = (
            len(self._through_buffer) * (TAG_BYTES + max_shard_bytes)
            if self._gloo
            else self.world_size * TAG_BYTES
            if self.world_size > 1
            else 0
        )
        """Bytes of receive buffers one gather holds while in flight (the planner counts them too)."""
        self._op = f"tagged all_gather of {what}" if what else "tagged all_gather"
        self._handle = _BroadcastsHandle(self)
        """The handle of every gloo gather of this plan, given out again by each ``start``."""

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
        windows: dict[int, torch.Tensor] = {}  # src -> where its broadcast lands; every peer has one
        if self._through_buffer:
            received = torch.empty(
                len(self._through_buffer), TAG_BYTES + self.max_shard_bytes, dtype=torch.uint8, device=send.device
            )
            for src, row in zip(self._through_buffer, received):
                windows[src] = row
        for src, window in self._in_place.items():
            windows[src] = window
        works = []  # (loops rather than comprehensions here: each of those is a call, twice per unit per step)
        for src, keywords in enumerate(self._broadcasts):
            works.append(dist.broadcast(send if src == self.rank else windows[src], **keywords))
        handle = self._handle
        assert not handle._works, "a gather into this buffer is already in flight"
        handle._works, handle._issued, handle._result = works, watch.issued(self.group), None
        handle.mine, handle.own, handle.windows = mine, own, windows
        return handle

    def _start_native(self, own: torch.Tensor, mine: list[int]) -> Handle:
        """Other backends: every rank's tag by a 16-byte all-gather, then the payload by an
        all-gather straight into ``full`` (this rank's chunk is its input: no receive buffer,
        no copy out). Every rank must post the same payload size: the gatherer makes sure
        before it starts one ([Note: deferred tag checks] in core/unit_order.py). ``wait()``
        returns the tags as :class:`GatheredTags`, read when the caller chooses; ``full``
        holds the gathered payload only if they agree."""
        device = own.device
        tags = torch.empty(self.world_size * 2, dtype=torch.int64, device=device)
        tag_work = compat.all_gather_single(
            tags, host.to_device(mine, torch.int64, device), group=self.group, async_op=True
        )
        gathered = GatheredTags(tag_work, tags, op=self._op, group=self.group)
        self._chunk_bytes[self.rank].copy_(own)
        work = compat.all_gather_single(self._full_bytes, self._chunk_bytes[self.rank], group=self.group, async_op=True)
        payload_number = None if gathered.number is None else gathered.number + 1
        if device.type != "cpu":
            return Handle([work], then=lambda: gathered, op=self._op, group=self.group)

        # On the CPU a wait blocks the host (on a GPU only the stream), and a payload another
        # rank never posted would block it until the timeout: the tags, which every rank posted,
        # are read first, and a mismatch is returned at once for the caller to raise.
        def payload_if_tags_agree() -> list[list[int]] | GatheredTags:
            rows = gathered.rows_now()
            if any(row != mine for row in rows):
                return rows
            watch.wait(work, op=self._op, group=self.group, number=payload_number)
            return gathered

        return Handle([tag_work], then=payload_if_tags_agree, op=self._op, group=self.group, issued=gathered.number)


_NO_BYTES = torch.empty(0, dtype=torch.uint8)
"""What a :class:`_BroadcastsHandle` holds of a send buffer between gathers."""


class _BroadcastsHandle(Handle):
    """The handle of a :class:`TaggedAllGather`'s gloo gather, its broadcast per rank: made
    once per plan and given out again by each of its gathers (a full buffer has one gather in
    flight at a time), so a gather, twice per unit per step, makes no handle. Its wait checks
    every rank's tag and, if they agree, copies the payload out (see [Note: tagged all-gather]);
    it returns every rank's tag."""

    def __init__(self, plan: TaggedAllGather) -> None:
        super().__init__(op=plan._op, group=plan.group)
        # What the wait needs of the plan, fixed by its layout (the plan itself is not held:
        # a one-off gather's plan and handle would otherwise be a reference cycle).
        self.peers, self.through_buffer, self.chunk_bytes = plan._peers, plan._through_buffer, plan._chunk_bytes
        self.rank, self.world_size, self.payload_bytes = plan.rank, plan.world_size, plan.payload_bytes
        self.mine: list[int] = []
        """This rank's tag of the gather in flight."""
        self.own = _NO_BYTES
        """This rank's payload (bytes), copied into its chunk once the tags agree."""
        self.windows: dict[int, torch.Tensor] = {}
        """Peer -> where its broadcast lands (its tag, then its payload)."""

    def wait(self) -> Any:
        if not self._works:
            return self._result  # waited for already
        watch.wait_all(self._works, op=self._op, group=self._group, last=self._issued)
        self._works = []
        # Every tag is read before anything is written: a peer's tag may sit in this rank's
        # chunk. One read of the peers' tags, as bytes (a window need not be aligned for int64).
        windows, mine = self.windows, self.mine
        peers = []
        for src in self.peers:
            peers.append(windows[src][:TAG_BYTES])
        received_tags = peers[0].unsqueeze(0) if len(peers) == 1 else torch.stack(peers)
        raw = host.read_host(received_tags)
        tags = [mine] * self.world_size
        for src, tag_bytes in zip(self.peers, raw):
            tags[src] = list(_TAG.unpack(bytes(tag_bytes)))
        if tags.count(mine) == len(tags):  # every rank sent this rank's tag
            chunk_bytes = self.chunk_bytes
            for src in self.through_buffer:
                chunk_bytes[src].copy_(windows[src][TAG_BYTES : TAG_BYTES + self.payload_bytes])
            chunk_bytes[self.rank].copy_(self.own)
        self._result = tags
        self.windows, self.own = {}, _NO_BYTES  # the receive and send buffers go with the gather
        return tags


def all_gather_tags(
    tag: Sequence[int],
    *,
    group: ProcessGroup | None,
    device: torch.device,
    stats: CommStats | None = None,
    kind: str = "control",
) -> Handle:
    """Every rank's ``tag`` (two ints) alone, by one all-gather; ``wait()`` returns them as N
    two-int lists, read on the host (it waits for the device: set-up and probes only). Its
    bytes are counted under ``kind`` in ``stats``."""
    world_size = get_world_size(group)
    if world_size == 1:
        return Handle(then=lambda: [list(tag)])
    tags = torch.empty(world_size * 2, dtype=torch.int64, device=device)
    record_traffic(stats, kind, tags, 0, world_size)
    work = compat.all_gather_single(tags, host.to_device(list(tag), torch.int64, device), group=group, async_op=True)

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


_TAG_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _tag_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for the copies of gather tags to the host."""
    if device not in _TAG_STREAMS:
        _TAG_STREAMS[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]  # torch's Stream.__new__ is unannotated
    return _TAG_STREAMS[device]


def in_place_windows(
    full: torch.Tensor, rank: int, world_size: int, payload_bytes: int, max_shard_bytes: int
) -> dict[int, torch.Tensor]:
    """The peers whose tagged message ``full`` can receive in place, each with its window (the
    16 bytes before the peer's chunk and the chunk); see [Note: tagged all-gather]."""
    if payload_bytes != max_shard_bytes or payload_bytes < TAG_BYTES:
        return {}  # a window longer than its chunk, or a tag longer than a chunk, would overlap another
    room = _room_in_front(full)
    if room is None:
        return {}
    peers = [src for src in (0, rank + 1) if src != rank and src < world_size]
    return {src: room[src * payload_bytes : (src + 1) * payload_bytes + TAG_BYTES] for src in peers}
