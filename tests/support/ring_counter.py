"""A byte counter around ``torch.distributed``'s collectives, the oracle of ``comm_stats()``
(issue #32, item 15; tests/test_comm_stats.py).

It wraps the functions of ``torch.distributed`` (and the references shardpar's ``compat``
took of them at import), records every collective a rank issues with the bytes of the
tensors it passes, and prices each under the ring model that [Note: byte accounting] in
``shardpar/comm/comm_stats.py`` states, for a collective over S bytes on N ranks:

    all_reduce                   2·S·(N-1)/N
    reduce_scatter               S·(N-1)/N   (S: the full input)
    all_gather                   S·(N-1)/N   (S: the full output; a list output: its sum)
    all_to_all                   S·(N-1)/N   (S: the input; what leaves the rank)
    broadcast                    S·(N-1)/N   (S: the bytes the *source* sends)
    barrier                      0

Only the innermost call counts (``all_gather_object`` is its ``all_gather`` calls, a
deprecated alias the function it forwards to). The multiplier and S are kept apart, as
integers (``factor·S`` summed), so comparisons are exact; ``sent_bytes`` multiplies by
(N-1)/N once.

A broadcast's receivers may post a larger buffer than the source sends (gloo's tagged
gathers receive into buffers sized for the largest shard: [Note: tagged all-gather]), so
the bytes of a broadcast are the source's: :meth:`RingCounter.resolve` exchanges the ranks'
logs (after the counted region, with ``all_gather_object``) and takes each broadcast's
size from its source, matching calls by process group and order within it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from shardpar.comm import compat

FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "all_to_all": 1, "broadcast": 1, "barrier": 0}


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _group_name(group: Any) -> str:
    """A process group's name, the same on every rank (ranks alone would not tell stage 3's
    two groups over the same ranks apart)."""
    name = getattr(group, "group_name", None)
    return name if name is not None else c10d._get_process_group_name(group)


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[index] if len(args) > index else None


# name -> (kind, bytes of the call from its arguments)
_SIZES: dict[str, tuple[str, Callable[[tuple, dict], int]]] = {
    "all_reduce": ("all_reduce", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "reduce_scatter_single": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "reduce_scatter": ("reduce_scatter", lambda a, k: sum(map(_nbytes, _arg(a, k, 1, "input_list")))),
    "all_gather_single": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor"))),
    "all_gather_into_tensor": ("all_gather", lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor"))),
    "all_gather": ("all_gather", lambda a, k: sum(map(_nbytes, _arg(a, k, 0, "tensor_list")))),
    "all_to_all_single": ("all_to_all", lambda a, k: _nbytes(_arg(a, k, 1, "input"))),
    "broadcast": ("broadcast", lambda a, k: _nbytes(_arg(a, k, 0, "tensor"))),
    "barrier": ("barrier", lambda a, k: 0),
}
_WRAPPED = (
    *_SIZES,
    "all_gather_object",
    "broadcast_object_list",
    "all_reduce_coalesced",
    "all_gather_coalesced",
    "all_to_all",
    "gather",
    "scatter",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "monitored_barrier",
)
"""Everything wrapped: the calls priced above, and the rest, which a test expects none of
(they raise from :meth:`RingCounter.resolve`) or which count through the calls inside them."""


@dataclass
class Call:
    """One collective as this rank issued it."""

    name: str
    group: str
    """The process group's name: the same on every rank for the same group."""
    local_bytes: int
    source: int | None = None
    """A broadcast's source (a group rank); None otherwise."""
    is_source: bool = False


@dataclass
class RingCounter:
    """Records the collectives of this rank while :meth:`counting` is active."""

    calls: list[Call] = field(default_factory=list)
    _depth: threading.local = field(default_factory=threading.local)

    @contextlib.contextmanager
    def counting(self) -> Iterator[RingCounter]:
        patched: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, replacement: Any) -> None:
            patched.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)

        wrappers: dict[Any, Any] = {}
        for name in _WRAPPED:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrappers[original] = wrapper = self._wrap(name, original)
            patch(c10d, name, wrapper)
            if getattr(dist, name, None) is original:
                patch(dist, name, wrapper)
        for bound in ("_REDUCE_SCATTER", "_ALL_GATHER"):  # compat took them at import
            if getattr(compat, bound, None) in wrappers:
                patch(compat, bound, wrappers[getattr(compat, bound)])
        try:
            yield self
        finally:
            for owner, name, original in reversed(patched):
                setattr(owner, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            frames = self._frames()
            if frames:
                frames[-1]["nested"] = True  # the outer call counts through this one
            frame = {"nested": False}
            frames.append(frame)
            try:
                result = original(*args, **kwargs)
            finally:
                frames.pop()
            if not frame["nested"]:
                self.calls.append(self._describe(name, args, kwargs))
            return result

        return counted

    def _frames(self) -> list[dict[str, bool]]:
        if not hasattr(self._depth, "frames"):
            self._depth.frames = []
        return self._depth.frames

    @staticmethod
    def _describe(name: str, args: tuple, kwargs: dict) -> Call:
        group = kwargs.get("group")
        if group is None and name in ("broadcast", "all_reduce") and len(args) > 2:
            group = args[2]
        group = group if group is not None else dist.group.WORLD
        call = Call(name, _group_name(group), 0)
        if name not in _SIZES:
            return call
        call.local_bytes = _SIZES[name][1](args, kwargs)
        if name == "broadcast":
            if kwargs.get("group_src") is not None:
                call.source = kwargs["group_src"]
            else:
                src = kwargs.get("src", args[1] if len(args) > 1 else None)
                call.source = dist.get_group_rank(group, src)
            call.is_source = dist.get_rank(group) == call.source
        return call

    def resolve(self, world_size: int) -> RingBytes:
        """Every rank's calls exchanged (a collective: call on every rank, outside
        :meth:`counting`), each priced by the ring model; broadcasts by their source's size."""
        logs: list[list[Call] | None] = [None] * world_size
        dist.all_gather_object(logs, self.calls)
        unpriced = sorted({c.name for log in logs for c in log if c.name not in _SIZES})  # type: ignore[union-attr]
        if unpriced:
            raise AssertionError(f"collectives the ring model here does not price: {unpriced}")
        per_group: dict[str, list[list[Call]]] = {}
        for log in logs:
            groups: dict[str, list[Call]] = {}
            for call in log:  # type: ignore[union-attr]
                groups.setdefault(call.group, []).append(call)
            for name, calls in groups.items():
                per_group.setdefault(name, []).append(calls)
        source_bytes: dict[tuple[str, int], int] = {}
        for name, ranks in per_group.items():
            assert len({len(calls) for calls in ranks}) == 1, f"ranks issued different numbers of calls on {name}"
            for index, same_call in enumerate(zip(*ranks)):
                assert len({c.name for c in same_call}) == 1, f"call {index} on {name} differs across ranks"
                if same_call[0].name == "broadcast":
                    source_bytes[(name, index)] = next(c.local_bytes for c in same_call if c.is_source)
        out = RingBytes(world_size)
        seen: dict[str, int] = {}
        for call in self.calls:
            index = seen[call.group] = seen.get(call.group, -1) + 1
            kind = _SIZES[call.name][0]
            size = source_bytes[(call.group, index)] if kind == "broadcast" else call.local_bytes
            out.add(kind, size)
        return out


@dataclass
class RingBytes:
    """Per kind: calls and ``factor·S`` summed (integers)."""

    world_size: int
    calls: dict[str, int] = field(default_factory=dict)
    weighted: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, size: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.weighted[kind] = self.weighted.get(kind, 0) + FACTOR[kind] * size

    @property
    def total_weighted(self) -> int:
        return sum(self.weighted.values())

    @property
    def sent_bytes(self) -> float:
        return self.total_weighted * (self.world_size - 1) / self.world_size
