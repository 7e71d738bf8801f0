"""The gradient ledger: which parameters have a gradient for the optimizer -- the flags of
those that got one on this rank, the flags every synchronising backward all-reduces with the
ranks' counters, how the host reads them back without waiting, the check that the ranks are
at the same point, and what ``zero_grad`` cleared or kept. The reducer holds one ledger and
asks it; the ledger moves no gradient (the strategy does, when the reducer tells it).

[Note: used parameters]
Plain torch leaves ``.grad`` of a parameter that took no part in the backward untouched
(``None`` after ``zero_grad``) and its optimizer skips it: no weight decay, no moment
update. Here a parameter unused on *this* rank still takes part in its bucket's collective
(with zeros), so that ranks that did use it get DDP's average. Which parameters were used
on *some* rank is one small all-reduce (max) per synchronising backward of a flag per
trainable parameter, launched with the last buckets: a parameter no rank used since
``zero_grad`` gets ``.grad = None`` (stage 0) or no gradient in the optimizer (stages
1-3), exactly as torch. The same vector carries this rank's count of synchronising
backward passes (and its negation, so one max-reduction yields the minimum too): if ranks
disagree, one of them skipped or added a backward and every gradient reduced in this
backward paired with the wrong partner, so every rank raises, naming the counts per rank.

[Note: reading the used-parameter flags]
The flags are kept on the host (a byte per parameter, set by the gradient hooks) and cross
to the device once per synchronising backward, from pinned memory without blocking; the
reduced vector comes back the same way behind an event (see [Note: no host sync in a step]
in comm/host.py). It is *read* only where the host needs it, so a CUDA step never waits:

- Every parameter got a gradient on this rank (the usual case): then every rank used it,
  and nothing but the counters is left to check. They are read at the end of the *next*
  synchronising backward (the device finished this one long before), or earlier where
  ``ready()`` says the copy has landed.
- Some parameter got none here: which of them no rank used is needed by ``step()`` (torch
  skips a parameter whose ``.grad`` is None) and by ``zero_grad(set_to_none=False)``; they
  wait for the copy then, as DDP's ``find_unused_parameters`` waits for its bitmap. Until
  then stage 0's ``.grad`` of such a parameter is its zero-filled view.

On the CPU every read is ready at once, so the flags are read at the end of the backward
that reduced them, as they always were. A mismatch of counters found at a read whose place
may differ between ranks (a deferred one) is raised with the range of each counter over the
ranks, without the object all-gather that names every rank's counts: that collective must
run at the same point everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import torch

from ..comm import collectives as C
from ..comm import host
from ..errors import RanksOutOfStep
from .training_state import TrainingState
from .wait_clock import WaitClock


class GradientLedger:
    """Which of ``names`` (every trainable parameter, in the reducer's layout order) have a
    gradient: see [Note: used parameters], [Note: reading the used-parameter flags], and for
    what ``zero_grad`` leaves, [Note: zero_grad of some parameters] and [Note:
    zero_grad(set_to_none=False)] in reducer.py."""

    def __init__(
        self,
        names: Sequence[str],
        state: TrainingState,
        comm: C.CommStats,
        group: Any,
        device: torch.device,
        wait_clock: WaitClock,
    ) -> None:
        self.state = state
        self.comm = comm
        self.group = group
        self.device = device
        self.wait_clock = wait_clock
        self._name_order(names)
        self.used = bytearray(len(self.names))
        """Host flags of the parameters that got a gradient on this rank since ``zero_grad``, in
        the order of ``names``: the reducer's gradient hook sets its parameter's byte itself."""
        self.unused: set[str] = set()
        """Parameters no rank used since ``zero_grad`` (known after a synchronising backward,
        once ``unused_known``)."""
        self.unused_known = True
        """Whether ``unused`` is read yet (see [Note: reading the used-parameter flags])."""
        self.flags_in_flight: FlagsInFlight | None = None
        """The last synchronising backward's flags, not read yet."""
        self._window = 0
        """Counts the ``zero_grad`` calls: which gradients a flag vector speaks of."""
        self.grads_ready = False
        """Some synchronising backward reduced gradients since the last ``zero_grad``."""
        self.cleared: set[str] = set()
        """Parameters whose gradients a ``zero_grad`` of some parameters forgot since the last
        synchronising backward (see [Note: zero_grad of some parameters] in reducer.py)."""
        self.kept_as_zeros: set[str] = set()
        """Parameters whose gradient ``zero_grad(set_to_none=False)`` zeroed and kept (see
        [Note: zero_grad(set_to_none=False)] in reducer.py)."""

    def _name_order(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._index = {name: i for i, name in enumerate(self.names)}

    def reorder(self, names: Sequence[str]) -> None:
        """The buckets were rebuilt ([Note: bucket rebuild] in rebuild.py): the flags follow
        their parameters into the new order. Nothing may be in flight (the vector is in the
        old order): :meth:`settle` first."""
        assert self.flags_in_flight is None, "reordering the used-flags while some are in flight"
        used = dict(zip(self.names, self.used))
        self._name_order(names)
        self.used = bytearray(used[name] for name in self.names)

    # ------------------------------------------------------------------ at a synchronising backward

    def reduce(self) -> None:
        """End of a synchronising backward, once its gradients are reduced: all-reduce the
        flags with this rank's counters and start their way back to the host; from now on
        they say who has a gradient (see [Note: reading the used-parameter flags])."""
        # Each rank's counters ride along, as themselves and negated, so that one MAX
        # reduction yields both the highest and the lowest: see [Note: ranks out of step].
        counters = self.state.counters()
        flags = host.flags_to_device(self.used, counters + [-c for c in counters], self.device)
        flags_handle = C.all_reduce(
            flags, group=self.group, async_op=True, stats=self.comm, op="max", kind="used_flags"
        )
        self.wait_clock.wait(flags_handle, gather=False)
        self.flags_in_flight = FlagsInFlight(host.DeviceToHost(flags), counters, self._window)
        self.cleared = set()  # this backward's flags say who has a gradient now
        self.grads_ready = True
        self.unused_known = 0 not in self.used  # used here, so used: nothing to read for that
        if self.unused_known:
            self.unused = set()

    def flags_landed(self) -> bool:
        """Whether the flags in flight can be read without waiting."""
        return self.flags_in_flight is not None and self.flags_in_flight.read.ready()

    def settle(self, block: bool) -> set[str] | None:
        """Read the flags in flight if they have landed (``block``: wait for them), check the
        counters and learn which parameters no rank used; see [Note: reading the
        used-parameter flags]. Returns None while flags are still in flight, else the
        parameters just learnt to have no gradient anywhere (for the strategy to release;
        often none)."""
        pending = self.flags_in_flight
        if pending is None:
            return set()
        if not block and not pending.read.ready():
            return None
        self.flags_in_flight = None
        flags = pending.checked_flags(self.state.COUNTER_NAMES, self.group, self.device)
        if pending.window == self._window and not self.unused_known:
            self.unused = {name for name, flag in zip(self.names, flags) if not flag}
            self.unused_known = True
            return self.unused - self.kept_as_zeros
        return set()

    # ------------------------------------------------------------------ what the optimizer asks

    def without_gradient(self) -> set[str]:
        """The parameters without a gradient for the optimizer (the rest have one: torch's
        ``.grad`` is not None); once ``unused_known`` (the reducer settles first). One set for
        the whole model, so a step asks once, not once per parameter; empty in the usual case."""
        if not self.grads_ready:
            return set(self.names) - self.kept_as_zeros
        if not self.unused and not self.cleared:
            return set()
        return (self.unused | self.cleared) - self.kept_as_zeros

    def without_gradient_here(self) -> set[str]:
        """:meth:`without_gradient` as far as the host knows without the flags: what this rank
        did not use."""
        if not self.grads_ready:
            return set(self.names) - self.kept_as_zeros
        unused_here = {name for name, used in zip(self.names, self.used) if not used}
        return (unused_here | self.cleared) - self.kept_as_zeros

    @property
    def any_gradient(self) -> bool:
        """Whether a ``step()`` now has something to update."""
        return self.grads_ready or bool(self.kept_as_zeros)

    # ------------------------------------------------------------------ zero_grad

    def keep_as_zeros(self, some: set[str] | None, set_to_none: bool) -> set[str]:
        """``zero_grad``'s first half: with ``set_to_none=False`` the parameters of ``some``
        (None: every one) that have a gradient are kept as zeros, and returned (their values
        for the strategy to zero); else ``some`` is kept no longer. Once ``unused_known``."""
        kept: set[str] = set()
        if not set_to_none:  # (a name already kept has a gradient, so it is kept again)
            kept = set(self.names if some is None else some) - self.without_gradient()
            self.kept_as_zeros |= kept
        elif self.kept_as_zeros:
            self.kept_as_zeros = set() if some is None else self.kept_as_zeros - some
        return kept

    def forget(self, some: set[str] | None) -> None:
        """``zero_grad``'s second half: the gradients of ``some`` (None: of every parameter)
        are gone until a synchronising backward's flags say again who has one."""
        self._window += 1
        if some is None:
            self.used = bytearray(len(self.names))
            self.unused = set()
            self.unused_known = True
            self.cleared = set()
            self.grads_ready = False
            return
        for name in some:
            self.used[self._index[name]] = 0
        self.cleared |= some


class FlagsInFlight:
    """One synchronising backward's reduced flags on their way to the host (see [Note:
    reading the used-parameter flags])."""

    def __init__(self, read: host.DeviceToHost, counters: list[int], window: int) -> None:
        self.read = read
        self.counters = counters
        """This rank's counters as it sent them."""
        self.window = window
        """The ``zero_grad`` window they belong to: after a ``zero_grad`` only the counters matter."""

    def checked_flags(self, counter_names: Sequence[str], group: Any, device: torch.device) -> list[int]:
        """The reduced flag of each parameter, once the counters that rode along say every rank
        is at the same point (else every rank raises; see [Note: used parameters])."""
        immediate = self.read.immediate  # read where it was reduced: the same point on every rank
        values = self.read.values()
        k = len(self.counters)
        tail = values[-2 * k :]
        if tail[:k] != [-c for c in tail[k:]]:
            _raise_diverged(counter_names, self.counters, tail[:k], [-c for c in tail[k:]], immediate, group, device)
        return values[: -2 * k]


def _raise_diverged(
    counter_names: Sequence[str],
    mine: list[int],
    highest: list[int],
    lowest: list[int],
    gather: bool,
    group: Any,
    device: torch.device,
) -> NoReturn:
    """Ranks sent different counters (``mine``: this rank's; ``highest``, ``lowest``: over the
    ranks): raise on every rank, naming each rank's counts where ``gather`` allows the object
    all-gather that finds them (see [Note: reading the used-parameter flags])."""
    if not gather:
        spread = "; ".join(
            f"{name}: {low} to {high} (this rank {own})"
            for name, own, high, low in zip(counter_names, mine, highest, lowest)
            if high != low
        )
        raise RanksOutOfStep(
            f"ranks fell out of step at a synchronising backward: they differ in {spread}. This backward's "
            "gradient collectives paired with another point of training on some rank. Every rank must run the "
            "same sequence of forward/backward passes (no_sync() on all ranks or none, the same number of "
            "micro-batches) and optimizer steps",
            reports={},
        )
    counts = C.all_gather_objects(mine, group=group, device=device)
    differ = [name for i, name in enumerate(counter_names) if len({row[i] for row in counts}) > 1]
    detail = "; ".join(
        f"rank {rank}: " + ", ".join(f"{row[i]} {name}" for i, name in enumerate(counter_names))
        for rank, row in enumerate(counts)
    )
    raise RanksOutOfStep(
        f"ranks fell out of step at a synchronising backward: they differ in {' and '.join(differ)} ({detail}). "
        "This backward's gradient collectives paired with another point of training on some rank. Every rank "
        "must run the same sequence of forward/backward passes (no_sync() on all ranks or none, the same number "
        "of micro-batches) and optimizer steps",
        reports={rank: {"counters": row} for rank, row in enumerate(counts)},
    )
