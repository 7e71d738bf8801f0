"""The gradient reducer: readiness counting, in-order launch, start and finish per bucket.

[Note: gradient readiness and launch order]
Each trainable parameter has a post-accumulate-grad hook, which autograd calls once the
parameter's gradient for this backward is final. The hook counts the parameter's bucket
down; a complete bucket starts its collective at once, so communication runs while backward
computes earlier layers. Collectives pair up across ranks by the order they are issued in,
so buckets are *launched in one agreed order*, the same on every rank: a bucket that
completes early waits until every bucket before it in that order has launched.

The order is learnt once ([Note: launch order] in first_step_orders.py); until then it is the
layout order (reverse registration order). At the end of backward (a callback queued on the
*outermost* backward: see the engine) every bucket not launched yet -- those holding
parameters that got no gradient on this rank -- is launched with zeros for the missing
gradients, so unused branches and rank-dependent control flow neither hang nor need a graph
walk; then every handle is waited on, so gradients are final when ``backward()`` returns.

[Note: a gradient that arrives twice]
Within one graph task autograd sums every use of a parameter before its accumulate hook
runs, so the hook fires once per backward. Reentrant activation checkpointing breaks that:
each checkpointed segment runs its own inner backward, so a module checkpointed twice (or
used once inside a checkpoint and once outside) has its hook fire once per segment, and
plain torch gives the parameter the sum. DDP raises there unless ``static_graph``; FSDP2
reduces each use separately and adds. Here:

- a second arrival before the parameter's bucket launched is *added* to the first (the
  bucket already counted the parameter ready, and it is not final until the bucket
  launches: nothing was sent yet);
- an arrival after its bucket launched in this backward is *late*: it is added into a
  zeroed bucket-sized buffer, and at the end of backward each bucket with late gradients
  is reduced once more and the result added to what the first round reduced. So no
  collective ever reads a buffer that a gradient is still being added to: at stages 0-1,
  where ``param.grad`` is a view of the full buffer that autograd would accumulate into in
  place, launching a bucket takes those views off ``.grad`` (stage 0 puts them back when
  the backward ends).

The extra rounds pair up across ranks when every rank runs the same graph, as FSDP2's
per-use reductions do (a module checkpointed twice on one rank and once on another, by
rank-dependent control flow, is as unsupported here as there).

[Note: zero_grad of some parameters]
An optimizer built over part of the model (a GAN's two optimizers over one module, a second
optimizer for some layers) clears only its own parameters in ``zero_grad``, as torch's
does, so ``opt1.zero_grad(); opt2.step()`` still steps ``opt2``'s parameters with their
gradients. The strategy zeroes just those parameters' gradients wherever it keeps them (the
full buffer, the owned slices, the gradient shards, a stage-1 carry, a no_sync accumulation)
and the reducer's ledger (gradient_ledger.py) marks them *cleared*: they have no gradient
for the optimizer until a synchronising backward's used-flags say again who has one. Every
other parameter keeps its gradient, and its bucket stays in "add" mode, so the next backward
accumulates on top as torch does -- until every parameter of the bucket is cleared, by one
``zero_grad`` or by several (Muon's and AdamW's over one model), when the next backward writes
it anew, as after the plain clear. A ``zero_grad`` that covers every parameter is the plain clear.

[Note: zero_grad(set_to_none=False)]
torch's ``zero_grad(set_to_none=False)`` zeroes each ``.grad`` that exists and keeps it; one
that was None stays None. A kept zero gradient stays a gradient: a ``step()`` right after
(no backward), or after a backward that did not use the parameter, still updates it --
AdamW decays it and moves its moments. The reducer's ledger keeps those names (*kept as
zeros*) until a ``zero_grad`` that sets them to None: they have a gradient whatever the
used-flags say, its values are zeroed wherever the strategy keeps them (``clear_params``),
and at stage 0, where ``.grad`` is a view of the full buffer, ``.grad`` stays that zeroed
view.

[Note: gradients accumulate in the buffer]
At stages 0-1 the full gradient buffer holds a view per parameter (its slot, with the
parameter's shape and strides). At the start of every synchronising backward -- its first
hook, which for a backward through the model's output runs before any parameter's gradient
exists -- each small parameter (``IN_PLACE_MAX_NUMEL`` in reduce_strategies.py: where the
host's time per tensor outweighs two more passes over its memory) whose ``.grad`` is None gets
its view, zeroed, as ``.grad`` (the views zeroed by one ``_foreach_zero_``). Autograd then
adds each gradient into that view in place, as it does into any ``.grad`` that exists, instead
of handing over a new tensor that the hook copied into the buffer; and the post-accumulate-grad
hook only counts the arrival (:meth:`GradientReducer.arrived_in_place`: one call, no tensor op).
It is DDP's ``gradient_as_bucket_view`` with torch's ``zero_grad`` kept: between ``zero_grad()``
and the next backward ``.grad`` is None, as in plain torch, and under ``no_sync`` nothing is
pointed (a parameter the backward does not reach stays None, as under DDP's no_sync). Nor in
the first synchronising backward since wrap, where every gradient arrives as autograd made
it: that is where a sparse gradient (from a functional call no wrap-time check sees) is
refused, naming the parameter; a later one of a small parameter is added into its dense view
in place, its values intact.
Every other arrival takes the full path (:meth:`GradientReducer.on_grad_ready`): the one that
completes its bucket (which then launches), a second arrival (reentrant checkpointing), one
after its bucket launched (its view was taken off), one that autograd accumulated out of place
(``create_graph=True``) or before the views were set (a backward that began at a parameter),
every arrival of a backward under ``no_sync``, and every arrival while the ready order or a
timeline is recorded (the first step). Where the reduce dtype is not the parameters' (mixed
precision), the buffer cannot be ``.grad``: each gradient is added into it and released, as
before. Stages 2-3 have no full buffer: each gradient is copied into its staging bucket, and
the common arrival is taken in two calls (:meth:`GradientReducer.arrived_staged` counts it and
has the strategy copy it in), on the same conditions except that it need not wait for a first
synchronising backward (it checks that the gradient is dense itself), and only while no
complete bucket waits for its launch (stage 3's gate, backward_paths.py: a waiting bucket is
offered the launch by every full-path arrival). What it saves, per gradient: the copy (stages
0-1) and the calls of the full path (docs/benchmarks.md, "The host's share of a step (#44)").
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..comm import collectives as C
from .first_step_orders import FirstStepOrders, LaunchOrder, ReadyOrder
from .gradient_ledger import GradientLedger
from .layout import Bucket, BufferLayout
from .training_state import TrainingState
from .wait_clock import WaitClock

if TYPE_CHECKING:
    from .reduce_strategies import BucketReduction


class BucketedParams(Protocol):
    """A *bucketed parameter set*: parameters of one dtype laid out by one BufferLayout,
    whose buckets the reducer reduces (a replicated buffer at stages 0-2, a flat parameter
    group at stage 3). Not the *param space* of core/layout.py, which is an index space: offsets
    into one parameter's elements."""

    @property
    def layout(self) -> BufferLayout: ...
    @property
    def params(self) -> dict[str, nn.Parameter]: ...
    @property
    def master_dtype(self) -> torch.dtype: ...
    @property
    def compute_dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...


class BucketPhase(enum.Enum):
    COLLECTING = "collecting"  # waiting for gradients of this backward
    COMPLETE = "complete"  # every gradient is in, waiting for earlier buckets to launch
    IN_FLIGHT = "in_flight"  # collective launched, handle pending


class GradBucket:
    """Run-time state of one bucket during a backward pass."""

    def __init__(self, position: int, space: BucketedParams, spec: Bucket) -> None:
        self.position = position
        """Index in layout order over all spaces (``spec.index`` counts within one space)."""
        self.space = space
        self.spec = spec
        self.names = spec.names
        self.members = [(name, space.params[name]) for name in spec.names]
        """(name, parameter) of each of its parameters: what a loop over the bucket reads."""
        self.missing: set[str] = set(spec.names)
        self.phase = BucketPhase.COLLECTING
        self.handle: C.Handle | None = None
        self.reduced = False
        """Holds reduced gradients that ``zero_grad`` has not cleared yet."""
        self.launched = False
        """Its collective was launched in the backward in progress (see [Note: a gradient
        that arrives twice])."""

    @property
    def params(self) -> dict[str, nn.Parameter]:
        return self.space.params

    def slot_in(self, bucket_sized: torch.Tensor, name: str) -> torch.Tensor:
        """``name``'s gradient in a buffer laid out like this bucket (indexed from its start),
        with the parameter's shape and strides ([Note: element order] in core/element_order.py)."""
        slot = self.space.layout.slots[name]
        return slot.shaped(slot.in_bucket.of(bucket_sized))

    def reset(self) -> None:
        self.missing = set(self.spec.names)
        self.phase = BucketPhase.COLLECTING
        self.handle = None


class GradientReducer:
    """See [Note: gradient readiness and launch order], [Note: a gradient that arrives twice]
    and [Note: used parameters] (gradient_ledger.py)."""

    def __init__(
        self,
        spaces: Sequence[BucketedParams],
        strategy: BucketReduction,
        state: TrainingState,
        comm: C.CommStats,
        group: Any,
        wait_clock: WaitClock,
        ready_order: ReadyOrder | None = None,
    ) -> None:
        self.spaces = list(spaces)
        self.strategy = strategy
        self._build_buckets()
        self.state = state
        self.wait_clock = wait_clock
        self.orders = FirstStepOrders([bucket.names for bucket in self.buckets], state, ready_order)
        """The launch order and, until the buckets are rebuilt, the ready order (see
        first_step_orders.py)."""
        self.ledger = GradientLedger(self.names, state, comm, group, spaces[0].device, wait_clock)
        """Which parameters have a gradient (see gradient_ledger.py)."""
        self._cursor = 0
        self._in_flight: list[GradBucket] = []
        self.last_backward_wait_s = 0.0
        """Seconds the end of the last backward waited for gradient collectives."""
        self.timeline: list[tuple[str, object]] | None = None
        """Set to a list to record ("grad", name) and ("launch", bucket position) events."""
        self._arrived = bytearray(len(self.names))
        """Parameters whose gradient arrived in the backward in progress."""
        self._late: dict[int, torch.Tensor] = {}
        """Bucket position -> gradients that arrived after it launched, this backward."""
        self._counting_in_place = False
        """This backward's arrivals may be counted by :meth:`arrived_in_place`."""
        self._counting_staged = False
        """This backward's arrivals may be taken by :meth:`arrived_staged`."""
        self._counting_paused = False
        """See :meth:`pause_counting`."""
        self._synced_before = False
        """A synchronising backward began since wrap (see [Note: gradients accumulate in the buffer])."""

    def _build_buckets(self) -> None:
        """Buckets, in layout order over all spaces, and the maps from names to them."""
        specs = [(space, spec) for space in self.spaces for spec in space.layout.buckets]
        self.buckets = [GradBucket(position, space, spec) for position, (space, spec) in enumerate(specs)]
        self.bucket_of = {name: bucket for bucket in self.buckets for name in bucket.names}
        self.names = [name for bucket in self.buckets for name in bucket.names]
        self.flag_index = {name: i for i, name in enumerate(self.names)}
        in_place = self.strategy.in_place_views()
        self._slot_of = {name: (self.bucket_of[name], i, in_place.get(name)) for i, name in enumerate(self.names)}
        """name -> (its bucket, its flag index, the view autograd accumulates its gradient into
        if any: [Note: gradients accumulate in the buffer]): the one look-up a gradient hook makes."""
        self.counts_in_place = bool(in_place)
        """Whether :meth:`arrived_in_place` can take any arrival (stages 0-1, unless the buffer's
        dtype is not the parameters')."""

    @property
    def arrival_counter(self) -> Callable[[str, nn.Parameter], bool] | None:
        """What a gradient hook asks first (None: nothing, every arrival takes the full path):
        :meth:`arrived_in_place` at stages 0-1, :meth:`arrived_staged` where the strategy copies
        each gradient into a staging bucket (stages 2-3). See [Note: gradients accumulate in
        the buffer]."""
        if self.strategy.copies_each_gradient:
            return self.arrived_staged
        return self.arrived_in_place if self.counts_in_place else None

    @property
    def launch_order(self) -> LaunchOrder:
        """The order buckets launch in (see [Note: launch order] in first_step_orders.py)."""
        return self.orders.launch

    @property
    def ready_order(self) -> ReadyOrder | None:
        """The ready order being recorded, None once the buckets are rebuilt or where they never are."""
        return self.orders.ready

    @property
    def unused(self) -> set[str]:
        """Parameters no rank used since ``zero_grad``, once the ledger's flags are read."""
        return self.ledger.unused

    def relayout(self, ready: Sequence[str]) -> None:
        """After the buckets were rebuilt (the spaces carry their new layouts; see [Note:
        bucket rebuild]): new buckets and maps, used-flags moved by name, and the launch order
        in which the buckets complete when gradients become ready in ``ready``."""
        self.follow_placement()
        self.orders.follow_rebuilt_buckets([bucket.names for bucket in self.buckets], ready)

    def follow_placement(self) -> None:
        """The spaces' tensors moved within their buckets (tensors owned whole: [Note:
        whole-tensor ownership] in layout.py; their own buckets at stages 1-2): new bucket
        objects and maps, used-flags moved by name, the launch order learnt so far carried over."""
        assert not self._in_flight and self._cursor == 0, "laying out anew while collectives are in flight"
        reduced = {bucket.reduced for bucket in self.buckets}
        assert len(reduced) == 1, "some buckets hold reduced gradients and some do not"
        self.settle(block=True)  # the flags vector is in the old order
        self._build_buckets()
        for bucket in self.buckets:
            bucket.reduced = next(iter(reduced))
        self.ledger.reorder(self.names)
        self._arrived = bytearray(len(self.names))
        self.orders.follow_recut_buckets([bucket.names for bucket in self.buckets])

    # ------------------------------------------------------------------ during backward

    def begin_backward(self) -> None:
        """The first hook of a backward ran: nothing has arrived yet, and in a synchronising
        backward ``.grad`` points into the buffer wherever autograd can accumulate there (see
        [Note: gradients accumulate in the buffer])."""
        self._arrived = bytearray(len(self.names))
        self._counting_paused = False
        for bucket in self.buckets:
            bucket.launched = False
        syncs = self.state.backward_syncs
        if syncs and self._synced_before:
            self.strategy.grads_into_buffer(self.buckets)
        self._synced_before = self._synced_before or syncs
        self._counting_in_place = syncs and self.timeline is None and self.orders.ready is None and self.counts_in_place
        self._counting_staged = (
            syncs and self.timeline is None and self.orders.ready is None and self.strategy.copies_each_gradient
        )

    def end_backward(self) -> None:
        """The backward's end-of-backward callback ran (or it raised): every later arrival takes
        the full path."""
        self._counting_in_place = self._counting_staged = False

    def pause_counting(self, paused: bool) -> None:
        """While ``paused``, every arrival takes the full path, even where :meth:`arrived_staged`
        could count it: with each arrival, stage 3's path offers the launch again to a complete
        bucket that waits for it (backward_paths.py). Until the next backward begins."""
        self._counting_paused = paused

    def arrived_in_place(self, name: str, param: nn.Parameter) -> bool:
        """The common arrival in a synchronising backward, counted without further calls: the
        gradient is already in the bucket (autograd added it into ``.grad``, the bucket's view),
        the parameter arrives for the first time, and its bucket is neither launched nor
        completed by it. Returns False where anything else holds, and then
        :meth:`on_grad_ready` (through the backward path) takes the arrival. Stages 0-1 only,
        whose backward path does nothing for an arrival that completes no bucket; at stages 2-3
        there is no view to compare with. See [Note: gradients accumulate in the buffer]."""
        if not self._counting_in_place:
            return False
        bucket, index, view = self._slot_of[name]
        missing = bucket.missing
        arrived = self._arrived
        if param.grad is not view or arrived[index] or bucket.launched or len(missing) == 1:
            return False
        arrived[index] = 1
        self.ledger.used[index] = 1
        missing.discard(name)
        return True

    def arrived_staged(self, name: str, param: nn.Parameter) -> bool:
        """Stages 2-3's common arrival in a synchronising backward, taken with one call to the
        strategy (which copies the gradient into its staging slot and releases ``.grad``): the
        parameter arrives for the first time, its bucket is neither launched nor completed by
        it, the gradient is dense, and no graph is being built (``create_graph``). Returns False
        where anything else holds, or while counting is paused (:meth:`pause_counting`), and
        then :meth:`on_grad_ready` (through the backward path) takes the arrival. See [Note:
        gradients accumulate in the buffer]."""
        if not self._counting_staged or self._counting_paused:
            return False
        bucket, index, _ = self._slot_of[name]
        missing = bucket.missing
        arrived = self._arrived
        grad = param.grad
        if (
            arrived[index]
            or bucket.launched
            or len(missing) <= 1
            or grad is None
            or grad.layout is not torch.strided
            or torch.is_grad_enabled()
        ):
            return False
        arrived[index] = 1
        self.ledger.used[index] = 1
        self.strategy.accept_grad(bucket, name, param)
        missing.discard(name)
        return True

    def on_grad_ready(self, name: str, param: nn.Parameter) -> GradBucket | None:
        """A parameter's gradient arrived: final for this backward, unless its module is
        checkpointed reentrantly more than once (see [Note: a gradient that arrives twice]).
        Returns the bucket this gradient completed, if any: whoever drives backward (see
        backward_paths.py) decides when it launches. It runs once per parameter per backward,
        so the bookkeeping is inline ([Note: the host's share of a step] in engines/hooks.py):
        the used flag (the ledger's vector is in this reducer's name order), the ready order
        while one is recorded, and the bucket's count."""
        bucket, index, _ = self._slot_of[name]
        self.ledger.used[index] = 1
        if not self.state.backward_syncs:
            self.strategy.accumulate_no_sync(bucket, name, param)
            return None
        if bucket.launched:
            self._accept_late(bucket, name, param)
            return None
        arrived = self._arrived
        if arrived[index]:
            self.strategy.accept_again(bucket, name, param)
            return None
        arrived[index] = 1
        if self.timeline is not None:
            self.timeline.append(("grad", name))
        ready = self.orders.ready
        if ready is not None:
            ready.saw(name)
        self.strategy.accept_grad(bucket, name, param)
        assert bucket.phase is BucketPhase.COLLECTING, (
            f"gradient of '{name}' arrived after bucket {bucket.position} was already reduced; "
            "a parameter took part in two backward passes that were not separated by a forward"
        )
        missing = bucket.missing
        missing.discard(name)
        if missing:
            return None
        bucket.phase = BucketPhase.COMPLETE
        return bucket

    def launch_ready(self) -> None:
        """Launch the complete buckets whose turn it is."""
        order = self.orders.launch.order
        while self._cursor < len(order) and self.buckets[order[self._cursor]].phase is BucketPhase.COMPLETE:
            self._launch(self.buckets[order[self._cursor]])
            self._cursor += 1

    def _launch(self, bucket: GradBucket) -> None:
        assert bucket.handle is None, f"bucket {bucket.position} already has a collective in flight"
        if self.timeline is not None:
            self.timeline.append(("launch", bucket.position))
        bucket.handle = self.strategy.start(bucket)
        bucket.phase = BucketPhase.IN_FLIGHT
        bucket.launched = True
        self._in_flight.append(bucket)
        limit = self.strategy.max_in_flight
        while limit is not None and len(self._in_flight) > limit:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        bucket = self._in_flight.pop(0)
        assert bucket.handle is not None  # _launch gave every bucket in flight its handle
        self.wait_clock.wait(bucket.handle, gather=False)
        self.strategy.finish(bucket)
        bucket.reset()

    def _accept_late(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        late = self._late.get(bucket.position)
        if late is None:
            late = self._late[bucket.position] = self.strategy.late_buffer(bucket)
        assert param.grad is not None  # called from its post-accumulate-grad hook: the gradient is there
        bucket.slot_in(late, name).add_(param.grad)
        param.grad = None

    def _reduce_late(self) -> None:
        """Second rounds for the buckets that got late gradients (see [Note: a gradient that
        arrives twice]), in launch order, one at a time: they are rare."""
        late, self._late = self._late, {}
        for position in self.launch_order.order:
            if position in late:
                bucket = self.buckets[position]
                handle = self.strategy.start_late(bucket, late[position])
                self.wait_clock.wait(handle, gather=False)
                self.strategy.finish_late(bucket, late[position])

    def complete_missing(self) -> list[GradBucket]:
        """End of a synchronising backward, first: the buckets still collecting -- holding
        parameters that got no gradient on this rank -- are completed with zeros for those;
        returns them (stage 3 frees their groups before they are reduced)."""
        self.settle(block=True)  # the previous backward's flags, one backward later
        filled = []
        for position in self.launch_order.order[self._cursor :]:
            bucket = self.buckets[position]
            if bucket.phase is BucketPhase.COLLECTING:
                self.strategy.fill_missing(bucket)
                bucket.phase = BucketPhase.COMPLETE
                filled.append(bucket)
        return filled

    def finish_backward(self) -> None:
        """End of a synchronising backward, after :meth:`complete_missing`: launch what is left,
        agree on which parameters were used, wait for everything (on CUDA: order the current
        stream after it; see [Note: reading the used-parameter flags] in gradient_ledger.py)."""
        started = time.perf_counter()
        order = self.launch_order.order
        for position in order[self._cursor :]:
            self._launch(self.buckets[position])
        self._cursor = len(order)
        while self._in_flight:
            self._finish_oldest()
        self._reduce_late()
        self.ledger.reduce()
        self._cursor = 0
        self.last_backward_wait_s = time.perf_counter() - started
        self.strategy.after_sync_backward(self.buckets)
        if self.ledger.flags_landed():
            self.settle(block=True)

    def settle(self, block: bool) -> bool:
        """The ledger reads the flags in flight if they have landed (``block``: waits for
        them); the strategy releases the gradients of the parameters it learnt no rank used
        (see [Note: reading the used-parameter flags] in gradient_ledger.py). Returns whether
        nothing is left in flight."""
        unused = self.ledger.settle(block)
        if unused is None:
            return False
        if unused:
            self.strategy.release_unused(unused)
        return True

    def without_gradient(self) -> set[str]:
        """The parameters without a gradient for the optimizer (reading the flags if need be)."""
        if not self.ledger.unused_known:
            self.settle(block=True)
        return self.ledger.without_gradient()

    # ------------------------------------------------------------------ between steps

    def zero_grad(self, some: set[str] | None = None, set_to_none: bool = True) -> None:
        """Forget the gradients of the parameters ``some`` (None: of every parameter), or with
        ``set_to_none=False`` zero those that have one and keep them; see [Note: zero_grad of
        some parameters] and [Note: zero_grad(set_to_none=False)]."""
        if not set_to_none and not self.ledger.unused_known:
            self.settle(block=True)  # which gradients exist decides which are kept
        kept = self.ledger.keep_as_zeros(some, set_to_none)
        self._forget(some)
        if kept:
            self.strategy.clear_params(kept, set_to_none=False)

    def _forget(self, some: set[str] | None) -> None:
        self.settle(block=some is not None and not self.ledger.unused_known)  # a partial clear keeps the others' flags
        self.ledger.forget(some)
        if some is None:
            self.strategy.clear()
            for bucket in self.buckets:
                bucket.reduced = False
            return
        self.strategy.clear_params(some)
        # A bucket whose every gradient is cleared now, by this zero_grad or by several (one per
        # optimizer over part of the model): the next backward writes it anew.
        cleared = self.ledger.cleared
        for bucket in self.buckets:
            if bucket.reduced and cleared.issuperset(bucket.names):
                bucket.reduced = False
