"""The orders learnt from the first step: the order buckets launch in (learnt from the first
forward, the same on every rank) and, where the buckets are rebuilt, the order gradients
became ready in the first synchronising backward. One recorder (:class:`FirstStepOrders`)
holds both and the rule for when each records; the use hooks and the gradient hooks drive it,
the reducer launches in its launch order and the bucket rebuild reads its ready order.

[Note: launch order]
Gradients become final roughly in the reverse order of the parameters' *first use* in
forward (a parameter's gradient is complete once the backward of its earliest use ran), so
a bucket completes when the earliest-used of its parameters does. The engine records, in
the first forward with autograd, the order in which buckets are first used; at the start of
the first synchronising backward every rank proposes the launch order "latest first use
first, never used last" and all adopt rank 0's (one object all-gather, once). Models whose
forward runs modules in another order than they are registered in (reversed, interleaved)
then still reduce each bucket as soon as it is complete, which is what bounds stage 2-3
staging. A model whose order changes later keeps the learnt order (correct, less overlap).
At stages 0-2 this order serves the first backward only: at its end the buckets themselves
are rebuilt from the order gradients became ready ([Note: ready order] below, [Note: bucket
rebuild] in rebuild.py) and launch in the order they complete in that record
(:meth:`FirstStepOrders.follow_rebuilt_buckets`).

[Note: ready order]
During the first synchronising backward (a ``no_sync`` one records nothing) the reducer notes
the order in which gradients become final (:class:`ReadyOrder`): step 1 of [Note: bucket
rebuild] in rebuild.py. What counts is the order of *modules*: a module's gradients are ready
when the last of them is, and among one module's parameters the layout order is kept. Within
one module the order is an artifact of its kernels (LayerNorm returns its weight's gradient
before its bias's, a Linear its bias's first), and a compiled region returns all of its
gradients at once, in the order of its graph's inputs; taken literally, compiling a block
would change the buckets and with them the number of collectives per step (docs/design.md,
"Invariants", says it must not). Modules are those the use-module hooks run on: the one registering a
parameter (the first, for a tied one), lifted to a compiled module enclosing it. Where
compiled code hides a module (``nn.Module.compile()`` in place, or ``torch.compile`` of the
wrapped model: its hook never fires), the engine cannot tell which gradients one compiled
region handed out together, so a run of consecutive gradients of such modules counts as one
group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from .training_state import TrainingState


class LaunchOrder:
    """See [Note: launch order]."""

    def __init__(self, bucket_names: Sequence[Sequence[str]]) -> None:
        self.bucket_names = [list(names) for names in bucket_names]
        self.order = list(range(len(self.bucket_names)))
        self.agreed = False
        self._first_use: dict[str, int] = {}
        self._recording = True

    @property
    def recording(self) -> bool:
        return self._recording and not self.agreed

    def saw(self, names: Iterable[str]) -> None:
        """Parameters a module about to run uses (first forward only)."""
        for name in names:
            self._first_use.setdefault(name, len(self._first_use))

    def stop_recording(self) -> None:
        self._recording = False

    def proposal(self) -> list[int]:
        """A bucket completes when its earliest-used parameter's gradient does: latest such
        first use first. A bucket with a parameter forward never used completes only at the
        end of backward: those last, in layout order."""
        if not self._first_use:
            return list(self.order)
        completes: dict[int, int] = {}
        for position, names in enumerate(self.bucket_names):
            if all(name in self._first_use for name in names):
                completes[position] = min(self._first_use[name] for name in names)
        used = sorted(completes, key=lambda position: -completes[position])
        return used + [position for position in self.order if position not in completes]

    def agree(self, exchange: Callable[[list[int]], list[list[int]]]) -> None:
        """Adopt rank 0's proposal; ``exchange`` gives every rank's list (a collective)."""
        self.adopt(exchange(self.proposal())[0])

    def adopt(self, order: Sequence[int]) -> None:
        """Launch in ``order`` (bucket positions) from now on, recording nothing more."""
        assert sorted(order) == list(range(len(self.bucket_names))), f"not an order of the buckets: {order}"
        self.order = list(order)
        self.agreed = True

    def recut(self, bucket_names: Sequence[Sequence[str]]) -> LaunchOrder:
        """The same tensors cut into other buckets (some owned whole, in buckets of their own:
        [Note: whole-tensor ownership] in layout.py): what was learnt carries over. Agreed, the
        new buckets launch in the order their tensors' old buckets did (the earliest first, the
        layout order between equals); else the first uses seen so far go on being recorded."""
        recut = LaunchOrder(bucket_names)
        recut._first_use = dict(self._first_use)
        recut._recording = self._recording
        if self.agreed:
            launched = {name: i for i, position in enumerate(self.order) for name in self.bucket_names[position]}
            recut.adopt(
                sorted(
                    range(len(recut.bucket_names)), key=lambda p: (min(launched[n] for n in recut.bucket_names[p]), p)
                )
            )
        return recut


class ReadyOrder:
    """The order gradients became final in the first synchronising backward (see [Note: ready
    order]). ``module_of`` names each parameter's module: the one registering it (the first,
    for a tied one), lifted to a compiled module enclosing it."""

    def __init__(self, module_of: Mapping[str, str]) -> None:
        self.module_of = dict(module_of)
        self._ready: dict[str, None] = {}  # insertion-ordered set
        self._ran: set[str] = set()

    def regroup(self, module_of: Mapping[str, str]) -> None:
        """Parameters' modules changed: modules were compiled after wrapping, and hooks moved
        to them ([Note: compiled after wrap] in engines/module_hooks.py)."""
        self.module_of = dict(module_of)

    def ran(self, names: Iterable[str]) -> None:
        """The hook of the module registering ``names`` fired (in any forward, also without
        autograd, as under reentrant activation checkpointing)."""
        self._ran.update(names)

    def saw(self, name: str) -> None:
        """``name``'s gradient became final in a synchronising backward."""
        self._ready.setdefault(name, None)

    def proposal(self, layout_names: Sequence[str]) -> list[int]:
        """Positions in ``layout_names`` (today's layout order over every space): first the
        parameters whose gradient became ready, as groups in the order each group's last
        gradient did, each group in layout order; then the others in layout order. A group is
        the parameters of one module whose hook the engine saw fire, or a run of consecutive
        gradients of parameters whose module's hook never fired (hidden in compiled code)."""
        position = {name: i for i, name in enumerate(layout_names)}
        group_of: dict[str, tuple[str, object]] = {}
        done: dict[tuple[str, object], int] = {}  # group -> when its last gradient became ready
        unseen_runs = 0
        previous_unseen = False
        for when, name in enumerate(self._ready):
            seen = name in self._ran
            if seen:
                group: tuple[str, object] = ("module", self.module_of.get(name, name))
            else:
                unseen_runs += not previous_unseen
                group = ("unseen", unseen_runs)
            previous_unseen = not seen
            group_of[name] = group
            done[group] = when
        ready = sorted(self._ready, key=lambda name: (done[group_of[name]], position[name]))
        return [position[name] for name in ready] + [
            i for i, name in enumerate(layout_names) if name not in self._ready
        ]


def completion_order(bucket_names: Sequence[Sequence[str]], order: Sequence[str]) -> list[int]:
    """Bucket positions sorted by when each completes: at the last of its names in ``order``."""
    position = {name: i for i, name in enumerate(order)}
    return sorted(range(len(bucket_names)), key=lambda b: max(position[name] for name in bucket_names[b]))


class FirstStepOrders:
    """The orders learnt from the first step, recorded by one rule: the launch order from the
    first forward with autograd outside a recompute ([Note: launch order]), the ready order
    from every forward's module uses and the gradients of the first synchronising backward
    ([Note: ready order]; only where the buckets are rebuilt, until they are)."""

    def __init__(self, bucket_names: Sequence[Sequence[str]], state: TrainingState, ready: ReadyOrder | None) -> None:
        self.state = state
        self.launch = LaunchOrder(bucket_names)
        """The order buckets launch in: the layout order until agreed."""
        self.ready = ready
        """Recorded until the buckets are rebuilt (see [Note: bucket rebuild] in rebuild.py);
        None once they are, or where they never are."""
        self.records_uses = True
        """Whether :meth:`module_runs` may record anything: a use hook, which fires for every
        module at every forward, reads this attribute instead of calling in (False from the
        first step on, where the buckets are not rebuilt or once they are)."""
        self._update_records_uses()

    def _update_records_uses(self) -> None:
        self.records_uses = self.launch.recording or self.ready is not None

    def module_runs(self, names: Iterable[str]) -> None:
        """A module using the parameters ``names`` is about to run its forward (a use-module
        hook at stages 0-2, a unit's use at stage 3)."""
        first_use = self.launch.recording and torch.is_grad_enabled() and not self.state.is_recompute()
        if not first_use and self.ready is None:
            return
        names = list(names)
        if first_use:
            self.launch.saw(names)
        if self.ready is not None:
            self.ready.ran(names)

    def forward_ended(self) -> None:
        """A forward with autograd returned from the root (not a recompute): the first ends
        the first-use record."""
        self.launch.stop_recording()
        self._update_records_uses()

    def backward_starts(self, exchange: Callable[[list[int]], list[list[int]]]) -> None:
        """The first hook of a backward ran: the first synchronising one agrees on the launch
        order (``exchange`` gives every rank's list: a collective, on every rank at once)."""
        if self.state.backward_syncs and not self.launch.agreed:
            self.launch.agree(exchange)
            self._update_records_uses()

    def end_ready_record(self) -> ReadyOrder:
        """The rebuild takes the ready order: nothing more is recorded."""
        record, self.ready = self.ready, None
        self._update_records_uses()
        assert record is not None  # the engine rebuilds only while a ready order is recorded
        return record

    def follow_recut_buckets(self, bucket_names: Sequence[Sequence[str]]) -> None:
        """The buckets were cut anew, the tensors unchanged (see :meth:`LaunchOrder.recut`)."""
        self.launch = self.launch.recut(bucket_names)
        self._update_records_uses()

    def follow_rebuilt_buckets(self, bucket_names: Sequence[Sequence[str]], ready: Sequence[str]) -> None:
        """The buckets were rebuilt from the agreed ready order ``ready``: they launch in the
        order they complete when gradients become ready in it (step 4 of [Note: bucket
        rebuild])."""
        self.launch = LaunchOrder(bucket_names)
        self.launch.adopt(completion_order(bucket_names, ready))
        self._update_records_uses()
