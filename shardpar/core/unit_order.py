"""Unit order across ranks (stage 3): every parameter gather carries a tag that every rank
sees, so that ranks whose units ran in different orders all raise the same error -- or, where
only leftover units differ (on gloo), all recover the same way.

[Note: unit order across ranks]
Gathers pair across ranks by the order they are issued in, and each rank issues them in the
order its own forward and backward reach units. Every gather therefore carries a tag (a
gather sequence number and the flat group being gathered; see [Note: tagged all-gather] in comm/tagged_gather.py).
When a rank's tag differs from another's -- a branch taken on one rank only, a unit skipped
or repeated -- every rank sees every tag and raises the same error, naming each rank's unit,
at any step, instead of computing with another unit's weights or aborting inside gloo. The
gathers go over a process group of their own, so the gradient reductions, whose timing can
legitimately differ between ranks (a parameter one rank does not use), can never be paired
with a gather.

One divergence is recovered instead of reported: ranks running *different leftover units*
([Note: units] in units.py; e.g. rank-dependent branches among modules no policy unit encloses). The
tags show every rank the same mismatch, so all ranks then take the same decision: from here
on the leftover units are *held* -- gathered together, in one fixed order, when the root's
forward starts and again when its backward starts, freed after the root's forward and at the
end of backward -- which makes the sequence of gathers independent of which branch a rank
takes. The gathers still in flight are drained: a rank may have issued more of them after
the mismatched one than another (a prefetch, then a unit the others do not run), so each
completes its own and then sends empty fillers until a round in which every rank sent one.
Then the leftover units are gathered again in that order, and a unit whose gather was
drained is gathered anew when it is waited for. A divergence involving a policy unit is an
error: put the modules a branch chooses between in one unit.

[Note: deferred tag checks]
On gloo a tagged gather is a broadcast per rank into buffers sized for the largest shard, so
a mismatch completes and the tags are read when the gather is waited for: on the CPU that
read costs nothing. Elsewhere (NCCL) neither holds: an all-gather whose ranks post different
sizes hangs, and reading the tags at every wait would stop the host once per unit, twice a
step. So there (``tolerant`` False):

- Each gather is two all-gathers: the 16-byte tags, then the payload straight into the unit's
  full buffer. The tags travel to the host on a side stream that waits for the tag
  all-gather alone, and are *checked later*: whenever a wait or hook finds them landed, and
  with a wait at the end of the next backward (one backward later: long done), before any
  wait for the used-parameter flags, and before a probe. Checked in issue order, so the
  first mismatch is the one reported, and its tags always arrive (every rank posted a
  16-byte tag gather there, whatever it gathered).
- No rank posts a payload it does not know the others post too. What every rank knows is
  the last pass's sequence of gathers (a pass: one root forward and what follows it until the
  next; kept apart for forwards with and without autograd), identical on every rank since
  its tags were checked. A gather that repeats it at its position is posted at once. One
  that departs from it (the first pass, a branch, a new unit order) first *probes*: a tag
  all-gather alone, read at once (a host wait, outside the steady state). Ranks that all
  depart alike see equal tags and post the payload; a rank that departs alone sees the
  mismatch and raises, while the others' matching tag gathers complete, so they raise at
  their next check. No payloads of different sizes ever meet.
- A divergence is therefore never recovered there (by the time it is seen the ranks have
  gone on): it is raised on every rank, naming each rank's unit. Recovering from
  rank-dependent leftover units is gloo's alone; on NCCL raise ``min_unit_params`` so that
  such modules go with the root, or put the branch in one unit.
- Reductions of a backward need not wait for a checked gather ([Note: kept for backward] in
  gatherer.py):
  a rank that raises leaves the others' reductions unmatched, but they are waited for only
  by the GPU, and the host checks the tags before it ever waits for their results.
"""

from __future__ import annotations

import collections
from typing import Any, cast

import torch

from ..comm import collectives as C
from ..comm import host
from ..errors import UnitOrderMismatch
from .flat_param import FlatParamGroup, GatheredBytes
from .training_state import Phase, TrainingState
from .units import Unit
from .wait_clock import WaitClock

PROBE_MARK = 1 << 40
"""Set in the tag of a probe ([Note: deferred tag checks]): a probe meets only probes."""
BACKWARD_MARK = 1 << 41
"""Set in the tag of a gather issued in backward."""


class UnitOrder:
    """The tagged gathers of stage 3's :class:`~.gatherer.UnitGatherer`: each gather's tag,
    the order gathers are issued and completed in, the checks of [Note: unit order across
    ranks] and [Note: deferred tag checks], and the recovery from leftover units that ranks
    ran differently. It issues gathers and checks what arrived; the gatherer waits for them and
    acts on what the checks return (which gathers to complete first, which units to gather
    again), so nothing here calls back into it."""

    def __init__(
        self,
        units: list[Unit],
        state: TrainingState,
        comm: C.CommStats,
        group: Any,
        rank: int,
        wait_clock: WaitClock,
        sibling_of: Any,
    ) -> None:
        self.state, self.comm, self.group, self.rank = state, comm, group, rank
        self.wait_clock = wait_clock
        self.sibling_of = sibling_of
        """The process group ``group`` is the sibling of (``C.sibling_group``): that sibling is
        retired when ranks' gathers fell out of step (see :meth:`_check_rows`)."""
        self.flats = [f for unit in units for f in unit.flats]
        self.flat_index = {flat: i for i, flat in enumerate(self.flats)}
        self.unit_of = {flat: unit for unit in units for flat in unit.flats}
        self._reported_as = {flat: f"unit '{unit.name}' ({flat.label})" for flat, unit in self.unit_of.items()}
        self.max_shard_bytes = max(f.layout.shard_numel * f.full.element_size() for f in self.flats)
        self._plans: dict[FlatParamGroup, C.TaggedAllGather] = {}
        """Each group's prepared gather (remade when ``max_shard_bytes`` grows)."""
        self.in_flight: collections.deque[FlatParamGroup] = collections.deque()
        """Groups whose gathers are issued and not yet waited for, in issue order."""
        self.tolerant = C.get_world_size(group) == 1 or C.traits(group, self.flats[0].device).tolerant_gathers
        """Gathers of different sizes survive a mismatch (gloo); else see [Note: deferred tag checks]."""
        self._unchecked: collections.deque[tuple[int, C.GatheredTags]] = collections.deque()
        """Tags not checked yet ([Note: deferred tag checks]), with the sequence number of their gather."""
        self._checked_below = 0
        """At the next end of backward, tags of gathers numbered below this are waited for."""
        self._history: dict[bool, list[FlatParamGroup]] = {}
        """The last pass's gathers, by whether its forward had autograd ([Note: deferred tag checks])."""
        self._pass: list[FlatParamGroup] = []
        self._pass_key = True
        self._issued_as: dict[FlatParamGroup, int] = {}
        """The sequence number of each group's last gather."""
        self._receiving: dict[FlatParamGroup, int] = {}
        """Bytes of receive buffers held by each gather in flight (gloo's peers not received in place)."""
        self._exchange_index, self._filler_index = len(self.flats), len(self.flats) + 1
        """Tag indices of what is not a flat group: :meth:`exchange`, a drain's filler."""
        self._sequence = 0
        self.leftovers = [unit for unit in units if not unit.from_policy]
        self.leftovers_held = False
        """Set once ranks ran different leftover units (see [Note: unit order across ranks])."""
        self.checked_in_backward = False
        """A gather completed in this backward with every rank's tag equal."""
        self.receive_buffers = GatheredBytes(0)
        """Bytes of the gathers' receive buffers (``memory_stats()["gather_buffers"]``)."""

    # ------------------------------------------------------------------ passes

    def follow_placement(self) -> None:
        """The groups were laid out anew (their shards and full buffers replaced): the gathers
        prepared for them are made again, for their new sizes."""
        self.max_shard_bytes = max(f.layout.shard_numel * f.full.element_size() for f in self.flats)
        self._plans.clear()

    def begin_pass(self) -> None:
        """The root's forward starts (not a recompute): the gathers from here on are a new pass."""
        self._history[self._pass_key] = self._pass
        self._pass, self._pass_key = [], torch.is_grad_enabled()

    def begin_backward(self) -> None:
        """The root's backward starts: none of its gathers has been checked yet."""
        self.checked_in_backward = False

    def end_backward(self) -> None:
        """The end of a backward: the next one waits for the tags of every gather issued so far."""
        self._checked_below = self._sequence

    # ------------------------------------------------------------------ gathers

    def issue(self, flat: FlatParamGroup) -> C.Handle:
        """Start ``flat``'s tagged gather (the unit gatherer issues its gathers here)."""
        # What the tag says it gathers: the group, and whether for a backward (a rank gathering
        # a unit for its forward while another gathers it for backward has departed).
        index = self.flat_index[flat] | (BACKWARD_MARK if self.state.phase is Phase.BACKWARD else 0)
        if not self.tolerant and not self._repeats_history(flat):
            self._probe((self._sequence, index), flat.device)
        self._pass.append(flat)
        if flat.tagged_shard is not None and flat.shard.dtype == flat.full.dtype:
            send = flat.tagged_shard  # the shard sits behind room for the tag: sent without a copy
        else:  # mixed precision: gather the compute dtype
            send, payload = C.tagged_buffer(flat.shard.numel(), flat.dtype, flat.device)
            payload.copy_(flat.shard)
        plan = self._plans.get(flat)
        if plan is None or plan.max_shard_bytes != self.max_shard_bytes:
            # Made here, while the full buffer's storage is allocated (the plan's windows view it).
            plan = self._plans[flat] = C.TaggedAllGather(
                flat.full,
                flat.layout.shard_numel * flat.full.element_size(),
                max_shard_bytes=self.max_shard_bytes,
                group=self.group,
                stats=self.comm,
                padding_numel=flat.layout.padding,
                what=self._reported_as[flat],
            )
        tag = (self._sequence, index)
        self._issued_as[flat] = self._sequence
        self._sequence += 1
        handle = plan.start(send, tag)
        self.in_flight.append(flat)
        if plan.receive_bytes:
            self._receiving[flat] = plan.receive_bytes
            self.receive_buffers.add(plan.receive_bytes)
        return handle

    def _repeats_history(self, flat: FlatParamGroup) -> bool:
        history = self._history.get(self._pass_key)
        position = len(self._pass)
        return history is not None and position < len(history) and history[position] is flat

    def _probe(self, tag: tuple[int, int], device: torch.device) -> None:
        """Before a gather the last pass did not make here: every rank's tag alone, read at once,
        so that no payload meets one of another size ([Note: deferred tag checks]). ``tag`` is
        the one the gather itself will carry (it takes the sequence number after it)."""
        self.check_tags(block=True)
        self._sequence += 1
        probe = (tag[0], tag[1] | PROBE_MARK)  # a rank that gathers without probing must see a mismatch
        rows = self.wait_clock.wait(
            C.all_gather_tags(probe, group=self.group, device=device, stats=self.comm), gather=True
        )
        self._check_rows(rows)

    def check_tags(self, block: bool, below: int | None = None) -> None:
        """Check the deferred tags that have landed, in issue order (``block``: wait for those of
        gathers numbered below ``below``, None: all); see [Note: deferred tag checks]."""
        while self._unchecked:
            sequence, tags = self._unchecked[0]
            must = block and (below is None or sequence < below)
            if not must and not tags.ready():
                return
            self._unchecked.popleft()
            self._check_rows(tags.rows())

    def check_previous_backward(self) -> None:
        """Wait for the tags of every gather issued before the last backward ended (long landed)."""
        self.check_tags(block=True, below=self._checked_below)

    def _received(self, flat: FlatParamGroup) -> None:
        """``flat``'s gather completed: its receive buffers are gone."""
        nbytes = self._receiving.pop(flat, 0)
        if nbytes:
            self.receive_buffers.add(-nbytes)

    def pop_earlier(self, flat: FlatParamGroup) -> FlatParamGroup | None:
        """Take the first gather in flight off the queue, up to ``flat``'s: the gather to
        complete (and check) before ``flat``'s, or None once ``flat``'s own was taken (or is
        not in flight: completed further up the stack, or drained). Before waiting for a gather
        the gatherer completes every gather issued before it, asking again after each (a
        recovery may drain the rest): a rank that departed from the others' order must meet
        the first mismatching gather before any later one, which the others may never issue."""
        if flat not in self.in_flight:
            return None
        first = self.in_flight.popleft()
        return None if first is flat else first

    def exchange(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (equal lengths), through the tagged gathers' own channel: a
        rank exchanging while another gathers a unit is a mismatch both see (see the note),
        where a collective on another group would leave each waiting for the other."""
        size = len(values) * 4
        device = self.flats[0].device
        send, payload = C.tagged_buffer(len(values), torch.int32, device)
        payload.copy_(host.to_device(values, torch.int32, device))
        full = torch.empty(len(values) * C.get_world_size(self.group), dtype=torch.int32, device=device)
        # The gatherer completed every gather in flight first (checked, as before any wait; and
        # nothing left to drain).
        assert not self.in_flight, "an exchange starts with no gather in flight"
        if not self.tolerant:
            self._probe((self._sequence, self._exchange_index), device)
        tag = (self._sequence, self._exchange_index)
        self._sequence += 1
        self.max_shard_bytes = max(self.max_shard_bytes, size)
        tags = C.all_gather_tagged(
            full, send, tag, max_shard_bytes=self.max_shard_bytes, group=self.group, stats=self.comm, kind="control"
        ).wait()
        self._check_rows(tags.rows() if isinstance(tags, C.GatheredTags) else tags)
        return full.view(C.get_world_size(self.group), -1).tolist()  # set-up, once: a host read is fine

    def check_gather(self, flat: FlatParamGroup, result: list[list[int]] | C.GatheredTags) -> bool:
        """A gather of ``flat`` completed with ``result``: every rank's tag, or (see [Note:
        deferred tag checks]) the tags on their way. True when ranks ran different leftover
        units: they are held from now on, and the caller drains the gathers in flight
        (:meth:`drain_in_flight`) and gathers the leftover units again (see [Note: unit order
        across ranks]); any other mismatch raises."""
        nbytes = self._receiving.pop(flat, 0)  # the gather completed: its receive buffers are gone
        if nbytes:
            self.receive_buffers.add(-nbytes)
        if isinstance(result, C.GatheredTags):
            self._unchecked.append((self._issued_as.get(flat, self._sequence), result))
            self.check_tags(block=False)
            return False
        if result.count(result[self.rank]) == len(result):  # every rank's tag is this rank's (_check_rows)
            if self.state.phase is Phase.BACKWARD:
                self.checked_in_backward = True
            return False
        if self._recoverable(result):
            self.leftovers_held = True
            return True
        self._check_rows(result)
        return False

    def _check_rows(self, rows: list[list[int]]) -> None:
        if rows.count(rows[self.rank]) == len(rows):  # every rank's tag is this rank's
            if self.state.phase is Phase.BACKWARD:
                self.checked_in_backward = True
            return
        # No draining: other ranks may not have issued the gathers this rank still has in
        # flight. The gather group is retired instead, and the error stops this engine.
        C.retire_sibling_group(self.sibling_of)

        def describe(row: list[int]) -> str:
            if row[1] & PROBE_MARK:
                return describe([row[0], row[1] & ~PROBE_MARK]) + " (which the last pass did not gather there)"
            if row[1] & BACKWARD_MARK:
                return describe([row[0], row[1] & ~BACKWARD_MARK]) + " in backward"
            index = row[1]
            if 0 <= index < len(self.flats):
                return f"unit '{self.unit_of[self.flats[index]].name}' ({self.flats[index].label}), gather #{row[0]}"
            if index == self._exchange_index:
                return f"the start of backward (the launch-order agreement), gather #{row[0]}"
            return f"something else (tag {row})"

        detail = "; ".join(f"rank {r}: {describe(row)}" for r, row in enumerate(rows))
        raise UnitOrderMismatch(
            "stage 3: units ran in a different order on different ranks, so their all-gathers paired up "
            f"wrongly: {detail}. Every rank must run the same units in the same order in every forward and "
            "backward (put the modules a data-dependent branch chooses between in one unit"
            + (
                ""
                if self.tolerant
                else "; on this backend modules outside every policy unit that ranks run "
                "differently are not recovered either: raise min_unit_params so they go with the root"
            )
            + ")"
        )

    def _recoverable(self, rows: list[list[int]]) -> bool:
        """Every rank at the same gather number, each gathering a leftover unit (only a gather's
        own tags can be: a probe's, an exchange's and a filler's are no unit's)."""
        if not self.tolerant or self.leftovers_held or len({row[0] for row in rows}) != 1:
            return False
        indices = [row[1] & ~BACKWARD_MARK for row in rows]
        return all(0 <= i < len(self.flats) and not self.unit_of[self.flats[i]].from_policy for i in indices)

    def drain_in_flight(self) -> list[FlatParamGroup]:
        """Pair up the gathers issued after a recovered mismatch, whose values are not used;
        returns their groups, completed, for the caller to free. Ranks may have issued
        different numbers of them (a prefetch, then a gather of a unit the others do not run),
        so each rank completes its own in issue order and, with none left, sends empty
        fillers, a round at a time, until a round in which every rank sent one: every rank
        sees every tag of every round, so all stop at the same one."""
        pending = collections.deque(self.in_flight)
        self.in_flight.clear()
        drained = []
        while True:
            if pending:
                flat = pending.popleft()
                # Only tolerant gathers are drained (_recoverable): their handles return the rows.
                rows = cast(list[list[int]], self.wait_clock.wait(flat.take_handle(), gather=True))
                flat.complete_gather()
                self._received(flat)
                drained.append(flat)
            else:
                send, _ = C.tagged_buffer(0, torch.uint8, self.flats[0].device)
                filler = torch.empty(0, dtype=torch.uint8, device=self.flats[0].device)
                tag = (self._sequence, self._filler_index)
                self._sequence += 1
                rows = self.wait_clock.wait(
                    C.all_gather_tagged(
                        filler,
                        send,
                        tag,
                        max_shard_bytes=self.max_shard_bytes,
                        group=self.group,
                        stats=self.comm,
                        kind="control",
                    ),
                    gather=True,
                )
            if all(row[1] == self._filler_index for row in rows):
                return drained
