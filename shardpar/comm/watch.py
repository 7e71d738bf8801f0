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
not issue) are named within seconds, not at ``timeout_s``: see [Note: stalled waits].

NCCL works are waited on without a bound (a bounded wait would block the CPU on every
stream wait); torch's NCCL watchdog enforces the process group's timeout there.

What a rank is doing comes from the trackers registered with :func:`track` (each engine's
training state) and from :func:`operation` (a checkpoint save or load in progress), read
only when a report is written: nothing is paid per step.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
import weakref
from typing import Any, Iterator

import torch.distributed as dist

from ..errors import RanksOutOfStep, UnitOrderMismatch

SLICE_S = 1.0
"""A bounded wait checks the store for other ranks' incidents this often."""
GRACE_S = 5.0
"""How long a rank that writes a report waits for the other ranks' reports (capped by the
timeout itself)."""
POLL_S = 0.05
STALL_S = 2.0
"""A wait not complete after this long posts where this rank is; see [Note: stalled waits]."""
GLOO_MARGIN_S = 5.0
"""How much longer than ``timeout_s`` gloo's own timeout is (see ``process_group.backend_timeout``)."""

_describers: list[weakref.ref] = []
_operations: list[str] = []
_limits: dict[str, tuple[float, bool]] = {}
"""Per group: (timeout_s, whether waits are bounded: gloo only)."""
_incidents = 0
"""Incidents this process took part in (each rank counts the same ones)."""
_meetings: dict[tuple[str, str], int] = {}
_counted: dict[int, "_Counted"] = {}
"""Per bounded group (by ``id``): how to count the collectives this rank issued on it."""
_stalls = 0
"""Positions this process posted (tells a position still posted from a newer one)."""


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


def doing() -> str:
    parts = list(_operations)
    for ref in list(_describers):
        describer = ref()
        if describer is None:
            _describers.remove(ref)
        else:
            parts.append(describer.describe())
    return "; ".join(parts) or "outside any shardpar model"


# --------------------------------------------------------------------------- group identity


def _group_key(group: Any) -> str:
    pg = group if group is not None else dist.group.WORLD
    return pg.group_name


def configure(group: Any, timeout_s: float) -> None:
    """Bound the waits on ``group``'s collectives by ``timeout_s`` (set by each engine)."""
    if dist.is_initialized():
        bounded = dist.get_backend(group) == dist.Backend.GLOO
        _limits[_group_key(group)] = (float(timeout_s), bounded)
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
            return pg._get_sequence_number_for_group() - self.point_to_point
        except (AttributeError, RuntimeError):  # a torch or backend without it: no stall verdicts
            return None


def _counted_entry(pg: Any) -> "_Counted | None":
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
    return entry.issued(pg) if entry is not None and entry.group() is pg else None


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
    limit = _limits.get(_group_key(group))
    return limit[0] if limit is not None and limit[1] else None


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


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


def _incident_declared(store: Any) -> bool:
    try:
        return store.check([f"{_incident_key()}/flag"])
    except Exception:  # an unreachable store answers nothing; the wait goes on to its deadline
        return False


def wait(work: Any, *, op: str, group: Any, number: int | None = None) -> None:
    """Wait for one torch work object of ``op`` on ``group``; see [Note: ranks out of step].
    ``number``: the collective's place among those this rank issued on ``group``
    (:func:`issued` right after it; None: a point-to-point operation, or unknown)."""
    timeout = _wait_bound(group)
    stall: _Stall | None = None
    try:
        if timeout is None:
            work.wait()
            return
        started = time.monotonic()
        deadline = started + timeout
        store = None
        while True:
            remaining = deadline - time.monotonic()
            try:
                work.wait(datetime.timedelta(seconds=max(min(SLICE_S, remaining), 0.001)))
                return
            except RuntimeError as error:
                if work.is_completed() or "timed out" not in str(error).lower():
                    raise
            now = time.monotonic()
            if now >= deadline:
                raise post_mortem(group, op, f"{op} did not complete within timeout_s={timeout:g}")
            store = store if store is not None else _store()
            if store is None:
                continue
            if _incident_declared(store):
                raise post_mortem(group, op, "stopped waiting: another rank reported an incident")
            if now - started >= STALL_S:
                stall = stall if stall is not None else _Stall(store, group, op, {"number": number})
                verdict = stall.verdict()
                if verdict is not None:
                    raise post_mortem(group, op, verdict["reports"][str(dist.get_rank())]["cause"], verdict)
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
    store = _store()
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
    stall: _Stall | None = None
    pause = POLL_S / 64  # ranks usually arrive together: look again soon, then less often
    try:
        while not store.check([f"{base}/all"]):
            now = time.monotonic()
            if _incident_declared(store):
                raise post_mortem(group, name, "stopped waiting: another rank reported an incident")
            if now >= deadline:
                raise post_mortem(group, name, f"not every rank started {name} within timeout_s={timeout:g}")
            if now - started >= STALL_S:
                stall = stall if stall is not None else _Stall(store, group, name, {"meeting": f"{name}-{count}"})
                verdict = stall.verdict()
                if verdict is not None:
                    raise post_mortem(group, name, verdict["reports"][str(dist.get_rank())]["cause"], verdict)
            time.sleep(pause)
            pause = min(2 * pause, POLL_S)
    finally:
        if stall is not None:
            stall.retract()


# --------------------------------------------------------------------------- stalled waits


# [Note: stalled waits]
# A rank that skips a unit at stage 3, takes another branch, generates longer, or gathers a
# state dict alone soon waits in a collective that another rank will never issue, while that
# rank waits in one the first will never issue: no collective of theirs completes again, and
# the tags of [Note: unit order across ranks] (core/gatherer.py) are never exchanged. Only
# the timeout would end it. Instead, a wait (a bounded one, or a meeting) that has not
# completed after STALL_S posts this rank's position to the store, and takes it back when
# the wait ends (nothing is posted or read while no wait stalls):
#
#   waiting   the group (its name and ranks) and either the collective's number on it (this
#             rank's count of collectives issued on the group, right after issuing it: the
#             ranks' collectives pair by that count) or the meeting (name and count)
#   issued    this rank's count of issued collectives on each bounded group; a stalled rank
#             waits on its main thread, so it issues nothing more while its position stands
#   doing     what the reports say (training phase and counters, stage-3 unit, operation)
#
# and counts itself among the stalled ranks. Once every rank of the world is counted, the
# first rank reads all positions and judges: rank r is held up by rank q of its group when q
# did not issue r's collective yet (q's count is below r's number), when q waits in another
# collective at the same number, or when q is not at r's meeting. If every rank is held up
# by another, no wait can ever complete -- a wait whose collective every rank of its group
# issued is merely slow, and a rank that is busy (computing, or in a collective of the
# script's own) posts nothing, so the others keep waiting up to the timeout as before. The
# verdict must hold on two looks a slice apart with the same positions (a position posted
# by a wait that completed an instant ago is gone by then). The judging rank then declares an
# incident with the verdict, every other rank sees it within a slice, and every rank raises
# the same error, naming each rank's position: UnitOrderMismatch when the ranks are in the
# same pass and some wait in a stage-3 unit gather (the units differed), RanksOutOfStep when
# they are in different operations (a state dict or a checkpoint on some ranks only) or at
# different points of training. So a departure is named about STALL_S + 2 slices after the
# ranks part, at any timeout_s.
#
# Limits: it judges only when every rank waits in shardpar (a rank in ``dist.barrier()`` of
# the script's own is not seen: the others name it after timeout_s as the rank that sent no
# report); on NCCL, whose waits are not bounded, only meetings post positions (there the
# device waits, not the host; torch's watchdog ends a hung collective after the timeout).


class _Stall:
    """This rank's position, posted while one of its waits is stalled ([Note: stalled waits])."""

    def __init__(self, store: Any, group: Any, op: str, waiting: dict[str, Any]) -> None:
        global _stalls
        _stalls += 1
        self.store = store
        self.me, self.world = dist.get_rank(), dist.get_world_size()
        self.base = f"{_incident_key()}/stalled"
        self.posted = False
        self.look_at = 0.0
        self.last_seen: list[int] | None = None
        pg = group if group is not None else dist.group.WORLD
        waiting = {"group": pg.group_name, "ranks": dist.get_process_group_ranks(pg), "op": op, **waiting}
        position = {"stall": _stalls, "waiting": waiting, "issued": _issued_on_every_group(), "doing": doing(),
                    "operations": list(_operations), "engines": _engine_positions()}
        try:
            store.set(f"{self.base}/rank-{self.me}", json.dumps(position))
            store.add(f"{self.base}/count", 1)
            self.posted = True
        except Exception:  # an unreachable store: the wait goes on to its deadline
            pass

    def verdict(self) -> dict[str, Any] | None:
        """On the world's first rank, at most once a slice: the verdict once every rank is held
        up by another, seen twice in a row with the same positions; else None."""
        now = time.monotonic()
        if not self.posted or self.me != 0 or now < self.look_at:
            return None
        self.look_at = now + SLICE_S
        try:
            if self.store.add(f"{self.base}/count", 0) < self.world:
                self.last_seen = None
                return None
            raw = _multi_get(self.store, [f"{self.base}/rank-{rank}" for rank in range(self.world)])
        except Exception:
            return None
        if not all(raw):  # a rank took its position back a moment ago
            self.last_seen = None
            return None
        positions = {rank: json.loads(value) for rank, value in enumerate(raw)}
        found = judge(positions)
        seen = [positions[rank]["stall"] for rank in range(self.world)]
        confirmed = found is not None and seen == self.last_seen
        self.last_seen = seen if found is not None else None
        return found if confirmed else None

    def retract(self) -> None:
        if self.posted:
            self.posted = False
            try:
                self.store.set(f"{self.base}/rank-{self.me}", "")
                self.store.add(f"{self.base}/count", -1)
            except Exception:
                pass


def _multi_get(store: Any, keys: list[str]) -> list[bytes]:
    try:
        return store.multi_get(keys)
    except AttributeError:  # a torch without it
        return [store.get(key) for key in keys]


def _issued_on_every_group() -> dict[str, int]:
    counts = {}
    for entry in list(_counted.values()):
        pg = entry.group()
        count = entry.issued(pg) if pg is not None else None
        if count is not None:
            counts[entry.name] = count
    return counts


def _engine_positions() -> list[dict[str, Any]]:
    positions = []
    for ref in list(_describers):
        describer = ref()
        if describer is not None and hasattr(describer, "position"):
            positions.append(describer.position())
    return positions


def _is_unit_gather(op: str) -> bool:
    """A stage-3 gather (see tagged_gather.TaggedAllGather and all_gather_tags)."""
    return op.startswith(("tagged all_gather", "tag all_gather"))


def _holdup(other: dict[str, Any], waiting: dict[str, Any]) -> str | None:
    """Why the rank at position ``other`` holds up a wait for ``waiting`` (None: it does not)."""
    theirs = other["waiting"]
    if "meeting" in waiting:
        same = theirs.get("meeting") == waiting["meeting"] and theirs["group"] == waiting["group"]
        return None if same else "never started it"
    number, count = waiting.get("number"), other["issued"].get(waiting["group"])
    if number is None or count is None:
        return None  # cannot tell: never a verdict
    if count < number:
        return "has not issued it"
    if theirs["group"] == waiting["group"] and theirs.get("number") == number and theirs["op"] != waiting["op"]:
        return f"waits in {theirs['op']} there"
    return None


def judge(positions: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
    """The verdict on every rank's stalled position, when every rank is held up by another
    ([Note: stalled waits]); None when some rank's wait may still complete."""
    held_up: dict[int, list[tuple[int, str]]] = {}
    for rank, position in positions.items():
        waiting = position["waiting"]
        held_up[rank] = [(other, why) for other in waiting["ranks"] if other != rank and other in positions
                         for why in [_holdup(positions[other], waiting)] if why is not None]
        if not held_up[rank]:
            return None
    return _verdict(positions, held_up)


def _pass_of(engines: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Per engine: which forward-backward pass (a forward belongs to the backward after it), and
    the optimizer steps."""
    return [(e["backward_count"] + (e["phase"] == "forward"), e["step_count"]) for e in engines]


def _verdict(positions: dict[int, dict[str, Any]], held_up: dict[int, list[tuple[int, str]]]) -> dict[str, Any]:
    ranks = sorted(positions)
    operations = {rank: positions[rank]["operations"] for rank in ranks}
    lines, reports = [], {}
    for rank in ranks:
        waiting = positions[rank]["waiting"]
        why = "; ".join(f"rank {other} {text}" for other, text in held_up[rank])
        lines.append(f"  rank {rank}: {positions[rank]['doing']}; waiting in {waiting['op']} ({why})")
        reports[str(rank)] = {"doing": positions[rank]["doing"], "waiting_in": waiting["op"],
                              "cause": f"every rank waits for another: {why}"}
    advice = []
    if len({tuple(ops) for ops in operations.values()}) > 1:
        kind = "operation"
        names = sorted({op for ops in operations.values() for op in ops})
        inside = [rank for rank in ranks if operations[rank]]
        outside = [rank for rank in ranks if not operations[rank]]
        headline = (f"ranks stopped meeting in their collectives: {_ranks(inside)} in {' / '.join(names)}"
                    + (f", which {_ranks(outside, verb=False)} did not start" if outside else "")
                    + ", and every rank waits for another.")
        calls = sorted({name.split()[0] for name in names})
        advice.append(f"{' and '.join(calls)} {'is a collective' if len(calls) == 1 else 'are collectives'}: call "
                      f"{'it' if len(calls) == 1 else 'them'} on every rank, at the same point of training.")
        if "full_state_dict" in calls:
            advice.append("To save on one rank, gather on every rank (model.state_dict()) and write on rank 0 only.")
    elif len({tuple(_pass_of(positions[rank]["engines"])) for rank in ranks}) == 1 \
            and any(_is_unit_gather(positions[rank]["waiting"]["op"]) for rank in ranks):
        kind = "units"
        headline = ("stage 3: units ran in a different order on different ranks (a unit skipped, repeated or run "
                    "on some ranks only), so their collectives no longer pair up and every rank waits for another.")
        advice.append("Every rank must run the same units in the same order in every forward and backward (put "
                      "the modules a data-dependent branch chooses between in one unit).")
    else:
        kind = "training"
        headline = ("ranks stopped meeting in their collectives: they are at different points of training, and "
                    "every rank waits for another.")
        advice.append("Every rank must run the same sequence of forward/backward passes, optimizer steps and "
                      "checkpoint calls.")
    if any("without autograd" in positions[rank]["doing"] for rank in ranks):
        advice.append("A forward without autograd on some ranks only, or more of them on some ranks, is an evaluation "
                      "or a generation that differs between ranks: at stage 3 every forward gathers from every rank "
                      "(Hugging Face generate: pass synced_gpus=True).")
    advice.append(f"(Found once every rank had waited {STALL_S:g} s, without waiting for timeout_s.)")
    message = "\n".join([headline, "Where each rank is:", *lines, " ".join(advice)])
    return {"kind": kind, "message": message, "reports": reports}


def _ranks(ranks: list[int], verb: bool = True) -> str:
    text = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{text} {'is' if len(ranks) == 1 else 'are'}" if verb else text


def _verdict_error(verdict: dict[str, Any]) -> RanksOutOfStep:
    kind = UnitOrderMismatch if verdict["kind"] == "units" else RanksOutOfStep
    reports = {int(rank): report for rank, report in verdict["reports"].items()}
    return kind(verdict["message"], reports=reports, missing=[])


# --------------------------------------------------------------------------- the post-mortem


def post_mortem(group: Any, op: str, cause: str, verdict: dict[str, Any] | None = None) -> RanksOutOfStep:
    """Report this rank, collect the others' reports, and return the error to raise.
    ``verdict``: this rank found every rank's wait stalled ([Note: stalled waits]); every rank
    then raises the error it describes."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    global _incidents
    me = dist.get_rank()
    base = _incident_key()
    _incidents += 1
    report = {"doing": doing(), "waiting_in": op, "cause": cause}
    reports: dict[int, dict[str, str] | None] = {me: report}
    store = _store()
    store_problem = None
    if store is not None:
        try:
            if verdict is not None:  # before the flag: a rank that sees the flag finds the verdict
                store.compare_set(f"{base}/verdict", "", json.dumps(verdict))
            store.set(f"{base}/rank-{me}", json.dumps(report))
            store.add(f"{base}/flag", 1)
            if store.check([f"{base}/verdict"]):
                return _verdict_error(json.loads(store.get(f"{base}/verdict")))
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
    lines = [f"ranks stopped meeting in their collectives (rank {me}: {own['cause']}). What each rank reported:"]
    for rank in sorted(reports):
        report = reports[rank]
        if report is None:
            lines.append(f"  rank {rank}: no report -- it exited or died, or it is busy outside shardpar's collectives "
                         "(computing, or in a collective of the script's own such as dist.barrier())")
        else:
            lines.append(f"  rank {rank}: {report['doing']}; waiting in {report['waiting_in']} ({report['cause']})")
    if missing:
        lines.append(f"Rank(s) {', '.join(map(str, missing))} did not report.")
    elif len({r['doing'] for r in reports.values() if r is not None}) > 1:
        lines.append("The ranks are at different points of training: every rank must run the same sequence of "
                     "forward/backward passes, optimizer steps and checkpoint calls.")
    if store_problem is not None:
        lines.append(f"(The store that collects reports failed too: {store_problem}.)")
    return "\n".join(lines)
