"""Which parameters got a gradient on some rank: the flags every synchronising backward
all-reduces, and how the host reads them back without waiting.

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
