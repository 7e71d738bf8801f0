"""Exchanges of small texts between ranks through the c10d store, safe from any thread and
never paired with a collective: what an asynchronous checkpoint save agrees on while
training runs its collectives.

[Note: exchanges through the store]
A background save must agree between ranks (every file written? verified? committed?)
while the training thread runs its own collectives on the same process group. A collective
from the background could pair with one of training's (gloo matches collectives by their
order on a group: wrong bytes, or an abort) or, under NCCL, queue behind them. A second
process group avoids that, but it must be created at a point every rank reaches, in the
same order on every rank, and ``destroy_process_group()`` -- which scripts call at their
end, perhaps while a save still writes -- takes it down with the default group. The store
has neither problem: every exchange has keys of its own (``prefix``), so nothing pairs with
anything else, and the exchange holds the store object itself, which outlives the groups
(the server lives in torchrun's agent, or in rank 0's store object, held here).

A step of the exchange: each rank sets ``<prefix>/<step>/rank-<r>``, polls until every
rank's key exists, then reads them. Only calls that return at once are made (``set``,
``add``, ``check``, ``delete_key``, and ``get`` of a key known to exist): the TCPStore
client runs one call at a time behind a lock, so a blocking ``wait`` here would stall the
training thread's own store calls (the bounded waits and meetings of :mod:`watch`). A rank
deletes its key of step k once it has seen every rank's key of step k+1 (each rank sets
that only after reading step k); the last step's keys go in :meth:`StoreExchange.close`,
after every rank has said it read them (an empty ``done`` key per rank, all that stays of
an exchange), so a long run leaves next to nothing in the store, and the process hosting it
(rank 0 under a plain launch) does not leave while another rank still reads. An exchange
that failed leaves its keys: a rank that failed may never come to read them.

A rank that died never sets its key. So every rank of an exchange bumps a counter of its
own every :data:`HEARTBEAT_S` from a thread of its own (a long write or fsync does not
stop it), and a rank whose counter stands still for :data:`SILENT_AFTER_S` while the
others wait for it is named as gone, within seconds rather than at the timeout. The
timeout bounds a rank that is alive but never arrives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from ..errors import RanksOutOfStep

HEARTBEAT_S = 1.0
"""How often a rank taking part in an exchange says it is alive."""
SILENT_AFTER_S = 15.0
"""A rank that has not said so for this long is gone (its process died or is stopped)."""
POLL_S = 0.05
"""The longest pause between two looks for the other ranks' keys."""

_Result = TypeVar("_Result")


def default_store() -> Any | None:
    """The default process group's store, or None (no process group)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class StoreExchange:
    """All-gathers of texts among ``world_size`` ranks under the store keys ``prefix/...``
    (unique to this exchange); see [Note: exchanges through the store]. Every rank creates
    one with the same prefix, calls :meth:`all_gather` the same number of times, then
    :meth:`close`. ``timeout_s`` bounds each wait for a rank that is alive. At world size 1
    nothing touches the store (``store`` may be None)."""

    def __init__(self, store: Any, prefix: str, rank: int, world_size: int, timeout_s: float) -> None:
        self.store, self.prefix, self.rank, self.world_size = store, prefix, rank, world_size
        self.timeout_s = timeout_s
        self._step = 0
        self._broken = False
        """An exchange failed (a rank gone, the timeout, the store): no rank waits for this one."""
        self._stopped = threading.Event()
        self._heartbeat: threading.Thread | None = None
        if world_size > 1:
            self._heartbeat = threading.Thread(target=self._beat, name="shardpar-exchange-heartbeat", daemon=True)
            self._heartbeat.start()

    def _alive_key(self, rank: int) -> str:
        return f"{self.prefix}/alive/rank-{rank}"

    def _beat(self) -> None:
        while True:
            try:
                self.store.add(self._alive_key(self.rank), 1)
            except Exception:  # the store is gone: the exchange's own calls report it
                return
            if self._stopped.wait(HEARTBEAT_S):
                return

    def all_gather(self, text: str, what: str) -> list[str]:
        """Every rank's ``text``, index = rank. ``what`` names the step in errors."""
        if self.world_size == 1:
            return [text]
        step, self._step = self._step, self._step + 1
        keys = [f"{self.prefix}/{step}/rank-{r}" for r in range(self.world_size)]
        self._call(what, lambda: self.store.set(keys[self.rank], text))
        self._wait_until(
            lambda: self.store.check(keys), lambda: [r for r, k in enumerate(keys) if not self.store.check([k])], what
        )
        texts = self._call(what, lambda: [self.store.get(key).decode() for key in keys])
        if step > 0:  # every rank set its key of this step after reading the previous one
            self._call(what, lambda: self.store.delete_key(f"{self.prefix}/{step - 1}/rank-{self.rank}"))
        return texts

    def close(self, what: str) -> None:
        """Wait until every rank has read the last step, remove this rank's keys, stop the
        heartbeat. Call it once after the last :meth:`all_gather`, whatever came of it: after
        an exchange that failed (a rank gone, the timeout) it only stops the heartbeat."""
        try:
            if self.world_size == 1 or self._step == 0 or self._broken:
                return
            done = [f"{self.prefix}/done/rank-{r}" for r in range(self.world_size)]
            self._call(what, lambda: self.store.set(done[self.rank], ""))
            self._wait_until(
                lambda: self.store.check(done),
                lambda: [r for r, k in enumerate(done) if not self.store.check([k])],
                what,
            )
            self._call(what, lambda: self.store.delete_key(f"{self.prefix}/{self._step - 1}/rank-{self.rank}"))
        finally:
            self._stop()

    def _stop(self) -> None:
        self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
            try:
                self.store.delete_key(self._alive_key(self.rank))
            except Exception:
                pass

    def _call(self, what: str, call: Callable[[], _Result]) -> _Result:
        try:
            return call()
        except Exception as error:
            self._broken = True
            raise RanksOutOfStep(
                f"{what}: rank {self.rank} lost the store the ranks meet through "
                f"(its host, rank 0 or the launcher, may be gone): {error}"
            ) from error

    def _wait_until(self, ready: Callable[[], bool], missing: Callable[[], list[int]], what: str) -> None:
        """Poll ``ready`` until it holds; a rank of ``missing()`` silent for
        :data:`SILENT_AFTER_S`, or the timeout, is an error naming the ranks."""
        started = time.monotonic()
        beats: dict[int, tuple[int, float]] = {}  # rank -> (its counter, when it last changed)
        next_look = started + HEARTBEAT_S
        pause = POLL_S / 32  # the ranks usually arrive together: look again soon, then less often
        while not self._call(what, ready):
            now = time.monotonic()
            if now - started >= self.timeout_s:
                late = self._call(what, missing) or "some"
                self._broken = True
                raise RanksOutOfStep(
                    f"{what}: rank {self.rank} waited timeout_s={self.timeout_s:g} s for rank(s) {late} and gave up"
                )
            if now >= next_look:
                next_look = now + HEARTBEAT_S
                gone = []
                for rank in self._call(what, missing):
                    beat = int(self._call(what, lambda: self.store.add(self._alive_key(rank), 0)))  # noqa: B023 (called now)
                    if rank not in beats or beats[rank][0] != beat:
                        beats[rank] = (beat, now)
                    elif now - beats[rank][1] >= SILENT_AFTER_S:
                        gone.append(rank)
                if gone:
                    self._broken = True
                    raise RanksOutOfStep(
                        f"{what}: rank(s) {', '.join(map(str, gone))} gave no sign of life for "
                        f"{SILENT_AFTER_S:g} s (the process died, or is stopped), seen from "
                        f"rank {self.rank}"
                    )
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
