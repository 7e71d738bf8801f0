"""Where gradients live and which collective reduces a bucket: the reducer's three strategies.

- :class:`AllReduceStrategy` (stage 0): one full gradient buffer per bucketed parameter set in the
  reduce dtype, ``param.grad`` are views of it; each bucket is divided by N (or the
  ``gradient_divide_factor``) and all-reduced.
- :class:`ReduceScatterInPlace` (stage 1): the same full buffer; each bucket is
  reduce-scattered in place, so this rank's slice holds the averaged gradient.
- :class:`~.staged_reduce_scatter.StagedReduceScatter` (stages 2-3, in staged_reduce_scatter.py):
  no full buffer; a bucket's gradients are copied into a staging buffer from a bounded pool,
  reduce-scattered out of it into this rank's gradient shard, and the staging buffer goes
  back to the pool.

Their callers see them through the protocols here: the reducer a :class:`BucketReduction`,
the engine a :class:`GradientStore`, the master column :class:`WholeGradients` (stage 0) or
:class:`PieceGradients` (stages 1-3); a stage's row builds a :class:`ReduceStrategy`, both of
the first two.

Each turns the sum over N ranks into the mean (or the sum divided by the
``gradient_divide_factor``) as [Note: averaging] in averaging.py says; the two that
reduce-scatter share :class:`ShardedAverage` (here).

[Note: stage 1 accumulation across reductions]
Stage 1 reduce-scatters each bucket in place, so after backward the owned slice of the full
buffer holds the averaged gradient while the rest holds stale local gradients -- no extra
memory (docs/design.md's ``8Ψ + 8Ψ/N``). ``param.grad`` of the bucket's parameters is released
(it would show that mix; the optimizer reads the owned slices). A later backward before
``zero_grad`` (accumulating across reductions, or ``no_sync`` after a reduced backward)
finds ``param.grad`` None; the first new gradient of such a bucket moves the reduced slice
to a carry shard and zeroes the bucket before anything is added, and the next reduction adds
the carry back. The carry (``4Ψ/N``) exists only then and ``zero_grad`` frees it.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..comm import collectives as C
from .averaging import AcrossReplicas, Averaging, ReduceDtype, averaging_per_space, scale
from .layout import Bucket, ShardPiece
from .param_guard import metadata_only
from .rebuild import Relayout
from .reducer import BucketedParams, GradBucket


class BucketReduction(Protocol):
    """What the reducer (reducer.py) calls on its strategy: per bucket, as gradients arrive and
    buckets launch and finish, and when gradients are cleared."""

    max_in_flight: int | None
    """How many reductions may be outstanding (None: no bound)."""
    copies_each_gradient: bool
    """Whether ``accept_grad`` copies each gradient into a staging bucket and releases
    ``.grad`` (stages 2-3), so that the reducer may take an arrival with that one call
    (``GradientReducer.arrived_staged``)."""

    def in_place_views(self) -> dict[str, torch.Tensor]: ...
    def grads_into_buffer(self, buckets: Sequence[GradBucket]) -> None: ...
    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None: ...
    def accumulate_no_sync(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None: ...
    def accept_again(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None: ...
    def late_buffer(self, bucket: GradBucket) -> torch.Tensor: ...
    def start_late(self, bucket: GradBucket, late: torch.Tensor) -> C.Handle: ...
    def finish_late(self, bucket: GradBucket, late: torch.Tensor) -> None: ...
    def fill_missing(self, bucket: GradBucket) -> None: ...
    def start(self, bucket: GradBucket) -> C.Handle: ...
    def finish(self, bucket: GradBucket) -> None: ...
    def after_sync_backward(self, buckets: Sequence[GradBucket]) -> None: ...
    def clear(self) -> None: ...
    def clear_params(self, names: set[str], set_to_none: bool = True) -> None: ...
    def release_unused(self, names: set[str]) -> None: ...


class GradientStore(Protocol):
    """What the engine asks of the reduced gradients for the optimizer, clipping, memory and
    comm reports, and the bucket rebuild (which moves them to the new layout)."""

    collective: str
    """The collective that reduces a bucket (``comm_stats()``'s kind)."""
    full_grads_on_params: bool
    """Whether ``param.grad`` holds the whole reduced gradient after a synchronising backward."""
    peak_staging_bytes: int

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]: ...
    def owned_grad_pieces(self) -> list[torch.Tensor]: ...
    def grad_bytes(self) -> int: ...
    def workspace_bytes(self) -> int: ...
    def relayout(self, moves: dict[BucketedParams, Relayout]) -> None: ...


class ReduceStrategy(BucketReduction, GradientStore, Protocol):
    """A stage's strategy as its row builds it and the engine holds it: the reducer's side and
    the engine's."""


@runtime_checkable
class WholeGradients(Protocol):
    """What stage 0's master column (core/masters.py) asks: each parameter's whole reduced
    gradient in the master dtype, the one the optimizer reads."""

    def master_grad(self, space: BucketedParams, name: str) -> torch.Tensor: ...


@runtime_checkable
class PieceGradients(Protocol):
    """What the sharded masters (stages 1-2's master column, stage 3's storage) ask: the reduced
    gradient of one of this rank's pieces, in the master dtype (1-D)."""

    def piece_grad(self, space: BucketedParams, piece: ShardPiece) -> torch.Tensor: ...


def zero_pieces(space: BucketedParams, rank: int, names: set[str], shards: torch.Tensor) -> None:
    """Zero the elements of ``names`` in ``shards`` (this rank's slices of ``space``, local layout)."""
    for piece in space.layout.pieces(rank):
        if piece.name in names:
            piece.local_range.of(shards).zero_()


IN_PLACE_MAX_NUMEL = {"cpu": 4096}
"""Per device type, the largest parameter whose gradient accumulates into its bucket view in
place ([Note: gradients accumulate in the buffer] in reducer.py); other device types: 2**20.
In place, a gradient costs the host one short hook call instead of a copy and the full path
(about 5 µs on a CPU core), and the memory two more passes (the view zeroed, then read by the
add) than the copy. On a CPU core (about 10 GB/s) the two are even near 4096 fp32 elements:
mlp:large's weights of 1,048,576 elements were 3-7% slower in place (docs/benchmarks.md). On a GPU
(several TB/s) the passes over 2**20 elements take about 2 µs of device time, while the host's
time per tensor is what a small model waits for: an estimate from bandwidth, not measured here."""


def accumulates_in_place(view: torch.Tensor) -> bool:
    """Whether the gradient that ``view`` (its slot in the buffer) holds is small enough to
    accumulate there in place (IN_PLACE_MAX_NUMEL). Asked of the view, not the parameter,
    which at stage 1 may be guarded until its gather completes."""
    return view.numel() <= IN_PLACE_MAX_NUMEL.get(view.device.type, 1 << 20)


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` together."""
    return sum(t.numel() * t.element_size() for t in tensors)


_grad_of = operator.attrgetter("grad")


def _all_none(grads: list[torch.Tensor | None]) -> bool:
    """Whether every one of ``grads`` is None (by identity, in C: no ``Tensor.__eq__``)."""
    return all(map(operator.is_, grads, repeat(None)))


def _point_grads(params: Iterable[nn.Parameter], grads: Iterable[torch.Tensor]) -> None:
    """``param.grad = grad`` for each pair (inside :func:`~.param_guard.metadata_only` where
    parameters may be guarded). A plain loop: ``map(setattr, ...)`` drained in C is no faster,
    the setter's own checks being most of the cost."""
    for param, grad in zip(params, grads):
        param.grad = grad


class _BucketViews:
    """One bucket's parameters and their views in the full buffer, listed once per layout: what
    the loops that put views on ``.grad`` read (before a synchronising backward, and after it at
    stage 0), each a few C-level passes over these lists instead of a Python loop with a dict
    look-up per parameter ([Note: the host's share of a step] in engines/hooks.py)."""

    __slots__ = ("same_dtype", "in_place", "span")

    def __init__(
        self,
        bucket: GradBucket,
        views: dict[str, torch.Tensor],
        in_place: dict[str, torch.Tensor],
        grad_buffer: torch.Tensor,
    ) -> None:
        same = [(param, views[name]) for name, param in bucket.members if views[name].dtype == param.dtype]
        self.same_dtype = ([param for param, _ in same], [view for _, view in same])
        """The parameters whose view can be their ``.grad`` (of their dtype), and the views."""
        pairs = [(param, in_place[name]) for name, param in bucket.members if name in in_place]
        self.in_place = ([param for param, _ in pairs], [view for _, view in pairs])
        """The parameters whose gradients autograd accumulates into their views, and the views."""
        self.span = bucket.spec.range.of(grad_buffer) if len(pairs) == len(bucket.members) else None
        """The bucket's whole range of the buffer where every parameter of it accumulates in
        place (None otherwise): zeroed by one op instead of one per view (gaps and padding
        hold zeros anyway)."""


class _FullGradBuffer:
    """Stages 0-1: one full gradient buffer per space in the reduce dtype. When that is the
    parameters' dtype, ``param.grad`` are views into it (autograd accumulates in place);
    otherwise each finished gradient is added into it and ``param.grad`` is released."""

    full_grads_on_params: bool
    copies_each_gradient = False  # the common arrival is in its view already (arrived_in_place)
    peak_staging_bytes = 0
    """Stages 0-1 stage nothing: the full buffer is reduced in place."""

    def __init__(self, spaces: Sequence[BucketedParams], reduce_dtype: ReduceDtype) -> None:
        self.spaces = list(spaces)
        self.grad_buffers = {s: torch.zeros(s.layout.numel, dtype=reduce_dtype(s), device=s.device) for s in spaces}
        # .grad stays None until a backward gives the parameter a gradient, as in plain torch
        # (accept_grad points it at its view then).
        self.views = {name: s.layout.view(self.grad_buffers[s], name) for s in spaces for name in s.params}
        self._in_place: dict[str, torch.Tensor] | None = None
        """:meth:`in_place_views`, once per layout."""
        self._bucket_views: dict[GradBucket, _BucketViews] = {}
        """Per bucket, its parameters and views (:meth:`_views_of`), once per layout (emptied
        when the layout changes, before the reducer makes new bucket objects)."""

    def _views_of(self, bucket: GradBucket) -> _BucketViews:
        listed = self._bucket_views.get(bucket)
        if listed is None:
            if self._in_place is None:
                self._in_place = self.in_place_views()
            listed = _BucketViews(bucket, self.views, self._in_place, self.grad_buffers[bucket.space])
            self._bucket_views[bucket] = listed
        return listed

    def in_place_views(self) -> dict[str, torch.Tensor]:
        """The views that autograd accumulates into in place once :meth:`grads_into_buffer`
        made them ``.grad``: those of the small gradients (:func:`accumulates_in_place`) whose
        dtype is the buffer's."""
        return {
            name: self.views[name]
            for space in self.spaces
            if self.grad_buffers[space].dtype == space.compute_dtype
            for name in space.params
            if accumulates_in_place(self.views[name])
        }

    def grads_into_buffer(self, buckets: Sequence[GradBucket]) -> None:
        """At the start of every backward after the first synchronising one, each parameter of
        :meth:`in_place_views` without a gradient gets its view, zeroed, as ``.grad``: see
        [Note: gradients accumulate in the buffer] in reducer.py. A bucket that holds reduced
        gradients (stage 1's, kept for accumulation across reductions) is left as it is: its
        first gradient carries them aside (accept_grad)."""
        partly: list[tuple[nn.Parameter, torch.Tensor]] = []
        with metadata_only():  # stage 1's parameters may be guarded here (a gather pending)
            for bucket in buckets:
                if bucket.reduced:
                    continue
                listed = self._views_of(bucket)
                params, views = listed.in_place
                grads = list(map(_grad_of, params))
                if listed.span is not None and _all_none(grads):
                    listed.span.zero_()  # the common case after zero_grad: the bucket at once
                    _point_grads(params, views)
                else:  # an accumulation over backward passes keeps what .grad holds
                    partly += [(param, view) for param, view, grad in zip(params, views, grads) if grad is None]
            if partly:
                torch._foreach_zero_([view for _, view in partly])
                _point_grads([param for param, _ in partly], [view for _, view in partly])

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        assert param.grad is not None  # called from its post-accumulate-grad hook: the gradient is there
        view = self.views[name]
        if param.grad is view:
            return  # autograd added it into the buffer in place: see grads_into_buffer
        if view.dtype == param.dtype:
            # .grad was not the view when autograd accumulated (the gradient arrived after its
            # bucket launched, or before grads_into_buffer ran, or under create_graph, where
            # autograd accumulates out of place): take its value and point .grad back at the buffer.
            view.copy_(param.grad)
            param.grad = view
        else:
            view.add_(param.grad)  # low-precision gradient into the reduce-dtype buffer
            param.grad = None

    accumulate_no_sync = accept_grad

    def accept_again(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        """A second gradient of this backward before the bucket launched (see [Note: a gradient
        that arrives twice] in reducer.py): autograd added it into the view in place, or it is
        added here."""
        assert param.grad is not None  # called from its post-accumulate-grad hook
        view = self.views[name]
        if param.grad is view:
            return
        view.add_(param.grad)
        param.grad = view if view.dtype == param.dtype else None

    def late_buffer(self, bucket: GradBucket) -> torch.Tensor:
        data = self.grad_buffers[bucket.space]
        return torch.zeros(bucket.spec.range.size, dtype=data.dtype, device=data.device)

    def _take_views_off(self, bucket: GradBucket) -> None:
        """Launching: a late gradient must not be added into the buffer being reduced (see
        [Note: a gradient that arrives twice] in reducer.py)."""
        views = self.views
        for name, param in bucket.members:
            if param.grad is views[name]:
                param.grad = None

    def fill_missing(self, bucket: GradBucket) -> None:
        """Parameters that got no gradient this backward contribute zeros (or what they
        accumulated earlier, e.g. under no_sync)."""
        params = bucket.params
        for name in bucket.missing:
            param = params[name]
            view = self.views[name]
            if view.dtype != param.dtype:
                if param.grad is not None:
                    self.accept_grad(bucket, name, param)
            elif param.grad is None:
                view.zero_()
                param.grad = view
            elif param.grad is not view:
                self.accept_grad(bucket, name, param)

    def clear(self) -> None:
        # As torch's zero_grad(set_to_none=True): no memset here. The next synchronising
        # backward zeroes the small gradients' views as it points .grad at them
        # (grads_into_buffer); the others are copied over the stale values (accept_grad), and
        # those that get none are zeroed (fill_missing). Only a buffer that accumulates by add_
        # (reduce dtype differs from the parameters') is zeroed now.
        for space, grad in self.grad_buffers.items():
            if grad.dtype != space.compute_dtype:
                grad.zero_()
            with metadata_only():  # stage 1's parameters may be guarded here (a gather pending)
                for param in space.params.values():
                    param.grad = None

    def clear_params(self, names: set[str], set_to_none: bool = True) -> None:
        """``zero_grad`` of some parameters only (an optimizer over part of the model; see
        [Note: zero_grad of some parameters] in reducer.py): their gradients become zero and
        ``.grad`` None (``set_to_none=False`` at stage 0: the zeroed view, as torch keeps a
        zeroed ``.grad``); every other parameter keeps what it holds."""
        keep_view = not set_to_none and self.full_grads_on_params
        for space in self.spaces:
            for name, param in space.params.items():
                if name in names:
                    view = self.views[name]
                    view.zero_()
                    param.grad = view if keep_view and view.dtype == param.dtype else None

    def after_sync_backward(self, buckets: Sequence[GradBucket]) -> None:
        pass

    def _relayout_buffer(self, space: BucketedParams, data: torch.Tensor) -> None:
        """``data`` (the space's gradient buffer in its new layout) replaces the old one;
        a ``param.grad`` that was a view of the old buffer becomes the same view of the new."""
        old_views = {name: self.views[name] for name in space.params}
        self.grad_buffers[space] = data
        self._in_place = None
        self._bucket_views = {}
        for name, param in space.params.items():
            self.views[name] = space.layout.view(data, name)
            if param.grad is old_views[name]:
                param.grad = self.views[name]


class AllReduceStrategy(_FullGradBuffer):
    """Stage 0."""

    max_in_flight: int | None = None
    collective = "all_reduce"
    full_grads_on_params = True
    """Whether ``param.grad`` holds the whole reduced gradient after a synchronising backward
    (else see [Note: no full gradients at stages 1-3] in core/grad_placeholders.py)."""

    def __init__(
        self,
        spaces: Sequence[BucketedParams],
        reduce_dtype: ReduceDtype,
        world_size: int,
        group: Any,
        comm: C.CommStats,
        divide_factor: float | None = None,
    ) -> None:
        super().__init__(spaces, reduce_dtype)
        self.world_size, self.group, self.comm = world_size, group, comm
        self.averaging_of = averaging_per_space(
            spaces, reduce_dtype, world_size, group, divide_before=True, divide_factor=divide_factor
        )
        # What the optimizer reads: reduced gradients in the master dtype.
        self.master_grads = {
            s: g if g.dtype == s.master_dtype else torch.zeros_like(g, dtype=s.master_dtype)
            for s, g in self.grad_buffers.items()
        }

    def start(self, bucket: GradBucket) -> C.Handle:
        self._take_views_off(bucket)
        return self.start_late(bucket, bucket.spec.range.of(self.grad_buffers[bucket.space]))

    def finish(self, bucket: GradBucket) -> None:
        scale(bucket.spec.range.of(self.grad_buffers[bucket.space]), self.averaging_of[bucket.space].after)
        self._copy_to_master(bucket)

    def start_late(self, bucket: GradBucket, data: torch.Tensor) -> C.Handle:
        plan = self.averaging_of[bucket.space]
        scale(data, plan.before)
        return C.all_reduce(
            data, group=self.group, async_op=True, stats=self.comm, padding_numel=bucket.spec.padding, op=plan.op
        )

    def finish_late(self, bucket: GradBucket, late: torch.Tensor) -> None:
        scale(late, self.averaging_of[bucket.space].after)
        bucket.spec.range.of(self.grad_buffers[bucket.space]).add_(late)
        self._copy_to_master(bucket)

    def _copy_to_master(self, bucket: GradBucket) -> None:
        master = self.master_grads[bucket.space]
        if master is not self.grad_buffers[bucket.space]:
            bucket.spec.range.of(master).copy_(bucket.spec.range.of(self.grad_buffers[bucket.space]))

    def after_sync_backward(self, buckets: Sequence[GradBucket]) -> None:
        """``.grad`` is the buffer's view again once nothing more can arrive (see _take_views_off)."""
        for bucket in buckets:
            params, views = self._views_of(bucket).same_dtype
            grads = list(map(_grad_of, params))
            if _all_none(grads):  # the common case: every view was taken off at launch
                _point_grads(params, views)
                continue
            for param, view, grad in zip(params, views, grads):
                if grad is None:
                    param.grad = view

    def release_unused(self, names: set[str]) -> None:
        for space in self.spaces:
            for name, param in space.params.items():
                if name in names:
                    param.grad = None

    def clear_params(self, names: set[str], set_to_none: bool = True) -> None:
        super().clear_params(names, set_to_none)
        for space, master in self.master_grads.items():
            if master is not self.grad_buffers[space]:
                for name in names & space.params.keys():
                    space.layout.view(master, name).zero_()

    def relayout(self, moves: dict[BucketedParams, Relayout]) -> None:
        """See [Note: bucket rebuild]: reduced gradients are complete on every rank."""
        for space, move in moves.items():
            shared = self.master_grads[space] is self.grad_buffers[space]
            self._relayout_buffer(space, move.full(self.grad_buffers[space]))
            self.master_grads[space] = self.grad_buffers[space] if shared else move.full(self.master_grads[space])

    def master_grad(self, space: BucketedParams, name: str) -> torch.Tensor:
        return space.layout.view(self.master_grads[space], name)

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        return list(self.master_grads.values()), False

    def owned_grad_pieces(self) -> list[torch.Tensor]:
        """Every parameter's reduced gradient in registration order: what a norm is taken over
        ([Note: a norm per piece] in core/clipping.py)."""
        return [self.master_grad(space, name) for space in self.spaces for name in space.params]

    def grad_bytes(self) -> int:
        extra = [g for s, g in self.master_grads.items() if g is not self.grad_buffers[s]]
        return nbytes(list(self.grad_buffers.values()) + extra)

    def workspace_bytes(self) -> int:
        return 0


class ShardedAverage:
    """What stages 1-3 share: which slice is this rank's, and [Note: averaging] after a
    reduce-scatter."""

    world_size: int
    rank: int
    group: Any
    comm: C.CommStats
    spaces: list[BucketedParams]
    averaging_of: dict[BucketedParams, Averaging]
    replicas: AcrossReplicas | None = None
    """Hybrid sharding: the replica group's all-reduce after each reduce-scatter ([Note:
    reduction under hybrid sharding] in averaging.py); None under full sharding."""
    collective = "reduce_scatter"

    def _set_up_sharding(
        self,
        spaces: Sequence[BucketedParams],
        reduce_dtype: ReduceDtype,
        world_size: int,
        rank: int,
        group: Any,
        comm: C.CommStats,
        replicas: AcrossReplicas | None,
        ranks_summed: int | None,
        divide_factor: float | None,
    ) -> None:
        """The shard group, this rank's place in it, the replicas and each space's averaging:
        ``ranks_summed`` ranks' gradients in all (the world size; under hybrid sharding more
        than the shard group's), divided by ``divide_factor`` ([Note: averaging])."""
        self.spaces = list(spaces)
        self.reduce_dtype = reduce_dtype
        self.world_size, self.rank, self.group, self.comm = world_size, rank, group, comm
        self.replicas = replicas
        self.averaging_of = averaging_per_space(
            spaces, reduce_dtype, ranks_summed or world_size, group, divide_before=False, divide_factor=divide_factor
        )
        self._reduce_scatters: dict[int, tuple[Bucket, C.ReduceScatterPlan]] = {}
        """Bucket position -> (the layout bucket, its reduce-scatter's plan): see :meth:`reduce_scatter`."""

    def reduce_scatter(self, bucket: GradBucket, owned: torch.Tensor, data: torch.Tensor) -> C.Handle:
        """Start ``bucket``'s reduce-scatter of ``data`` (bucket-sized) into ``owned`` (this
        rank's slice), by a plan made once per layout bucket (``C.ReduceScatterPlan``)."""
        made = self._reduce_scatters.get(bucket.position)
        if made is None or made[0] is not bucket.spec:
            plan = C.ReduceScatterPlan(
                data,
                group=self.group,
                stats=self.comm,
                padding_numel=bucket.spec.padding,
                op=self.averaging_of[bucket.space].op,
            )
            made = self._reduce_scatters[bucket.position] = (bucket.spec, plan)
        return made[1].start(owned, data)

    def sum_replicas(self, bucket: GradBucket, owned: torch.Tensor) -> None:
        """After ``bucket``'s reduce-scatter: its owned slice summed across replicas, if any."""
        if self.replicas is not None:
            self.replicas.sum_(owned, bucket.spec, self.averaging_of[bucket.space].op)

    def piece_grad(self, space: BucketedParams, piece: ShardPiece) -> torch.Tensor:
        raise NotImplementedError

    def owned_grad_pieces(self) -> list[torch.Tensor]:
        """This rank's reduced gradient of every piece it owns, in buffer order: what a norm is
        taken over ([Note: a norm per piece] in core/clipping.py)."""
        return [self.piece_grad(space, piece) for space in self.spaces for piece in space.layout.pieces(self.rank)]

    def owned_in_space(self, spec: Bucket, space_buffer: torch.Tensor) -> torch.Tensor:
        """This rank's slice of bucket ``spec`` in a buffer indexed like the whole space."""
        return spec.shard(self.rank).of(space_buffer)

    def owned_in_staging(self, bucket: GradBucket, staging: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``bucket`` in its staging buffer (indexed from the bucket start)."""
        return bucket.spec.shard_in_bucket(self.rank).of(staging)

    def start_late(self, bucket: GradBucket, late: torch.Tensor) -> C.Handle:
        """Reduce-scatter a bucket-sized buffer: the late gradients of [Note: a gradient that
        arrives twice] in reducer.py (zeros for every other parameter)."""
        plan = self.averaging_of[bucket.space]
        scale(late, plan.before)
        return C.reduce_scatter(
            self.owned_in_staging(bucket, late),
            late,
            group=self.group,
            async_op=True,
            stats=self.comm,
            padding_numel=bucket.spec.padding,
            op=plan.op,
        )

    def _reduced_late(self, bucket: GradBucket, late: torch.Tensor) -> torch.Tensor:
        owned = self.owned_in_staging(bucket, late)
        self.sum_replicas(bucket, owned)
        scale(owned, self.averaging_of[bucket.space].after)
        return owned


class ReduceScatterInPlace(_FullGradBuffer, ShardedAverage):
    """Stage 1; see [Note: stage 1 accumulation across reductions]."""

    max_in_flight: int | None = None
    full_grads_on_params = False

    def __init__(
        self,
        spaces: Sequence[BucketedParams],
        reduce_dtype: ReduceDtype,
        world_size: int,
        rank: int,
        group: Any,
        comm: C.CommStats,
        replicas: AcrossReplicas | None = None,
        ranks_summed: int | None = None,
        divide_factor: float | None = None,
    ) -> None:
        _FullGradBuffer.__init__(self, spaces, reduce_dtype)
        self._set_up_sharding(
            spaces, reduce_dtype, world_size, rank, group, comm, replicas, ranks_summed, divide_factor
        )
        self.master_grad_shards = {
            s: torch.zeros(s.layout.shard_numel, dtype=s.master_dtype, device=s.device)
            for s, g in self.grad_buffers.items()
            if g.dtype != s.master_dtype
        }
        self._carry: dict[BucketedParams, torch.Tensor] | None = None

    def start(self, bucket: GradBucket) -> C.Handle:
        self._take_views_off(bucket)
        data = bucket.spec.range.of(self.grad_buffers[bucket.space])
        scale(data, self.averaging_of[bucket.space].before)
        return self.reduce_scatter(bucket, self.owned_in_space(bucket.spec, self.grad_buffers[bucket.space]), data)

    def finish_late(self, bucket: GradBucket, late: torch.Tensor) -> None:
        space = bucket.space
        reduced = self.owned_in_space(bucket.spec, self.grad_buffers[space])
        reduced.add_(self._reduced_late(bucket, late))
        if space in self.master_grad_shards:
            space.layout.shard_of(bucket.spec, self.master_grad_shards[space]).copy_(reduced)

    def finish(self, bucket: GradBucket) -> None:
        space = bucket.space
        reduced = self.owned_in_space(bucket.spec, self.grad_buffers[space])
        self.sum_replicas(bucket, reduced)
        scale(reduced, self.averaging_of[space].after)
        if self._carry is not None:
            carried = space.layout.shard_of(bucket.spec, self._carry[space])
            reduced.add_(carried)
            carried.zero_()
        if space in self.master_grad_shards:
            space.layout.shard_of(bucket.spec, self.master_grad_shards[space]).copy_(reduced)
        bucket.reduced = True
        for _, param in bucket.members:  # see [Note: stage 1 accumulation across reductions]
            param.grad = None

    def _carry_reduced(self, bucket: GradBucket) -> None:
        if self._carry is None:
            self._carry = {
                s: torch.zeros(s.layout.shard_numel, dtype=g.dtype, device=s.device)
                for s, g in self.grad_buffers.items()
            }
        space = bucket.space
        space.layout.shard_of(bucket.spec, self._carry[space]).add_(
            self.owned_in_space(bucket.spec, self.grad_buffers[space])
        )
        bucket.spec.range.of(self.grad_buffers[space]).zero_()
        bucket.reduced = False

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        if bucket.reduced:
            self._carry_reduced(bucket)
        _FullGradBuffer.accept_grad(self, bucket, name, param)

    accumulate_no_sync = accept_grad

    def fill_missing(self, bucket: GradBucket) -> None:
        if bucket.reduced:
            self._carry_reduced(bucket)
        _FullGradBuffer.fill_missing(self, bucket)

    def clear(self) -> None:
        _FullGradBuffer.clear(self)
        self._carry = None

    def clear_params(self, names: set[str], set_to_none: bool = True) -> None:
        _FullGradBuffer.clear_params(self, names, set_to_none)  # the owned slices of the buffer included
        for space in self.spaces:
            carry = self._carry[space] if self._carry is not None else None
            for shards in (self.master_grad_shards.get(space), carry):
                if shards is not None:
                    zero_pieces(space, self.rank, names, shards)

    def release_unused(self, names: set[str]) -> None:
        """The optimizer skips them (see ShardedOptimizer); nothing to release here."""

    def relayout(self, moves: dict[BucketedParams, Relayout]) -> None:
        """See [Note: bucket rebuild]: only the owned slices hold reduced gradients; the carry
        is all zeros after a reduction (added back bucket by bucket). Where a master-dtype copy
        of them exists, only it crosses ranks: the owned slices are that copy cast back (exact,
        it was cast from them)."""
        for space, move in moves.items():
            if space in self.master_grad_shards:
                master = self.master_grad_shards[space] = move.local(self.master_grad_shards[space])
                data = torch.zeros(move.new.numel, dtype=self.grad_buffers[space].dtype, device=space.device)
                for spec in move.new.buckets:
                    self.owned_in_space(spec, data).copy_(move.new.shard_of(spec, master))
            else:
                data = move.owned(self.grad_buffers[space])
            self._relayout_buffer(space, data)
            if self._carry is not None:
                assert not self._carry[space].any(), "a carry still holds gradients"
                self._carry[space] = self._carry[space].new_zeros(move.new.shard_numel)

    def piece_grad(self, space: BucketedParams, piece: ShardPiece) -> torch.Tensor:
        if space in self.master_grad_shards:
            return piece.local_range.of(self.master_grad_shards[space])
        return piece.buffer_range.of(self.grad_buffers[space])

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        if self.master_grad_shards:
            return list(self.master_grad_shards.values()), True
        return [self.owned_in_space(spec, self.grad_buffers[s]) for s in self.spaces for spec in s.layout.buckets], True

    def grad_bytes(self) -> int:
        tensors = list(self.grad_buffers.values()) + list(self.master_grad_shards.values())
        if self._carry is not None:
            tensors += list(self._carry.values())
        return nbytes(tensors)

    def workspace_bytes(self) -> int:
        return 0
