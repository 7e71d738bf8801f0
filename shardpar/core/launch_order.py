"""The order in which the gradient buckets launch: learnt once from the first forward, the
same on every rank.

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
are rebuilt from the order gradients became ready ([Note: bucket rebuild] in rebuild.py) and
launch in the order they complete in that record (:meth:`LaunchOrder.adopt`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence


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
