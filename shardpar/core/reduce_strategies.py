"""Where gradients live and which collective reduces a bucket: the reducer's three strategies.

- :class:`AllReduceStrategy` (stage 0): one full gradient buffer per parameter space in the
  reduce dtype, ``param.grad`` are views of it; each bucket is divided by N and all-reduced.
- :class:`ReduceScatterInPlace` (stage 1): the same full buffer; each bucket is
  reduce-scattered in place, so this rank's slice holds the averaged gradient.
- :class:`StagedReduceScatter` (stages 2-3): no full buffer; a bucket's gradients are copied
  into a staging buffer from a bounded pool, reduce-scattered out of it into this rank's
  gradient shard, and the staging buffer goes back to the pool.

[Note: averaging]
Every strategy turns the sum over N ranks into DDP's mean, with as few passes as it can
(:func:`averaging` picks the factors, once per parameter space):

- A backend that averages inside the collective (NCCL's ``ReduceOp.AVG``) does it all: no
  pass of ours.
- Otherwise (gloo) stage 0 divides the whole bucket before its all-reduce, and stages 1-3
  divide only the owned 1/N after the reduce-scatter ((N-1)/N of a pass saved).
- An fp16 reduce dtype is split around the sum, on every backend: the bucket is divided by
  the power of two at or above √N before (exact), and by the rest of N after. Dividing by N
  first would flush gradients below N times fp16's smallest subnormal to zero; dividing
  after would let a sum of N large gradients overflow. The split halves the exponent range
  each side gives up (N = 4: ÷2, sum, ÷2).

[Note: stage 1 accumulation across reductions]
Stage 1 reduce-scatters each bucket in place, so after backward the owned slice of the full
buffer holds the averaged gradient while the rest holds stale local gradients -- no extra
memory (DESIGN.md's ``8Ψ + 8Ψ/N``). ``param.grad`` of the bucket's parameters is released
(it would show that mix; the optimizer reads the owned slices). A later backward before
``zero_grad`` (accumulating across reductions, or ``no_sync`` after a reduced backward)
finds ``param.grad`` None; the first new gradient of such a bucket moves the reduced slice
to a carry shard and zeroes the bucket before anything is added, and the next reduction adds
the carry back. The carry (``4Ψ/N``) exists only then and ``zero_grad`` frees it.

[Note: no_sync at stages 2-3]
Inside ``no_sync()`` nothing is reduced, so gradients must be kept in full. They are added,
as each becomes final, into a full-size accumulation buffer per parameter space in the
*reduce* dtype (as stages 0-1 accumulate in their full buffer), and ``param.grad`` is
released; the synchronising backward stages "accumulated + new" and reduces it, after which
the accumulation buffer is freed. Its bytes are what gradient accumulation costs at these
stages (``memory_stats()["grads"]`` counts them while they exist).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from ..comm import collectives as C
from .layout import Bucket, ShardPiece
from .param_guard import metadata_only
from .rebuild import Relayout
from .reducer import GradBucket, ParamSpace

ReduceDtype = Callable[[ParamSpace], torch.dtype]


@dataclass(frozen=True)
class Averaging:
    """How one bucket's sum over N ranks becomes the mean; see [Note: averaging]."""

    before: float = 1.0
    """Factor applied to the bucket before the collective (1.0: no pass)."""
    after: float = 1.0
    """Factor applied to the result after it (1.0: no pass)."""
    op: str = "sum"
    """The collective's reduction: ``avg`` where the backend divides by N itself."""


def averaging(dtype: torch.dtype, world_size: int, backend_averages: bool, divide_before: bool) -> Averaging:
    """See [Note: averaging]; ``divide_before``: the result is the whole bucket (all-reduce),
    so dividing before costs no more than after."""
    if world_size == 1:
        return Averaging()
    if dtype == torch.float16:
        before = 2.0 ** math.ceil(math.log2(math.sqrt(world_size)))
        return Averaging(before=1.0 / before, after=before / world_size)
    if backend_averages:
        return Averaging(op="avg")
    return Averaging(before=1.0 / world_size) if divide_before else Averaging(after=1.0 / world_size)


def averaging_per_space(spaces: Sequence[ParamSpace], reduce_dtype: ReduceDtype, world_size: int, group,
                        divide_before: bool) -> dict[ParamSpace, Averaging]:
    """:func:`averaging` of each space, decided once: the backend and dtypes never change."""
    backend = C.backend_averages(group, spaces[0].device if spaces else None)
    return {s: averaging(reduce_dtype(s), world_size, backend, divide_before) for s in spaces}


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor != 1.0:
        tensor.mul_(factor)


def _zero_pieces(space: ParamSpace, rank: int, names: set[str], shards: torch.Tensor) -> None:
    """Zero the elements of ``names`` in ``shards`` (this rank's slices of ``space``, local layout)."""
    for piece in space.layout.pieces(rank):
        if piece.name in names:
            piece.local_range.of(shards).zero_()


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _FullGradBuffer:
    """Stages 0-1: one full gradient buffer per space in the reduce dtype. When that is the
    parameters' dtype, ``param.grad`` are views into it (autograd accumulates in place);
    otherwise each finished gradient is added into it and ``param.grad`` is released."""

    full_grads_on_params: bool
    peak_staging_bytes = 0
    """Stages 0-1 stage nothing: the full buffer is reduced in place."""

    def __init__(self, spaces: Sequence[ParamSpace], reduce_dtype: ReduceDtype) -> None:
        self.spaces = list(spaces)
        self.data = {s: torch.zeros(s.layout.numel, dtype=reduce_dtype(s), device=s.device) for s in spaces}
        # .grad stays None until a backward gives the parameter a gradient, as in plain torch
        # (accept_grad points it at its view then).
        self.views = {name: s.layout.view(self.data[s], name) for s in spaces for name in s.params}

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        view = self.views[name]
        if param.grad is view:
            return
        if view.dtype == param.dtype:
            # .grad was None (zero_grad, or an unused parameter's), so autograd allocated a
            # fresh tensor: take its value and point .grad back at the buffer.
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
        view = self.views[name]
        if param.grad is view:
            return
        view.add_(param.grad)
        param.grad = view if view.dtype == param.dtype else None

    def late_buffer(self, bucket: GradBucket) -> torch.Tensor:
        data = self.data[bucket.space]
        return torch.zeros(bucket.spec.range.size, dtype=data.dtype, device=data.device)

    def _take_views_off(self, bucket: GradBucket) -> None:
        """Launching: a late gradient must not be added into the buffer being reduced (see
        [Note: a gradient that arrives twice] in reducer.py)."""
        for name in bucket.names:
            param = bucket.params[name]
            if param.grad is self.views[name]:
                param.grad = None

    def fill_missing(self, bucket: GradBucket) -> None:
        """Parameters that got no gradient this backward contribute zeros (or what they
        accumulated earlier, e.g. under no_sync)."""
        for name in bucket.missing:
            param = bucket.params[name]
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
        # As torch's zero_grad(set_to_none=True): no memset. The next backward's first gradient
        # of each parameter is copied over the stale values (accept_grad), parameters that get
        # none are zeroed (fill_missing). Only a buffer that accumulates by add_ (reduce dtype
        # differs from the parameters') is zeroed.
        for space, grad in self.data.items():
            if grad.dtype != space.compute_dtype:
                grad.zero_()
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

    def after_sync_backward(self) -> None:
        pass

    def _relayout_buffer(self, space: ParamSpace, data: torch.Tensor) -> None:
        """``data`` (the space's gradient buffer in its new layout) replaces the old one;
        a ``param.grad`` that was a view of the old buffer becomes the same view of the new."""
        old_views = {name: self.views[name] for name in space.params}
        self.data[space] = data
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
    (else see [Note: no full gradients at stages 1-3] in core/sharded_grads.py)."""

    def __init__(self, spaces: Sequence[ParamSpace], reduce_dtype: ReduceDtype, world_size: int, group, comm) -> None:
        super().__init__(spaces, reduce_dtype)
        self.world_size, self.group, self.comm = world_size, group, comm
        self.averaging_of = averaging_per_space(spaces, reduce_dtype, world_size, group, divide_before=True)
        # What the optimizer reads: reduced gradients in the master dtype.
        self.master_grads = {
            s: g if g.dtype == s.master_dtype else torch.zeros_like(g, dtype=s.master_dtype) for s, g in self.data.items()
        }

    def start(self, bucket: GradBucket) -> C.Handle:
        self._take_views_off(bucket)
        return self.start_late(bucket, bucket.spec.range.of(self.data[bucket.space]))

    def finish(self, bucket: GradBucket) -> None:
        _scale(bucket.spec.range.of(self.data[bucket.space]), self.averaging_of[bucket.space].after)
        self._copy_to_master(bucket)

    def start_late(self, bucket: GradBucket, data: torch.Tensor) -> C.Handle:
        plan = self.averaging_of[bucket.space]
        _scale(data, plan.before)
        return C.all_reduce(data, group=self.group, async_op=True, stats=self.comm, padding_numel=bucket.spec.padding,
                            op=plan.op)

    def finish_late(self, bucket: GradBucket, late: torch.Tensor) -> None:
        _scale(late, self.averaging_of[bucket.space].after)
        bucket.spec.range.of(self.data[bucket.space]).add_(late)
        self._copy_to_master(bucket)

    def _copy_to_master(self, bucket: GradBucket) -> None:
        master = self.master_grads[bucket.space]
        if master is not self.data[bucket.space]:
            bucket.spec.range.of(master).copy_(bucket.spec.range.of(self.data[bucket.space]))

    def after_sync_backward(self) -> None:
        """``.grad`` is the buffer's view again once nothing more can arrive (see _take_views_off)."""
        for space in self.spaces:
            for name, param in space.params.items():
                view = self.views[name]
                if param.grad is None and view.dtype == param.dtype:
                    param.grad = view

    def release_unused(self, names: set[str]) -> None:
        for space in self.spaces:
            for name, param in space.params.items():
                if name in names:
                    param.grad = None

    def clear_params(self, names: set[str], set_to_none: bool = True) -> None:
        super().clear_params(names, set_to_none)
        for space, master in self.master_grads.items():
            if master is not self.data[space]:
                for name in names & space.params.keys():
                    space.layout.view(master, name).zero_()

    def relayout(self, moves: dict[ParamSpace, Relayout]) -> None:
        """See [Note: bucket rebuild]: reduced gradients are complete on every rank."""
        for space, move in moves.items():
            shared = self.master_grads[space] is self.data[space]
            self._relayout_buffer(space, move.full(self.data[space]))
            self.master_grads[space] = self.data[space] if shared else move.full(self.master_grads[space])

    def master_grad(self, space: ParamSpace, name: str) -> torch.Tensor:
        return space.layout.view(self.master_grads[space], name)

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        return list(self.master_grads.values()), False

    def owned_grad_pieces(self) -> list[torch.Tensor]:
        """Every parameter's reduced gradient in registration order: what a norm is taken over
        ([Note: a norm per piece] in core/clipping.py)."""
        return [self.master_grad(space, name) for space in self.spaces for name in space.params]

    def grad_bytes(self) -> int:
        extra = [g for s, g in self.master_grads.items() if g is not self.data[s]]
        return _nbytes(list(self.data.values()) + extra)

    def workspace_bytes(self) -> int:
        return 0


class _ShardedAverage:
    """What stages 1-3 share: which slice is this rank's, and [Note: averaging] after a
    reduce-scatter."""

    world_size: int
    rank: int
    spaces: list[ParamSpace]
    averaging_of: dict[ParamSpace, Averaging]
    collective = "reduce_scatter"

    def piece_grad(self, space: ParamSpace, piece: ShardPiece) -> torch.Tensor:
        raise NotImplementedError

    def owned_grad_pieces(self) -> list[torch.Tensor]:
        """This rank's reduced gradient of every piece it owns, in buffer order: what a norm is
        taken over ([Note: a norm per piece] in core/clipping.py)."""
        return [self.piece_grad(space, piece) for space in self.spaces for piece in space.layout.pieces(self.rank)]

    def owned_in_space(self, spec, space_buffer: torch.Tensor) -> torch.Tensor:
        """This rank's slice of bucket ``spec`` in a buffer indexed like the whole space."""
        return spec.shard(self.rank).of(space_buffer)

    def owned_in_staging(self, bucket: GradBucket, staging: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``bucket`` in its staging buffer (indexed from the bucket start)."""
        return bucket.spec.shard(self.rank).shift(-bucket.spec.range.start).of(staging)

    def start_late(self, bucket: GradBucket, late: torch.Tensor) -> C.Handle:
        """Reduce-scatter a bucket-sized buffer: the late gradients of [Note: a gradient that
        arrives twice] in reducer.py (zeros for every other parameter)."""
        plan = self.averaging_of[bucket.space]
        _scale(late, plan.before)
        return C.reduce_scatter(self.owned_in_staging(bucket, late), late, group=self.group, async_op=True,
                                stats=self.comm, padding_numel=bucket.spec.padding, op=plan.op)

    def _reduced_late(self, bucket: GradBucket, late: torch.Tensor) -> torch.Tensor:
        owned = self.owned_in_staging(bucket, late)
        _scale(owned, self.averaging_of[bucket.space].after)
        return owned


class ReduceScatterInPlace(_FullGradBuffer, _ShardedAverage):
    """Stage 1; see [Note: stage 1 accumulation across reductions]."""

    max_in_flight: int | None = None
    full_grads_on_params = False

    def __init__(self, spaces, reduce_dtype: ReduceDtype, world_size: int, rank: int, group, comm) -> None:
        _FullGradBuffer.__init__(self, spaces, reduce_dtype)
        self.reduce_dtype, self.world_size, self.rank, self.group, self.comm = reduce_dtype, world_size, rank, group, comm
        self.averaging_of = averaging_per_space(spaces, reduce_dtype, world_size, group, divide_before=False)
        self.master_grad_shards = {
            s: torch.zeros(s.layout.shard_numel, dtype=s.master_dtype, device=s.device)
            for s, g in self.data.items()
            if g.dtype != s.master_dtype
        }
        self._carry: dict[ParamSpace, torch.Tensor] | None = None

    def start(self, bucket: GradBucket) -> C.Handle:
        self._take_views_off(bucket)
        data = bucket.spec.range.of(self.data[bucket.space])
        plan = self.averaging_of[bucket.space]
        _scale(data, plan.before)
        return C.reduce_scatter(self.owned_in_space(bucket.spec, self.data[bucket.space]), data, group=self.group, async_op=True,
                                stats=self.comm, padding_numel=bucket.spec.padding, op=plan.op)

    def finish_late(self, bucket: GradBucket, late: torch.Tensor) -> None:
        space = bucket.space
        reduced = self.owned_in_space(bucket.spec, self.data[space])
        reduced.add_(self._reduced_late(bucket, late))
        if space in self.master_grad_shards:
            space.layout.shard_of(bucket.spec, self.master_grad_shards[space]).copy_(reduced)

    def finish(self, bucket: GradBucket) -> None:
        space = bucket.space
        reduced = self.owned_in_space(bucket.spec, self.data[space])
        _scale(reduced, self.averaging_of[space].after)
        if self._carry is not None:
            carried = space.layout.shard_of(bucket.spec, self._carry[space])
            reduced.add_(carried)
            carried.zero_()
        if space in self.master_grad_shards:
            space.layout.shard_of(bucket.spec, self.master_grad_shards[space]).copy_(reduced)
        bucket.reduced = True
        for name in bucket.names:  # see [Note: stage 1 accumulation across reductions]
            bucket.params[name].grad = None

    def _carry_reduced(self, bucket: GradBucket) -> None:
        if self._carry is None:
            self._carry = {s: torch.zeros(s.layout.shard_numel, dtype=g.dtype, device=s.device) for s, g in self.data.items()}
        space = bucket.space
        space.layout.shard_of(bucket.spec, self._carry[space]).add_(self.owned_in_space(bucket.spec, self.data[space]))
        bucket.spec.range.of(self.data[space]).zero_()
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
                    _zero_pieces(space, self.rank, names, shards)

    def release_unused(self, names: set[str]) -> None:
        """The optimizer skips them (see ShardedOptimizer); nothing to release here."""

    def relayout(self, moves: dict[ParamSpace, Relayout]) -> None:
        """See [Note: bucket rebuild]: only the owned slices hold reduced gradients; the carry
        is all zeros after a reduction (added back bucket by bucket). Where a master-dtype copy
        of them exists, only it crosses ranks: the owned slices are that copy cast back (exact,
        it was cast from them)."""
        for space, move in moves.items():
            if space in self.master_grad_shards:
                master = self.master_grad_shards[space] = move.local(self.master_grad_shards[space])
                data = torch.zeros(move.new.numel, dtype=self.data[space].dtype, device=space.device)
                for spec in move.new.buckets:
                    self.owned_in_space(spec, data).copy_(move.new.shard_of(spec, master))
            else:
                data = move.owned(self.data[space])
            self._relayout_buffer(space, data)
            if self._carry is not None:
                assert not self._carry[space].any(), "a carry still holds gradients"
                self._carry[space] = self._carry[space].new_zeros(move.new.shard_numel)

    def piece_grad(self, space: ParamSpace, piece: ShardPiece) -> torch.Tensor:
        if space in self.master_grad_shards:
            return piece.local_range.of(self.master_grad_shards[space])
        return piece.buffer_range.of(self.data[space])

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        if self.master_grad_shards:
            return list(self.master_grad_shards.values()), True
        return [self.owned_in_space(spec, self.data[s]) for s in self.spaces for spec in s.layout.buckets], True

    def grad_bytes(self) -> int:
        tensors = list(self.data.values()) + list(self.master_grad_shards.values())
        if self._carry is not None:
            tensors += list(self._carry.values())
        return _nbytes(tensors)

    def workspace_bytes(self) -> int:
        return 0


class StagedReduceScatter(_ShardedAverage):
    """Stages 2-3; see [Note: no_sync at stages 2-3]. ``max_in_flight`` reductions may be
    outstanding; launching one more waits for the oldest, and the pool keeps at most
    ``max_in_flight + 1`` released staging buffers."""

    max_in_flight: int | None = 2
    full_grads_on_params = False

    def __init__(self, spaces, reduce_dtype: ReduceDtype, world_size: int, rank: int, group, comm) -> None:
        self.spaces = list(spaces)
        self.reduce_dtype, self.world_size, self.rank, self.group, self.comm = reduce_dtype, world_size, rank, group, comm
        self.averaging_of = averaging_per_space(spaces, reduce_dtype, world_size, group, divide_before=False)
        self.grad_shards = {
            s: torch.zeros(s.layout.shard_numel, dtype=s.master_dtype, device=s.device) for s in spaces
        }  # 1-D, this rank's slice of every bucket, in bucket order (local space), master dtype
        self._staging: dict[int, torch.Tensor] = {}  # bucket position -> its full-size gradients
        self._free: list[tuple[torch.Tensor, Bucket | None]] = []
        """Released staging buffers, each with the layout bucket it last served."""
        self._accumulated: dict[ParamSpace, torch.Tensor] = {}  # no_sync, full size, reduce dtype
        self.peak_staging_bytes = 0
        for space in spaces:
            for param in space.params.values():
                param.grad = None

    # ------------------------------------------------------------------ staging

    def _staging_for(self, bucket: GradBucket) -> torch.Tensor:
        staging = self._staging.get(bucket.position)
        if staging is None:
            dtype, numel = self.reduce_dtype(bucket.space), bucket.spec.range.size
            reusable = [i for i, (t, _) in enumerate(self._free) if t.dtype == dtype and t.numel() == numel]
            reusable.sort(key=lambda i: self._free[i][1] is not bucket.spec)  # one that served this bucket first
            if reusable:
                staging, served = self._free.pop(reusable[0])
            else:
                staging, served = torch.empty(numel, dtype=dtype, device=bucket.space.device), None
            # Not zeroed as a whole: every slot is overwritten by its gradient or, if none comes,
            # by fill_missing; only the padding must be zero. It stays zero while the buffer
            # serves the same bucket (the collective sums zeros there), so it is zeroed only
            # when the buffer comes new or from another bucket -- of this layout or of the
            # one before a rebuild, whose gaps differ ([Note: bucket rebuild]).
            if served is not bucket.spec:
                for gap in bucket.spec.gaps:
                    gap.shift(-bucket.spec.range.start).of(staging).zero_()
            self._staging[bucket.position] = staging
            self.peak_staging_bytes = max(self.peak_staging_bytes, _nbytes(self._staging.values()))
        return staging

    def _slot(self, bucket: GradBucket, name: str, full: torch.Tensor | None = None) -> torch.Tensor:
        """``name``'s gradient slot in the bucket's staging buffer (or in ``full``, a buffer
        indexed like the whole space)."""
        slot = bucket.space.layout.slots[name]
        if full is not None:
            return slot.shaped(slot.range.of(full))
        return slot.shaped(slot.range.shift(-bucket.spec.range.start).of(self._staging_for(bucket)))

    def _accumulation(self, space: ParamSpace) -> torch.Tensor:
        if space not in self._accumulated:
            self._accumulated[space] = torch.zeros(space.layout.numel, dtype=self.reduce_dtype(space), device=space.device)
        return self._accumulated[space]

    # ------------------------------------------------------------------ gradients arriving

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        slot = self._slot(bucket, name)
        slot.copy_(param.grad)
        if bucket.space in self._accumulated:
            slot.add_(self._slot(bucket, name, self._accumulated[bucket.space]))
        param.grad = None

    def accept_again(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        """See [Note: a gradient that arrives twice] in reducer.py."""
        self._slot(bucket, name).add_(param.grad)
        param.grad = None

    def accumulate_no_sync(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        self._slot(bucket, name, self._accumulation(bucket.space)).add_(param.grad)
        param.grad = None

    def late_buffer(self, bucket: GradBucket) -> torch.Tensor:
        return torch.zeros(bucket.spec.range.size, dtype=self.reduce_dtype(bucket.space), device=bucket.space.device)

    def finish_late(self, bucket: GradBucket, late: torch.Tensor) -> None:
        shard = bucket.space.layout.shard_of(bucket.spec, self.grad_shards[bucket.space])
        shard.add_(self._reduced_late(bucket, late))

    def fill_missing(self, bucket: GradBucket) -> None:
        accumulated = self._accumulated.get(bucket.space)
        for name in bucket.missing:
            if accumulated is not None:
                self._slot(bucket, name).copy_(self._slot(bucket, name, accumulated))
            else:
                self._slot(bucket, name).zero_()

    # ------------------------------------------------------------------ collectives

    def start(self, bucket: GradBucket) -> C.Handle:
        staging = self._staging_for(bucket)
        plan = self.averaging_of[bucket.space]
        _scale(staging, plan.before)
        return C.reduce_scatter(self.owned_in_staging(bucket, staging), staging, group=self.group, async_op=True,
                                stats=self.comm, padding_numel=bucket.spec.padding, op=plan.op)

    def finish(self, bucket: GradBucket) -> None:
        staging = self._staging.pop(bucket.position)
        owned = self.owned_in_staging(bucket, staging)
        shard = bucket.space.layout.shard_of(bucket.spec, self.grad_shards[bucket.space])
        scale = self.averaging_of[bucket.space].after
        if bucket.reduced:  # accumulating over a reduction since zero_grad
            shard.add_(owned, alpha=scale)
        elif shard.dtype == owned.dtype:
            torch.mul(owned, scale, out=shard)
        else:
            shard.copy_(owned).mul_(scale)
        bucket.reduced = True
        self._free.append((staging, bucket.spec))
        if len(self._free) > self.max_in_flight + 1:
            self._free.pop(0)

    def after_sync_backward(self) -> None:
        self._accumulated.clear()

    def clear(self) -> None:
        # Nothing reduced is zeroed: the first reduction of a bucket after zero_grad
        # (`bucket.reduced` False) overwrites its gradient-shard slice.
        self._accumulated.clear()
        with metadata_only():
            for space in self.spaces:
                for param in space.params.values():
                    param.grad = None

    def clear_params(self, names: set[str], set_to_none: bool = True) -> None:
        for space in self.spaces:
            _zero_pieces(space, self.rank, names, self.grad_shards[space])
            if space in self._accumulated:
                for name in names & space.params.keys():
                    space.layout.view(self._accumulated[space], name).zero_()

    def release_unused(self, names: set[str]) -> None:
        """The optimizer skips them (see ShardedOptimizer); nothing to release here."""

    def relayout(self, moves: dict[ParamSpace, Relayout]) -> None:
        """See [Note: bucket rebuild]: between backwards only the gradient shards exist (the
        pool's free staging buffers are kept: each served a bucket of the old layout, so its
        padding is zeroed again on first use)."""
        assert not self._staging and not self._accumulated, "rebuilding buckets while gradients are staged"
        for space, move in moves.items():
            self.grad_shards[space] = move.local(self.grad_shards[space])

    # ------------------------------------------------------------------ what the optimizer reads

    def piece_grad(self, space: ParamSpace, piece: ShardPiece) -> torch.Tensor:
        return piece.local_range.of(self.grad_shards[space])

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        return list(self.grad_shards.values()), True

    def grad_bytes(self) -> int:
        return _nbytes(list(self.grad_shards.values()) + list(self._accumulated.values()))

    def workspace_bytes(self) -> int:
        return _nbytes(list(self._staging.values()) + [t for t, _ in self._free])
