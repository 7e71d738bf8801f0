"""Bounded waits on collectives, and a post-mortem that names the ranks when they fail.

[Note: ranks out of step]
A collective completes only when every rank of the group issues its counterpart. When a
rank is gone (killed, crashed, exited early) or somewhere else (it skipped a backward, it
is saving a checkpoint the others never started, it evaluates alone), torch's backends say
only "Timed out waiting 300000ms for recv" or "Connection closed by peer", on some ranks,
naming nobody. Three mechanisms replace that with an error that names ranks and places:

1. Counters that ride on a collective every synchronising backward already runs (the
   reducer's used-parameter reduction carries each rank's backward and optimizer-step
   counts). Ranks whose collectives still pair up but who are not at the same point of
   training (a skipped backward, a different number of micro-batches, a skipped
   ``optimizer.step()``) see different counters and raise on every rank at once.
2. Bounded waits (gloo): :func:`wait` waits for a collective at most ``timeout_s`` (the
   option of :func:`shardpar.wrap`), in slices of :data:`SLICE_S`; between slices it asks
   the process group's store whether another rank has declared an incident.
3. The post-mortem, through the store, which still works when collectives do not: the rank
   that times out or sees its collective fail posts a report (what it was doing, which
   collective it waited for, why it stopped) and raises an incident flag; every rank still
   waiting in a shardpar collective sees the flag within a slice and posts its own report.
   Each then waits up to :data:`GRACE_S` for the others' reports and raises
   :class:`shardpar.RanksOutOfStep` listing every rank: its report, or that it sent none
   (dead, or busy outside shardpar's collectives).

Rare collective phases that a single rank may enter by mistake (``save_checkpoint``,
``load_checkpoint``) first meet through the store (:func:`meet`), so that no collective of
theirs can pair with another phase's collective: mismatched gloo collectives can deliver
wrong bytes or abort the process.

Ranks whose collectives can never meet again (each waits for a collective another rank will
not issue) are named within seconds, not at ``timeout_s``: see [Note: stalled waits] in
``stalls.py``.

NCCL works are waited on without a bound (a bounded wait would block the CPU on every
stream wait); torch's NCCL watchdog enforces the process group's timeout there.

What a rank is doing comes from the trackers registered with :func:`track` (each engine's
training state) and from :func:`operation` (a checkpoint save or load in progress), read
only when a report is written: nothing is paid per step.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import json
import os
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..errors import RanksOutOfStep
from . import stalls

if TYPE_CHECKING:  # dist.Store itself, which torch.distributed does not mark as exported
    from torch.distributed.distributed_c10d import Store
from .store_exchange import default_store

SLICE_S = 1.0
"""A bounded wait checks the store for other ranks' incidents this often."""
GRACE_S = 5.0
"""How long a rank that writes a report waits for the other ranks' reports (capped by the
timeout itself)."""
POLL_S = 0.05
GLOO_MARGIN_S = 5.0
"""How much longer than ``timeout_s`` gloo's own timeout is (see ``process_group.backend_timeout``)."""

_describers: list[weakref.ref[Any]] = []
_operations: list[str] = []
_limits: dict[str, tuple[float, bool]] = {}
"""Per group: (timeout_s, whether waits are bounded: gloo only)."""
_incidents = 0
"""Incidents this process took part in (each rank counts the same ones)."""
_meetings: dict[tuple[str, str], int] = {}
_counted: dict[int, _Counted] = {}
"""Per bounded group (by ``id``): how to count the collectives this rank issued on it."""
_bounds: dict[int, tuple[weakref.ref[Any], float | None]] = {}
"""Per group (by ``id``, held weakly): the bound of its waits (:func:`_wait_bound`), worked
out at its first wait, so that a wait (twice per unit per step at stage 3) reads it with one
look-up; emptied whenever a group is configured."""


# --------------------------------------------------------------------------- what this rank is doing


def track(describer: Any) -> None:
    """Register an object whose ``describe()`` says what it is doing (an engine's training
    state); held weakly."""
    _describers.append(weakref.ref(describer))


def untrack(describer: Any) -> None:
    """Stop reporting ``describer`` (a closed engine's state, though something still holds it)."""
    _describers[:] = [ref for ref in _describers if ref() is not None and ref() is not describer]


@contextlib.contextmanager
def operation(name: str) -> Iterator[None]:
    """Mark a collective operation in progress (``save_checkpoint``...) for reports."""
    _operations.append(name)
    try:
        yield
    finally:
        _operations.pop()


def _live_describers() -> list[Any]:
    """The trackers still in use. A wrapped model dropped by the script is a reference cycle
    until the collector runs ([Note: collecting at exit] in engines/engine.py), so one collection
    first keeps dropped models out of the report; this runs only where a report or a stalled
    wait's position is written, never per step."""
    gc.collect()
    live = [ref() for ref in _describers]
    _describers[:] = [ref for ref, describer in zip(list(_describers), live) if describer is not None]
    return [describer for describer in live if describer is not None]


def doing() -> str:
    parts = list(_operations) + [describer.describe() for describer in _live_describers()]
    return "; ".join(parts) or "outside any shardpar model"


# --------------------------------------------------------------------------- group identity


def _group_key(group: Any) -> str:
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "called only once a process group is initialized (WORLD exists)"
    return pg.group_name


def configure(group: Any, timeout_s: float) -> None:
    """Bound the waits on ``group``'s collectives by ``timeout_s`` (set by each engine)."""
    if dist.is_initialized():
        bounded = dist.get_backend(group) == dist.Backend.GLOO
        _limits[_group_key(group)] = (float(timeout_s), bounded)
        _bounds.clear()
        pg = group if group is not None else dist.group.WORLD
        if bounded and _counted_entry(pg) is None:
            _counted[id(pg)] = _Counted(pg)


class _Counted:
    """How many collectives this rank issued on one group: torch's sequence number of the group
    (one per collective or point-to-point operation, counted by the backend), less the
    point-to-point operations, which do not pair by that number. Held weakly: [Note: no group
    outlives destroy_process_group] in process_group.py."""

    def __init__(self, pg: Any) -> None:
        self.group = weakref.ref(pg)
        self.name = pg.group_name
        self.point_to_point = 0

    def issued(self, pg: Any) -> int | None:
        try:
            number: int = pg._get_sequence_number_for_group() - self.point_to_point
            return number
        except (AttributeError, RuntimeError):  # a torch or backend without it: no stall verdicts
            return None


def _counted_entry(pg: Any) -> _Counted | None:
    entry = _counted.get(id(pg))
    return entry if entry is not None and entry.group() is pg else None


def issued(group: Any) -> int | None:
    """How many collectives this rank has issued on ``group`` so far, for a group whose waits
    are bounded (else None): a collective's number when read right after issuing it. One read
    of a counter the backend keeps; no communication."""
    if not _counted:
        return None
    pg = group if group is not None else dist.group.WORLD
    entry = _counted.get(id(pg))
    if entry is None or entry.group() is not pg:
        return None
    counted: Any = pg  # (torch does not declare the sequence-number reader)
    try:  # the group's count of issued collectives (read after every one stage 3 issues)
        number: int = counted._get_sequence_number_for_group() - entry.point_to_point
        return number
    except (AttributeError, RuntimeError):
        return None


def point_to_point(group: Any) -> None:
    """A send or receive was just issued on ``group``: not a collective (see :class:`_Counted`)."""
    if _counted:
        entry = _counted_entry(group if group is not None else dist.group.WORLD)
        if entry is not None:
            entry.point_to_point += 1


def timeout_of(group: Any) -> float | None:
    """The configured timeout of ``group`` (None: none configured)."""
    limit = _limits.get(_group_key(group)) if dist.is_initialized() else None
    return limit[0] if limit is not None else None


def _wait_bound(group: Any) -> float | None:
    """How long a wait on ``group`` may last (None: unbounded), remembered in :data:`_bounds`."""
    pg = group if group is not None else dist.group.WORLD
    entry = _bounds.get(id(pg))
    if entry is not None and entry[0]() is pg:
        return entry[1]
    limit = _limits.get(_group_key(pg))
    bound = limit[0] if limit is not None and limit[1] else None
    if pg is not None:
        _bounds[id(pg)] = (weakref.ref(pg), bound)
    return bound


def _base() -> str:
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"shardpar/post-mortem/attempt-{attempt}"


def _incident_key() -> str:
    """One incident namespace per job attempt, shared by all groups: a rank waiting on stage
    3's gather group must notice an incident declared on the main group."""
    return f"{_base()}/incident-{_incidents}"


# --------------------------------------------------------------------------- waiting


def _error_text(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text[:300]


def _incident_declared(store: Store) -> bool:
    try:
        return store.check([f"{_incident_key()}/flag"])
    except Exception:  # an unreachable store answers nothing; the wait goes on to its deadline
        return False


def wait(work: Any, *, op: str, group: Any, number: int | None = None) -> None:
    """Wait for one torch work object of ``op`` on ``group``; see [Note: ranks out of step].
    ``number``: the collective's place among those this rank issued on ``group``
    (:func:`issued` right after it; None: a point-to-point operation, or unknown)."""
    wait_all((work,), op=op, group=group, last=number)


def wait_all(works: Sequence[Any], *, op: str, group: Any, last: int | None = None) -> None:
    """Wait for torch work objects of ``op`` on ``group``, issued one after the other, in
    order, each as :func:`wait` does: one call for a collective made of several (a tagged
    gather's broadcast per rank, twice per unit per step at stage 3). ``last``: the last
    work's place among the collectives this rank issued on ``group`` (each earlier one is
    numbered one less than the next; None: point-to-point operations, or unknown)."""
    pg = group if group is not None else dist.group.WORLD
    bound = _bounds.get(id(pg))  # the group's wait bound: one look-up per wait
    timeout = bound[1] if bound is not None and bound[0]() is pg else _wait_bound(pg)
    stall: stalls.Stall | None = None
    try:
        if timeout is None:
            for work in works:
                work.wait()
            return
        for position, work in enumerate(works):
            started = time.monotonic()
            deadline = started + timeout
            store = None
            while True:
                remaining = deadline - time.monotonic()
                try:
                    work.wait(datetime.timedelta(seconds=max(min(SLICE_S, remaining), 0.001)))
                    break
                except RuntimeError as error:
                    if work.is_completed() or "timed out" not in str(error).lower():
                        raise
                now = time.monotonic()
                if now >= deadline:
                    raise post_mortem(group, op, f"{op} did not complete within timeout_s={timeout:g}")
                store = store if store is not None else default_store()
                if store is None:
                    continue
                if _incident_declared(store):
                    raise post_mortem(group, op, "stopped waiting: another rank reported an incident")
                if now - started >= stalls.STALL_S:
                    number = None if last is None else last - (len(works) - 1 - position)
                    stall = stall if stall is not None else _stall(store, group, op, {"number": number})
                    verdict = stall.verdict()
                    if verdict is not None:
                        raise post_mortem(group, op, verdict["reports"][str(dist.get_rank())]["cause"], verdict)
            if stall is not None:  # this work completed: a stall of the next is posted afresh
                stall.retract()
                stall = None
    except RanksOutOfStep:
        raise
    except RuntimeError as error:
        if not dist.is_initialized():
            raise
        raise post_mortem(group, op, f"{op} failed: {_error_text(error)}") from error
    finally:
        if stall is not None:
            stall.retract()


def meet(group: Any, name: str) -> None:
    """Every rank of ``group`` arrives at ``name`` (a rare collective phase) before any
    collective of it runs; through the store, bounded by the group's timeout."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    store = default_store()
    if store is None:
        return
    key = (_group_key(group), name)
    count = _meetings.get(key, 0)
    _meetings[key] = count + 1
    base = f"{_base()}/meet/{_group_key(group)}/{name}-{count}"
    world = dist.get_world_size(group)
    if store.add(f"{base}/arrived", 1) == world:
        store.set(f"{base}/all", "1")
    timeout = timeout_of(group) or 1800.0
    started = time.monotonic()
    deadline = started + timeout
    stall: stalls.Stall | None = None
    pause = POLL_S / 64  # ranks usually arrive together: look again soon, then less often
    try:
        while not store.check([f"{base}/all"]):
            now = time.monotonic()
            if _incident_declared(store):
                raise post_mortem(group, name, "stopped waiting: another rank reported an incident")
            if now >= deadline:
                raise post_mortem(group, name, f"not every rank started {name} within timeout_s={timeout:g}")
            if now - started >= stalls.STALL_S:
                stall = stall if stall is not None else _stall(store, group, name, {"meeting": f"{name}-{count}"})
                verdict = stall.verdict()
                if verdict is not None:
                    raise post_mortem(group, name, verdict["reports"][str(dist.get_rank())]["cause"], verdict)
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
    finally:
        if stall is not None:
            stall.retract()


# --------------------------------------------------------------------------- where a stalled wait is


def _stall(store: Any, group: Any, op: str, waiting: dict[str, Any]) -> stalls.Stall:
    """Post this rank's position while its wait for ``op`` on ``group`` is stalled ([Note:
    stalled waits] in stalls.py): what it waits for, and where it is."""
    pg = group if group is not None else dist.group.WORLD
    assert pg is not None, "a wait stalls only once a process group is initialized (WORLD exists)"
    waiting = {"group": pg.group_name, "ranks": dist.get_process_group_ranks(pg), "op": op, **waiting}
    position = {
        "waiting": waiting,
        "issued": _issued_on_every_group(),
        "doing": doing(),
        "operations": list(_operations),
        "engines": _engine_positions(),
    }
    return stalls.Stall(store, f"{_incident_key()}/stalled", position, SLICE_S)


def _issued_on_every_group() -> dict[str, int]:
    counts = {}
    for entry in list(_counted.values()):
        pg = entry.group()
        count = entry.issued(pg) if pg is not None else None
        if count is not None:
            counts[entry.name] = count
    return counts


def _engine_positions() -> list[dict[str, Any]]:
    return [describer.position() for describer in _live_describers() if hasattr(describer, "position")]


# --------------------------------------------------------------------------- the post-mortem


def post_mortem(group: Any, op: str, cause: str, verdict: dict[str, Any] | None = None) -> RanksOutOfStep:
    """Report this rank, collect the others' reports, and return the error to raise.
    ``verdict``: this rank found every rank's wait stalled ([Note: stalled waits] in
    stalls.py); every rank then raises the error it describes."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    global _incidents
    me = dist.get_rank()
    base = _incident_key()
    _incidents += 1
    report = {"doing": doing(), "waiting_in": op, "cause": cause}
    reports: dict[int, dict[str, str] | None] = {me: report}
    store = default_store()
    store_problem = None
    if store is not None:
        try:
            if verdict is not None:  # before the flag: a rank that sees the flag finds the verdict
                store.compare_set(f"{base}/verdict", "", json.dumps(verdict))
            store.set(f"{base}/rank-{me}", json.dumps(report))
            store.add(f"{base}/flag", 1)
            if store.check([f"{base}/verdict"]):
                return stalls.verdict_error(json.loads(store.get(f"{base}/verdict")))
            grace = min(GRACE_S, timeout_of(group) or GRACE_S)
            deadline = time.monotonic() + grace
            pending = [r for r in ranks if r != me]
            while pending:
                arrived = [r for r in pending if store.check([f"{base}/rank-{r}"])]
                for r in arrived:
                    reports[r] = json.loads(store.get(f"{base}/rank-{r}"))
                pending = [r for r in pending if r not in arrived]
                if not pending or time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S)
        except Exception as error:  # the store lives on some rank or agent that may be gone
            store_problem = _error_text(error)
    missing = [r for r in ranks if r not in reports]
    for r in missing:
        reports[r] = None
    return RanksOutOfStep(_message(me, reports, missing, store_problem), reports=reports, missing=missing)


def _message(me: int, reports: dict[int, dict[str, str] | None], missing: list[int], store_problem: str | None) -> str:
    own = reports[me]
    assert own is not None, "post_mortem enters this rank's own report first"
    lines = [f"ranks stopped meeting in their collectives (rank {me}: {own['cause']}). What each rank reported:"]
    for rank in sorted(reports):
        report = reports[rank]
        if report is None:
            lines.append(
                f"  rank {rank}: no report -- it exited or died, or it is busy outside shardpar's collectives "
                "(computing, or in a collective of the script's own such as dist.barrier())"
            )
        else:
            lines.append(f"  rank {rank}: {report['doing']}; waiting in {report['waiting_in']} ({report['cause']})")
    if missing:
        lines.append(f"Rank(s) {', '.join(map(str, missing))} did not report.")
    elif len({r["doing"] for r in reports.values() if r is not None}) > 1:
        lines.append(
            "The ranks are at different points of training: every rank must run the same sequence of "
            "forward/backward passes, optimizer steps and checkpoint calls."
        )
    if store_problem is not None:
        lines.append(f"(The store that collects reports failed too: {store_problem}.)")
    return "\n".join(lines)
