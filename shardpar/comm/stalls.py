"""The stall check: ranks whose collectives can never meet again are named within seconds,
not at ``timeout_s``.

A wait in ``watch`` (a bounded one, or a meeting) not complete after :data:`STALL_S` posts
this rank's position (:class:`Stall`); the world's first rank judges all of them
(:func:`judge`), and every rank raises the verdict through ``watch``'s post-mortem
(:func:`verdict_error`). Why that is sound: [Note: stalled waits] below.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..errors import RanksOutOfStep, UnitOrderMismatch

if TYPE_CHECKING:  # dist.Store itself, which torch.distributed does not mark as exported
    from torch.distributed.distributed_c10d import Store

STALL_S = 2.0
"""A wait not complete after this long posts where this rank is; see [Note: stalled waits]."""

_stalls = 0
"""Positions this process posted (tells a position still posted from a newer one)."""


# [Note: stalled waits]
# A rank that skips a unit at stage 3, takes another branch, generates longer, or gathers a
# state dict alone soon waits in a collective that another rank will never issue, while that
# rank waits in one the first will never issue: no collective of theirs completes again, and
# the tags of [Note: unit order across ranks] (core/unit_order.py) are never exchanged. Only
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


class Stall:
    """This rank's position, posted while one of its waits is stalled ([Note: stalled waits])."""

    def __init__(self, store: Any, base: str, position: dict[str, Any], look_every_s: float) -> None:
        """``base``: the keys' prefix in ``store`` (the incident's namespace); ``position``: where
        this rank is, as the note lists it (waiting, issued, doing, operations, engines); the
        verdict is looked for at most once every ``look_every_s`` (a wait's slice)."""
        global _stalls
        _stalls += 1
        self.store = store
        self.me, self.world = dist.get_rank(), dist.get_world_size()
        self.base = base
        self.look_every_s = look_every_s
        self.posted = False
        self.look_at = 0.0
        self.last_seen: list[int] | None = None
        position = {"stall": _stalls, **position}
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
        self.look_at = now + self.look_every_s
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


def _multi_get(store: Store, keys: list[str]) -> list[bytes]:
    try:
        return store.multi_get(keys)
    except AttributeError:  # a torch without it
        return [store.get(key) for key in keys]


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
        held_up[rank] = [
            (other, why)
            for other in waiting["ranks"]
            if other != rank and other in positions
            for why in [_holdup(positions[other], waiting)]
            if why is not None
        ]
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
        reports[str(rank)] = {
            "doing": positions[rank]["doing"],
            "waiting_in": waiting["op"],
            "cause": f"every rank waits for another: {why}",
        }
    advice = []
    if len({tuple(ops) for ops in operations.values()}) > 1:
        kind = "operation"
        names = sorted({op for ops in operations.values() for op in ops})
        inside = [rank for rank in ranks if operations[rank]]
        outside = [rank for rank in ranks if not operations[rank]]
        headline = (
            f"ranks stopped meeting in their collectives: {_ranks(inside)} in {' / '.join(names)}"
            + (f", which {_ranks(outside, verb=False)} did not start" if outside else "")
            + ", and every rank waits for another."
        )
        calls = sorted({name.split()[0] for name in names})
        advice.append(
            f"{' and '.join(calls)} {'is a collective' if len(calls) == 1 else 'are collectives'}: call "
            f"{'it' if len(calls) == 1 else 'them'} on every rank, at the same point of training."
        )
        if "full_state_dict" in calls:
            advice.append("To save on one rank, gather on every rank (model.state_dict()) and write on rank 0 only.")
    elif len({tuple(_pass_of(positions[rank]["engines"])) for rank in ranks}) == 1 and any(
        _is_unit_gather(positions[rank]["waiting"]["op"]) for rank in ranks
    ):
        kind = "units"
        headline = (
            "stage 3: units ran in a different order on different ranks (a unit skipped, repeated or run "
            "on some ranks only), so their collectives no longer pair up and every rank waits for another."
        )
        advice.append(
            "Every rank must run the same units in the same order in every forward and backward (put "
            "the modules a data-dependent branch chooses between in one unit)."
        )
    else:
        kind = "training"
        headline = (
            "ranks stopped meeting in their collectives: they are at different points of training, and "
            "every rank waits for another."
        )
        advice.append(
            "Every rank must run the same sequence of forward/backward passes, optimizer steps and checkpoint calls."
        )
    if any("without autograd" in positions[rank]["doing"] for rank in ranks):
        advice.append(
            "A forward without autograd on some ranks only, or more of them on some ranks, is an evaluation "
            "or a generation that differs between ranks: at stage 3 every forward gathers from every rank "
            "(Hugging Face generate: pass synced_gpus=True)."
        )
    advice.append(f"(Found once every rank had waited {STALL_S:g} s, without waiting for timeout_s.)")
    message = "\n".join([headline, "Where each rank is:", *lines, " ".join(advice)])
    return {"kind": kind, "message": message, "reports": reports}


def _ranks(ranks: list[int], verb: bool = True) -> str:
    text = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return f"{text} {'is' if len(ranks) == 1 else 'are'}" if verb else text


def verdict_error(verdict: dict[str, Any]) -> RanksOutOfStep:
    kind = UnitOrderMismatch if verdict["kind"] == "units" else RanksOutOfStep
    reports = {int(rank): report for rank, report in verdict["reports"].items()}
    return kind(verdict["message"], reports=reports, missing=[])
