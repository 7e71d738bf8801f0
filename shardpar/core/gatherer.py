"""The parameter gatherers: all-gathers after ``step()`` at stages 1-2, and per-unit gather
and free with prefetch at stage 3.

[Note: one step at stage 3]
forward:  a unit's hook module is about to run -> free the units whose forward ended
          since the last unit started -> gather the unit (or wait for its prefetched
          gather) -> prefetch the next ``forward_prefetch`` units of the last forward's order
          -> run -> hook its outputs; it is freed when the next unit starts
          (``reshard_after_forward``, or no autograd), or kept for backward (below).
backward: a hook on a use's outputs fires before that use's backward -> gather again,
          prefetch the next ``backward_prefetch`` units of the last backward's order (the
          first backward: the reverse of the forward's) -> once backward reaches the use's
          inputs (an identity autograd function on them) the unit is freed. A trainable
          group is also freed the moment all its gradients are final, then reduce-scattered
          by the reducer.
recompute (activation checkpointing: a unit's forward runs again *inside* backward): the
          unit is gathered if it is not already, nothing is prefetched in forward order and
          nothing is freed after it -- the recomputed graph is about to use the storage. So
          checkpointing changes neither results nor the number of gathers. A unit whose
          gradients were already final (a module checkpointed twice, reentrantly) is
          gathered once more, and its further gradients are reduced in a second round.
end of backward: every unit still gathered is freed.

[Note: kept for backward]
The units whose forward ends last -- the unit that starts last and those enclosing it, such
as the root's own unit -- are the first that backward needs. Freeing them when the root's
forward ends would only gather them again a moment later, with nothing to overlap that
gather with. So a unit is freed when the *next* unit's forward starts, not when its own
ends (the peak is unchanged: the next unit was prefetched while this one ran), and the units
still waiting when the root's forward ends stay gathered into backward: one gather fewer
each per step, as FSDP2 does for its root. A kept unit is freed like any other once its
backward is done; if another unit's backward starts first (a kept unit the loss does not
use), or another forward starts, or the forward raised, it is freed then.

A kept unit changes what [Note: unit order across ranks] relies on: backward no longer
starts with a gather, so a rank that departed from the others' order could compute and
post gradient reductions before any gather of its backward showed the mismatch -- and a
rank that raises then leaves the others' reductions unmatched on the process group. Hence
no reduction of a backward is posted until a gather of that backward has been checked
(``may_reduce``: it completes the gathers in flight, usually the prefetch the first kept
unit issued; with no prefetch the reductions wait for the next unit's gather), and gathers
are always completed in the order they were issued (``_complete_earlier``), so every rank
meets the first mismatching gather before any later collective.
double backward (``torch.autograd.grad(..., create_graph=True)``, a gradient penalty): the
          graph that backward creates saves the gathered parameters it multiplied by, and a
          later backward runs through it. So from a backward that creates a graph until the
          end of the next backward that does not, no unit is freed (after a forward or during
          backward); they are freed at that backward's end.

[Note: unit order across ranks]
Gathers pair across ranks by the order they are issued in, and each rank issues them in the
order its own forward and backward reach units. Every gather therefore carries a tag (a
gather sequence number and the flat group being gathered; see [Note: tagged all-gather]).
When a rank's tag differs from another's -- a branch taken on one rank only, a unit skipped
or repeated -- every rank sees every tag and raises the same error, naming each rank's unit,
at any step, instead of computing with another unit's weights or aborting inside gloo. The
gathers go over a process group of their own, so the gradient reductions, whose timing can
legitimately differ between ranks (a parameter one rank does not use), can never be paired
with a gather.

One divergence is recovered instead of reported: ranks running *different leftover units*
([Note: units]; e.g. rank-dependent branches among modules no policy unit encloses). The
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
- Reductions of a backward need not wait for a checked gather ([Note: kept for backward]):
  a rank that raises leaves the others' reductions unmatched, but they are waited for only
  by the GPU, and the host checks the tags before it ever waits for their results.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm import collectives as C
from ..comm import host
from ..errors import UnitOrderMismatch
from .flat_param import FlatParamGroup, GatheredBytes, ShardState
from .training_state import Phase, TrainingState
from .wait_clock import WaitClock


PROBE_MARK = 1 << 40
"""Set in the tag of a probe ([Note: deferred tag checks]): a probe meets only probes."""
BACKWARD_MARK = 1 << 41
"""Set in the tag of a gather issued in backward."""


class GatherPhases:
    """What the engine tells the gatherer of its stage at each point of a step, and asks of
    it. Every stage has a gatherer (stage 0 :class:`NoGatherer`), so the engine never asks which
    stage it runs: a gatherer with nothing to do at a point inherits the no-op here."""

    group: Any
    device: torch.device
    comm: C.CommStats

    def begin_forward(self) -> None:
        """The root's forward starts (not a recompute)."""

    def end_forward(self) -> None:
        """The root's forward ended."""

    def abandon_forward(self) -> None:
        """The root's forward raised."""

    def begin_backward(self) -> None:
        """The first hook of a backward ran."""

    def grads_final(self, space: Any) -> None:
        """Every gradient of parameter space ``space`` is final in this backward."""

    def check_previous_backward(self) -> None:
        """The end of a backward, before any wait for its reductions."""

    def finish_backward(self) -> None:
        """The end of a backward, after its reductions."""

    def check_tags(self, block: bool) -> None:
        """Check what arrived of deferred order checks (``block``: wait for all of it)."""

    def exchange(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values``, in rank order (collective): one object all-gather."""
        return [list(v) for v in C.all_gather_objects(values, group=self.group, device=self.device,
                                                           stats=self.comm, kind="control")]

    def memory_stats(self) -> dict[str, int]:
        """Bytes of its own to report beside ``memory_stats()``'s common kinds."""
        return {}

    def gathers_per_step(self) -> list[tuple[int, torch.dtype]]:
        """(elements with padding, dtype) of each parameter all-gather one steady step issues."""
        return []


class NoGatherer(GatherPhases):
    """Stage 0: every rank holds every parameter; nothing is gathered."""

    def __init__(self, group: Any, device: torch.device, comm: C.CommStats) -> None:
        self.group, self.device, self.comm = group, device, comm


class PostStepGatherer(GatherPhases):
    """Stages 1-2: all-gather every bucket's updated slices after ``step()``; completed lazily
    (see [Note: lazy parameter gather] in replicated.py)."""

    def __init__(self, groups: list[FlatParamGroup], group: Any, comm: C.CommStats, wait_clock: WaitClock,
                 device: torch.device) -> None:
        self.group = group
        self.comm = comm
        self.wait_clock = wait_clock
        self.device = device
        self.track(groups)

    def track(self, groups: list[FlatParamGroup]) -> None:
        """Gather ``groups`` from now on (at wrap, and again when the buckets are rebuilt)."""
        self.groups = groups
        for flat in groups:
            flat.wait_clock = self.wait_clock

    def _issue(self, flat: FlatParamGroup) -> C.Handle:
        return C.all_gather(flat.full, flat.own_slice(), group=self.group, async_op=True, stats=self.comm,
                            padding_numel=flat.layout.padding)

    def start_all(self) -> None:
        with torch.no_grad():
            for flat in self.groups:
                own = flat.own_slice()
                if own.data_ptr() != flat.shard.data_ptr():  # gathered in the (narrower) compute dtype
                    own.copy_(flat.shard)
                flat.start_unshard(self._issue)

    def wait(self, groups: Sequence[FlatParamGroup]) -> None:
        for flat in groups:
            flat.wait_unsharded()

    def wait_all(self) -> None:
        self.wait(self.groups)

    def gathers_per_step(self) -> list[tuple[int, torch.dtype]]:
        return [(flat.layout.numel, flat.dtype) for flat in self.groups]


class Unit:
    """One stage-3 unit: its flat groups and what this backward still needs of them."""

    def __init__(self, index: int, name: str, hook_modules: tuple[str, ...], flats: list[FlatParamGroup],
                 from_policy: bool = True) -> None:
        self.index = index
        self.name = name
        self.hook_modules = hook_modules
        self.flats = flats
        self.from_policy = from_policy
        self.active_backward = 0
        """Uses whose backward started (pre-backward) and has not reached the inputs yet."""
        self.final: set[FlatParamGroup] = set()
        """Trainable groups whose gradients are final in this backward (not gathered again)."""
        self.running = 0
        """Uses of the unit whose forward is running (see [Note: entry modules] in units.py)."""
        self.entered_by: Any = None
        """The entry module whose forward started the use in progress, if one did."""

    @property
    def trainable(self) -> list[FlatParamGroup]:
        return [f for f in self.flats if f.trainable]

    @property
    def backward_done(self) -> bool:
        trainable = self.trainable
        return bool(trainable) and len(self.final) == len(trainable)

    def needed(self) -> list[FlatParamGroup]:
        return [f for f in self.flats if f not in self.final]

    def full_bytes(self) -> int:
        return sum(f.full_bytes for f in self.flats)


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward tells the gatherer the use's backward is done.
    As a node of its own it runs before hooks on those input tensors, i.e. before the previous
    unit's pre-backward starts its prefetch."""

    @staticmethod
    def forward(ctx, gatherer, unit, *tensors):  # type: ignore[override]
        ctx.gatherer, ctx.unit = gatherer, unit
        return tensors

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.gatherer.post_backward(ctx.unit)
        return (None, None) + grads


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):  # the common case, without a tree walk
        return [output] if output.requires_grad else []
    if isinstance(output, dict):
        output = list(output.values())
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def on_first_grad(tensors: list[torch.Tensor], hook: Callable[[Any], None]) -> Any:
    """Call ``hook`` once per backward, when the first gradient of one of ``tensors`` is
    computed (``register_multi_grad_hook(mode="any")``; for one tensor its own hook does the
    same without the per-forward setup, which matters once per unit per step)."""
    if len(tensors) == 1:
        return tensors[0].register_hook(hook)
    return torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")


class UnitGatherer(GatherPhases):
    """Stage 3; see [Note: one step at stage 3] and [Note: unit order across ranks]."""

    def __init__(
        self,
        units: list[Unit],
        state: TrainingState,
        reshard_after_forward: bool,
        forward_prefetch: int,
        backward_prefetch: int,
        comm: C.CommStats,
        group: Any,
        rank: int,
        on_forward_use: Callable[[Unit], None],
        on_backward_start: Callable[[], None],
        wait_clock: WaitClock,
    ) -> None:
        self.units = units
        self.state = state
        self.reshard_after_forward = reshard_after_forward
        self.forward_prefetch = forward_prefetch
        """Units of the last forward's order gathered ahead of the one computing in forward."""
        self.backward_prefetch = backward_prefetch
        """Units of the last backward's order gathered ahead of the one computing in backward."""
        self.comm = comm
        self.group = group
        self.rank = rank
        self.on_forward_use = on_forward_use
        self.on_backward_start = on_backward_start
        self.retire_group: Callable[[], None] | None = None
        """Called when ranks' gathers fell out of step (see _check_tags)."""
        self.flats = [f for unit in units for f in unit.flats]
        self.flat_index = {flat: i for i, flat in enumerate(self.flats)}
        self.unit_of = {flat: unit for unit in units for flat in unit.flats}
        self._reported_as = {flat: f"unit '{unit.name}' ({flat.label})" for flat, unit in self.unit_of.items()}
        self.max_shard_bytes = max(f.layout.shard_numel * f.full.element_size() for f in self.flats)
        self._plans: dict[FlatParamGroup, C.TaggedAllGather] = {}
        """Each group's prepared gather (remade when ``max_shard_bytes`` grows)."""
        self.wait_clock = wait_clock
        self._in_flight: collections.deque[FlatParamGroup] = collections.deque()
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
        for flat in self.flats:
            flat.on_unsharded = self._check_tags
            flat.before_wait = self._complete_earlier
            flat.wait_clock = wait_clock
        self._sequence = 0
        self._forward_uses: list[Unit] = []
        self._last_forward: list[Unit] = []
        self._backward_uses: list[Unit] = []
        self._last_backward: list[Unit] = []
        self.hold_for_double_backward = False
        """A backward created a graph (create_graph=True) that uses gathered parameters; see
        [Note: one step at stage 3], "double backward"."""
        self._backward_creates_graph = False
        self.leftovers = [unit for unit in units if not unit.from_policy]
        self.leftovers_held = False
        """Set once ranks ran different leftover units (see [Note: unit order across ranks])."""
        self._forward_ended: list[Unit] = []
        """Units whose forward ended since the last unit's forward started: freed when another
        unit's forward starts, kept for backward if the root's forward ends first."""
        self._kept_for_backward: list[Unit] = []
        self.last_kept: list[Unit] = []
        """The units the last forward kept gathered into backward (read by tools/bench.py)."""
        self._checked_in_backward = False
        """A gather completed in this backward with every rank's tag equal."""
        self._reductions_waiting = False
        """The reducer asked to post a reduction before that (see may_reduce)."""
        self.on_reductions_allowed: Callable[[], None] | None = None
        """Called once reductions that waited for a checked gather may be posted."""
        # Made once: a hook per unit output per forward is only registered, not built.
        self._pre_backward_hooks = {
            unit: torch.compiler.disable(lambda grad, unit=unit: self.pre_backward(unit)) for unit in units
        }
        self._shard_bytes = sum(f.shard_bytes for f in self.flats)
        self.gathered = GatheredBytes(sum(f.allocated_full_bytes() for f in self.flats))
        self.receive_buffers = GatheredBytes(0)
        """Bytes of the gathers' receive buffers (``memory_stats()["gather_buffers"]``)."""
        for flat in self.flats:
            flat.meter = self.gathered

    # ------------------------------------------------------------------ gathers

    def _issue(self, flat: FlatParamGroup) -> C.Handle:
        if not self.tolerant and not self._repeats_history(flat):
            self._probe((self._sequence, self._tag_index(flat)), flat.device)
        self._pass.append(flat)
        if flat.shard.dtype == flat.dtype and flat.tagged_shard is not None:
            send = flat.tagged_shard  # the shard sits behind room for the tag: sent without a copy
        else:  # mixed precision: gather the compute dtype
            send, payload = C.tagged_buffer(flat.shard.numel(), flat.dtype, flat.device)
            payload.copy_(flat.shard)
        plan = self._plans.get(flat)
        if plan is None or plan.max_shard_bytes != self.max_shard_bytes:
            # Made here, while the full buffer's storage is allocated (the plan's windows view it).
            plan = self._plans[flat] = C.TaggedAllGather(
                flat.full, flat.layout.shard_numel * flat.full.element_size(), max_shard_bytes=self.max_shard_bytes,
                group=self.group, stats=self.comm, padding_numel=flat.layout.padding, what=self._reported_as[flat])
        tag = (self._sequence, self._tag_index(flat))
        self._issued_as[flat] = self._sequence
        self._sequence += 1
        handle = plan.start(send, tag)
        self._in_flight.append(flat)
        if plan.receive_bytes:
            self._receiving[flat] = plan.receive_bytes
            self.receive_buffers.add(plan.receive_bytes)
        return handle

    def _tag_index(self, flat: FlatParamGroup) -> int:
        """What a gather's tag says it gathers: the group, and whether for a backward (a rank
        gathering a unit for its forward while another gathers it for backward has departed)."""
        return self.flat_index[flat] | (BACKWARD_MARK if self.state.phase is Phase.BACKWARD else 0)

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
        rows = self.wait_clock.wait(C.all_gather_tags(probe, group=self.group, device=device, stats=self.comm),
                                    gather=True)
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

    def complete_in_flight(self) -> None:
        """Wait for (and check) every gather issued so far."""
        while self._in_flight:
            self._in_flight[0].wait_unsharded()

    def may_reduce(self) -> bool:
        """Whether this backward's gradient reductions may be posted: once a gather of this
        backward has been checked (see [Note: kept for backward]). Completes the gathers in
        flight first if none has been."""
        if not self.tolerant and self.flats[0].device.type != "cpu":
            return True  # see [Note: deferred tag checks]; on the CPU a wait blocks anyway
        if not self._checked_in_backward and self._in_flight:
            self.complete_in_flight()
        if not self._checked_in_backward and not self.tolerant:
            self.check_tags(block=True)
        self._reductions_waiting = not self._checked_in_backward
        return self._checked_in_backward

    def _allow_waiting_reductions(self) -> None:
        if self._reductions_waiting and self._checked_in_backward:
            self._reductions_waiting = False
            if self.on_reductions_allowed is not None:
                self.on_reductions_allowed()

    def _complete_earlier(self, flat: FlatParamGroup) -> None:
        """Before waiting for ``flat``'s gather, wait for (and check the tags of) every gather
        issued before it: a rank that departed from the others' order must meet the first
        mismatching gather before any later one, which the others may never issue."""
        while flat in self._in_flight:  # not there: completed further up the stack, or drained
            first = self._in_flight.popleft()
            if first is not flat:
                first.wait_unsharded()

    def exchange(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (equal lengths), through the tagged gathers' own channel: a
        rank exchanging while another gathers a unit is a mismatch both see (see the note),
        where a collective on another group would leave each waiting for the other."""
        size = len(values) * 4
        device = self.flats[0].device
        send, payload = C.tagged_buffer(len(values), torch.int32, device)
        payload.copy_(host.to_device(values, torch.int32, device))
        full = torch.empty(len(values) * C.get_world_size(self.group), dtype=torch.int32, device=device)
        self.complete_in_flight()  # checked first, as in _complete_earlier, and nothing left to drain
        if not self.tolerant:
            self._probe((self._sequence, self._exchange_index), device)
        tag = (self._sequence, self._exchange_index)
        self._sequence += 1
        self.max_shard_bytes = max(self.max_shard_bytes, size)
        tags = C.all_gather_tagged(full, send, tag, max_shard_bytes=self.max_shard_bytes, group=self.group,
                                   stats=self.comm, kind="control").wait()
        self._check_rows(tags.rows() if isinstance(tags, C.GatheredTags) else tags)
        return full.view(C.get_world_size(self.group), -1).tolist()  # set-up, once: a host read is fine

    def _check_tags(self, flat: FlatParamGroup, result: "list[list[int]] | C.GatheredTags") -> None:
        """A gather of ``flat`` completed with ``result``: every rank's tag, or (see [Note:
        deferred tag checks]) the tags on their way."""
        self._received(flat)
        if isinstance(result, C.GatheredTags):
            self._unchecked.append((self._issued_as.get(flat, self._sequence), result))
            self.check_tags(block=False)
            return
        self._check_rows(result)

    def _check_rows(self, rows: list[list[int]]) -> None:
        if all(row == rows[self.rank] for row in rows):
            if self.state.phase is Phase.BACKWARD:
                self._checked_in_backward = True
            return
        if self._recoverable(rows):
            self._hold_leftovers()
            return
        # No draining: other ranks may not have issued the gathers this rank still has in
        # flight. The gather group is retired instead, and the error stops this engine.
        if self.retire_group is not None:
            self.retire_group()

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
            + ("" if self.tolerant else "; on this backend modules outside every policy unit that ranks run "
               "differently are not recovered either: raise min_unit_params so they go with the root") + ")"
        )

    def _recoverable(self, rows: list[list[int]]) -> bool:
        """Every rank at the same gather number, each gathering a leftover unit."""
        if not self.tolerant or self.leftovers_held or len({row[0] for row in rows}) != 1:
            return False
        indices = [row[1] & ~BACKWARD_MARK for row in rows]
        return all(0 <= i < len(self.flats) and not self.unit_of[self.flats[i]].from_policy for i in indices)

    def _hold_leftovers(self) -> None:
        """See [Note: unit order across ranks]: drain what is in flight, then gather every
        leftover unit again in unit order, identically on every rank."""
        self.leftovers_held = True
        self._drain_in_flight()
        for unit in self.leftovers:
            for flat in unit.flats:
                if flat.state is not ShardState.SHARDED:
                    flat.reshard()  # its values may be another unit's: gathered again below
        self._gather_leftovers()

    def _drain_in_flight(self) -> None:
        """Pair up the gathers issued after a recovered mismatch, whose values are not used.
        Ranks may have issued different numbers of them (a prefetch, then a gather of a unit
        the others do not run), so each rank completes its own in issue order and, with none
        left, sends empty fillers, a round at a time, until a round in which every rank sent
        one: every rank sees every tag of every round, so all stop at the same one."""
        pending = collections.deque(self._in_flight)
        self._in_flight.clear()
        while True:
            if pending:
                flat = pending.popleft()
                rows = flat.drop_gather()
                self._received(flat)
            else:
                send, _ = C.tagged_buffer(0, torch.uint8, self.flats[0].device)
                filler = torch.empty(0, dtype=torch.uint8, device=self.flats[0].device)
                tag = (self._sequence, self._filler_index)
                self._sequence += 1
                rows = self.wait_clock.wait(C.all_gather_tagged(
                    filler, send, tag, max_shard_bytes=self.max_shard_bytes, group=self.group, stats=self.comm,
                    kind="control"), gather=True)
            if all(row[1] == self._filler_index for row in rows):
                return

    def _gather_leftovers(self) -> None:
        for unit in self.leftovers:
            self.wait(unit)

    def unshard(self, unit: Unit) -> None:
        with torch.no_grad():
            for flat in unit.needed():
                if flat.state is ShardState.SHARDED:
                    flat.start_unshard(self._issue)

    def wait(self, unit: Unit) -> None:
        self.unshard(unit)
        needed = unit.needed()
        for flat in needed:
            flat.wait_unsharded()
        if any(flat.state is ShardState.SHARDED for flat in needed):
            self.wait(unit)  # a recovery drained a gather of it (see _drain_in_flight): again

    def reshard(self, unit: Unit, flats: Sequence[FlatParamGroup] | None = None) -> None:
        for flat in flats if flats is not None else unit.flats:
            flat.reshard()

    def gathers_per_step(self) -> list[tuple[int, torch.dtype]]:
        """Every unit's groups before its forward, and again before its backward when
        ``reshard_after_forward``, except the units the last forward kept gathered into
        backward ([Note: kept for backward]); each unit used once per pass."""
        gathers = [(flat.layout.numel, flat.dtype) for flat in self.flats]
        if not self.reshard_after_forward:
            return gathers
        kept = {flat for unit in self.last_kept for flat in unit.flats}
        return gathers + [(flat.layout.numel, flat.dtype) for flat in self.flats if flat not in kept]

    def memory_stats(self) -> dict[str, int]:
        return {
            "peak_params": self.peak_params_bytes,
            "gather_buffers": self.receive_buffers.now,  # what a gather receives into
            "peak_gather_buffers": self.receive_buffers.peak,
        }

    def params_bytes(self) -> int:
        return self._shard_bytes + self.gathered.now

    @property
    def peak_params_bytes(self) -> int:
        return self._shard_bytes + self.gathered.peak

    # ------------------------------------------------------------------ prefetch

    def _predict(self, current: list[Unit], history: Sequence[Unit], count: int) -> list[Unit]:
        """The next ``count`` units the recorded order runs after the uses seen so far (nothing
        once the present departs from the record)."""
        k = len(current)
        if count == 0 or len(history) < k or history[k - 1] is not current[-1]:
            return []
        return list(history[k : k + count])

    def _prefetch(self, units: list[Unit]) -> None:
        for unit in units:
            if unit.from_policy or not self.leftovers_held:  # held leftovers follow the root
                self.unshard(unit)

    # ------------------------------------------------------------------ hooks

    def begin_forward(self) -> None:
        """The root's forward starts (not a recompute)."""
        self._history[self._pass_key] = self._pass
        self._pass, self._pass_key = [], torch.is_grad_enabled()
        self.state.unit = None  # no unit of this forward yet (for reports)
        if self._forward_uses:
            self._last_forward = self._forward_uses
        self._forward_uses = []
        self._forget_running()
        self._free_deferred()  # no backward ran since that forward: the shards may have changed
        if self.leftovers_held:
            self._gather_leftovers()

    def begin_backward(self) -> None:
        """The root's backward starts."""
        self._checked_in_backward = self._reductions_waiting = False
        if self.leftovers_held:
            self._gather_leftovers()

    def end_forward(self) -> None:
        """The root's forward ended: gathers prefetched for units that never ran are done and
        freed (a branch not taken), as are gathered units when no backward will follow."""
        keep = self._forward_ended if torch.is_grad_enabled() else []
        self._kept_for_backward, self._forward_ended = list(keep), []
        self.last_kept = list(keep)
        for unit in self.units:
            if unit in keep:
                continue
            for flat in unit.flats:
                if flat.state is ShardState.GATHERING or (
                    flat.state is ShardState.UNSHARDED and not self.hold_for_double_backward
                    and (self.reshard_after_forward or not torch.is_grad_enabled())
                ):
                    flat.reshard()

    def abandon_forward(self) -> None:
        """The root's forward raised: the units whose release was deferred to the next unit or
        the forward's end are freed now. Nothing else is touched: gathers in flight may be
        ones other ranks never issued (a unit order mismatch)."""
        self._forget_running()
        self._free_deferred()

    def _free_deferred(self) -> None:
        """Free every unit whose release was deferred ([Note: kept for backward])."""
        self._free_forward_ended(None)
        self._free_kept()

    def pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.state.is_recompute():
            # A unit recomputed after its gradients were final in this backward: reentrant
            # checkpointing of one module twice. More gradients will follow (late ones; see
            # [Note: a gradient that arrives twice] in reducer.py), so it is gathered again.
            unit.final.clear()
            self.wait(unit)  # usually gathered by its pre-backward already
            self._allow_waiting_reductions()
            unit.running += 1
            return self._hook_inputs(unit, args, kwargs)
        self._forward_uses.append(unit)
        self.state.unit = (Phase.FORWARD, self.state.backward_count, unit.name, torch.is_grad_enabled())  # reports
        self.on_forward_use(unit)
        self._free_forward_ended(unit)
        self.wait(unit)
        self._prefetch(self._predict(self._forward_uses, self._last_forward, self.forward_prefetch))
        unit.running += 1
        return self._hook_inputs(unit, args, kwargs)

    def enter(self, unit: Unit, module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """An entry module of ``unit`` starts its forward: a use of the unit, unless one is in
        progress (see [Note: entry modules] in units.py)."""
        if unit.running:
            return None
        result = self.pre_forward(unit, args, kwargs)
        unit.entered_by = module
        return result

    def leave(self, unit: Unit, module: Any, output: Any) -> None:
        """An entry module's forward ended (or raised): the use it started, if any, ends."""
        if unit.entered_by is module:
            unit.entered_by = None
            self.post_forward(unit, output)

    def _forget_running(self) -> None:
        """Uses a raised forward (or a recompute that checkpointing stopped early) never ended."""
        for unit in self.units:
            unit.running, unit.entered_by = 0, None

    def post_forward(self, unit: Unit, output: Any) -> None:
        unit.running = max(unit.running - 1, 0)
        if torch.is_grad_enabled():
            tensors = _grad_tensors(output)
            if tensors:
                on_first_grad(tensors, self._pre_backward_hooks[unit])
        if self.state.is_recompute() or self._kept_gathered(unit):
            return  # the recomputed graph is about to use the storage
        if unit.running:
            return  # a use of it is still running (a registered method called from its forward)
        if not self.reshard_after_forward and torch.is_grad_enabled():
            return  # stays gathered until its backward
        if self.state.phase is not Phase.FORWARD:
            self.reshard(unit)  # called outside the root's forward: nothing to keep it for
        elif unit not in self._forward_ended:
            self._forward_ended.append(unit)  # see [Note: kept for backward]

    def _free_forward_ended(self, starting: Unit | None) -> None:
        for unit in self._forward_ended:
            if unit is not starting:
                self.reshard(unit)
        self._forward_ended.clear()

    def _kept_gathered(self, unit: Unit) -> bool:
        """Whether ``unit`` stays gathered past its use: held leftovers follow the root, and a
        graph made by a double backward still multiplies by every gathered unit."""
        return self.hold_for_double_backward or (self.leftovers_held and not unit.from_policy)

    def _hook_inputs(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not torch.is_grad_enabled():
            return None
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):  # block(x): no tree walk
            leaves, spec = list(args), None
        else:
            leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None  # freed when its gradients are final, or at the end of backward
        outputs = _PostBackward.apply(self, unit, *[leaves[i] for i in positions])
        for i, tensor in zip(positions, outputs):
            leaves[i] = tensor
        return (tuple(leaves), kwargs) if spec is None else tree_unflatten(leaves, spec)

    def pre_backward(self, unit: Unit) -> None:
        self.on_backward_start()
        if torch.is_grad_enabled():  # inside backward only with create_graph=True
            self._backward_creates_graph = self.hold_for_double_backward = True
        if unit.backward_done:
            return
        if self._kept_for_backward:
            self._release_kept(unit)
        unit.active_backward += 1
        self._backward_uses.append(unit)
        self.state.unit = (Phase.BACKWARD, self.state.backward_count, unit.name, True)  # for reports only
        self.wait(unit)
        self._allow_waiting_reductions()  # before the prefetch below, which it would wait for
        history = self._last_backward or self._last_forward_reversed()
        predicted = self._predict(self._backward_uses, history, self.backward_prefetch)
        self._prefetch([u for u in predicted if not u.backward_done])

    def _release_kept(self, starting: Unit) -> None:
        if starting in self._kept_for_backward:
            self._kept_for_backward.remove(starting)
            return
        self._free_kept()

    def _free_kept(self) -> None:
        for unit in self._kept_for_backward:
            if not self._kept_gathered(unit):
                self.reshard(unit)
        self._kept_for_backward = []

    def _last_forward_reversed(self) -> list[Unit]:
        uses = self._forward_uses or self._last_forward
        return uses[::-1]

    def post_backward(self, unit: Unit) -> None:
        if unit.active_backward > 0:
            unit.active_backward -= 1
        if unit.active_backward == 0 and not self._kept_gathered(unit):
            self.reshard(unit)

    def grads_final(self, flat: FlatParamGroup) -> None:
        """All gradients of a trainable group are final: its parameters are not needed again
        in this backward (every node using them has run)."""
        unit = self.unit_of[flat]
        unit.final.add(flat)
        if not self.hold_for_double_backward:
            flat.reshard()

    def finish_backward(self) -> None:
        keep = self._backward_creates_graph  # the graph it made still multiplies by them
        self._backward_creates_graph = False
        self.hold_for_double_backward = keep
        for unit in self.units:
            if not keep:
                self.reshard(unit)
            unit.active_backward = 0
            unit.final.clear()
        self._kept_for_backward = []
        self._forget_running()
        if self._backward_uses:
            self._last_backward = self._backward_uses
        self._backward_uses = []
        self._checked_below = self._sequence
