"""What a collective returns: a handle to wait on, whose waits go through ``watch``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import watch
from .process_group import ProcessGroup


class Handle:
    """An in-flight collective. ``wait()`` blocks until it is done and returns what the
    finishing step returned (None for most ops); calling it twice is fine. Waits are bounded
    and failures explained as [Note: ranks out of step] in ``shardpar.comm.watch`` says."""

    def __init__(
        self,
        work: Any = None,
        then: Callable[[], Any] | None = None,
        *,
        op: str = "collective",
        group: ProcessGroup | None = None,
        issued: int | None = None,
        collective: bool = True,
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
        if self._works:
            # The works were issued one after the other on the group, the last numbered
            # ``issued`` ([Note: stalled waits] in stalls); all waited for in one call.
            watch.wait_all(self._works, op=self._op, group=self._group, last=self._issued)
            self._works = []
        if self._then is not None:
            then, self._then = self._then, None
            self._result = then()
        return self._result

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)
