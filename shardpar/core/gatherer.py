"""Stage 3's parameter gatherer: per-unit gather and free with prefetch (the unit order across
ranks is checked in unit_order.py; stages 0-2's gatherers are in gather_phases.py). It installs
no hook: the engine's hook layer (``UnitHooks`` in engines/module_hooks.py) hooks each unit's
modules, a use's inputs and its outputs, and calls down into the methods here.

[Note: one step at stage 3]
forward:  a unit's hook module is about to run -> free the units whose forward ended
          since the last unit started -> gather the unit (or wait for its prefetched
          gather) -> prefetch the next ``forward_prefetch_units`` units of the last forward's order
          -> run -> hook its outputs; it is freed when the next unit starts
          (``reshard_after_forward``, or no autograd), or kept for backward (below).
backward: a hook on a use's outputs fires before that use's backward -> gather again,
          prefetch the next ``backward_prefetch_units`` units of the last backward's order (the
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

A kept unit changes what [Note: unit order across ranks] (unit_order.py) relies on:
backward no longer starts with a gather, so a rank that departed from the others' order
could compute and post gradient reductions before any gather of its backward showed the
mismatch -- and a rank that raises then leaves the others' reductions unmatched on the
process group. Hence no reduction of a backward is posted until a gather of that backward
has been checked (``may_reduce``, asked by the backward path, [Note: a gradient's path
through backward] in backward_paths.py: it completes the gathers in flight, usually the
prefetch the first kept unit issued; with no prefetch the reductions wait for the next
unit's gather), and gathers are always completed in the order they were issued
(``UnitOrder.pop_earlier``, before every wait), so every rank meets the first mismatching
gather before any later collective.
output that hides its tensors (a use whose output holds no tensor at all where torch's pytree
          looks: an object of the model's own class, or nothing, the result handed out some
          other way): no hook can start that use's backward, yet autograd reaches its
          parameters through the tensors it hides. Freed, the parameters would be read by
          that backward as what stands in for them, so the unit is held gathered instead
          (:meth:`UnitGatherer.hold_until_backward`) until its backward is over: backward
          reaches its inputs or its gradients are final, or else at the end of backward (or
          at the next forward, if no backward follows). It costs the unit's full size
          through forward, nothing else.
double backward (``torch.autograd.grad(..., create_graph=True)``, a gradient penalty): the
          graph that backward creates saves the gathered parameters it multiplied by, and a
          later backward runs through it. So from a backward that creates a graph until the
          end of the next backward that does not, no unit is freed (after a forward or during
          backward); they are freed at that backward's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..comm import collectives as C
from .flat_param import FlatParamGroup, GatheredBytes, ShardState
from .gather_phases import GatherPhases
from .training_state import Phase, TrainingState
from .unit_order import UnitOrder
from .units import Unit
from .wait_clock import WaitClock

_autograd_task = torch._C._current_graph_task_id
"""-1 outside backward: what :meth:`TrainingState.is_recompute` asks, read here without the
method's call (twice per unit use)."""


class UnitGatherer(GatherPhases):
    """Stage 3; see [Note: one step at stage 3] and [Note: unit order across ranks] (unit_order.py).
    It issues every gather and waits for it (the flat groups only record their state), and is
    the :class:`~.flat_param.GatherWaiter` a guarded parameter read waits through."""

    def __init__(
        self,
        units: list[Unit],
        state: TrainingState,
        reshard_after_forward: bool,
        forward_prefetch_units: int,
        backward_prefetch_units: int,
        comm: C.CommStats,
        group: Any,
        sibling_of: Any,
        rank: int,
        wait_clock: WaitClock,
    ) -> None:
        self.units = units
        self.state = state
        self.reshard_after_forward = reshard_after_forward
        self.forward_prefetch_units = forward_prefetch_units
        """Units of the last forward's order gathered ahead of the one computing in forward."""
        self.backward_prefetch_units = backward_prefetch_units
        """Units of the last backward's order gathered ahead of the one computing in backward."""
        self.comm = comm
        self.group = group
        self.rank = rank
        self.order = UnitOrder(units, state, comm, group, rank, wait_clock, sibling_of)
        """The gathers' tags, their checks and the recovery of [Note: unit order across ranks]."""
        self.flats, self.unit_of = self.order.flats, self.order.unit_of
        self.wait_clock = wait_clock
        self._forward_uses: list[Unit] = []
        self._last_forward: list[Unit] = []
        self._backward_uses: list[Unit] = []
        self._last_backward: list[Unit] = []
        self.hold_for_double_backward = False
        """A backward created a graph (create_graph=True) that uses gathered parameters; see
        [Note: one step at stage 3], "double backward"."""
        self._backward_creates_graph = False
        self._forward_ended: list[Unit] = []
        """Units whose forward ended since the last unit's forward started: freed when another
        unit's forward starts, kept for backward if the root's forward ends first."""
        self._kept_for_backward: list[Unit] = []
        self.last_kept: list[Unit] = []
        """The units the last forward kept gathered into backward (one gather fewer each: gathers_per_step)."""
        self._held: list[Unit] = []
        """Units whose output hides its tensors, held gathered until their backward is over
        (see [Note: one step at stage 3], "output that hides its tensors")."""
        self._shard_bytes = sum(f.shard_bytes for f in self.flats)
        self.gathered = GatheredBytes(sum(f.allocated_full_bytes() for f in self.flats))
        # Off the CPU a gather that cannot be told apart is checked later, see [Note: deferred
        # tag checks] in unit_order.py; on the CPU a wait blocks anyway.
        self._checked_later = not self.order.tolerant and self.flats[0].device.type != "cpu"
        """Reductions need no gather of their backward checked first (see :meth:`reductions_allowed`)."""

    def may_reduce(self) -> bool:
        """Whether this backward's gradient reductions may be posted: once a gather of this
        backward has been checked (see [Note: kept for backward]). Completes the gathers in
        flight first if none has been."""
        order = self.order
        if self._checked_later or order.checked_in_backward:  # what reductions_allowed answers
            return True
        if order.in_flight:
            self._complete_in_flight()
        if not order.checked_in_backward and not order.tolerant:
            order.check_tags(block=True)
        return order.checked_in_backward

    def reductions_allowed(self) -> bool:
        """:meth:`may_reduce`'s answer without completing or checking anything."""
        return self._checked_later or self.order.checked_in_backward

    # ------------------------------------------------------------------ tag checks (unit_order.py)

    def check_tags(self, block: bool, below: int | None = None) -> None:
        self.order.check_tags(block, below)

    def check_previous_backward(self) -> None:
        self.order.check_previous_backward()

    def exchange(self, values: list[int]) -> list[list[int]]:
        self._complete_in_flight()  # checked first, as before any wait, and nothing left to drain
        return self.order.exchange(values)

    # ------------------------------------------------------------------ gathers

    def unshard(self, unit: Unit) -> None:
        """Start the gathers of ``unit``'s sharded groups (tagged: UnitOrder.issue): each
        group's full buffer allocated (metered), its gather issued, the group told."""
        for flat in unit.needed:
            if flat.state is ShardState.SHARDED:
                # No autograd context: nothing here records a graph (the shards and full
                # buffers are plain tensors that never require a gradient).
                self.gathered.add(flat.allocate_full())
                flat.begin_gather(self.order.issue(flat), self)

    def wait(self, unit: Unit) -> None:
        """``unit`` gathered: its gathers started if they were not, and completed."""
        needed = unit.needed
        for flat in needed:
            if flat.state is ShardState.SHARDED:
                self.unshard(unit)
                break
        for flat in needed:
            if flat.state is not ShardState.UNSHARDED:
                assert flat.state is ShardState.GATHERING, f"'{flat.label}' is {flat.state.value}, not gathering"
                self.wait_for_gather(flat)
        for flat in needed:
            if flat.state is ShardState.SHARDED:
                self.wait(unit)  # a recovery drained a gather of it (see UnitOrder.drain_in_flight): again
                return

    def wait_for_gather(self, flat: FlatParamGroup) -> None:
        """Complete ``flat``'s gather, after every gather issued before it ([Note: kept for
        backward]), checking each one's tags; the :class:`~.flat_param.GatherWaiter` of every
        group it gathers."""
        order = self.order
        if order.in_flight and order.in_flight[0] is flat:
            order.in_flight.popleft()  # the usual case: flat's is the first gather in flight
        else:
            while (earlier := order.pop_earlier(flat)) is not None:
                self._wait_flat(earlier)
        if flat.state is not ShardState.GATHERING:
            return  # completed or dropped by a recovery while earlier gathers were waited for
        handle = flat.handle  # complete_gather lets go of it
        assert handle is not None, f"'{flat.label}' has no gather to wait for"
        result = self.wait_clock.wait(handle, gather=True)
        flat.complete_gather()
        if order.check_gather(flat, result):
            self._hold_leftovers()

    def _wait_flat(self, flat: FlatParamGroup) -> None:
        if flat.state is ShardState.UNSHARDED:
            return
        assert flat.state is ShardState.GATHERING, f"'{flat.label}' is {flat.state.value}, not gathering"
        self.wait_for_gather(flat)

    def _complete_in_flight(self) -> None:
        """Wait for (and check) every gather issued so far."""
        while self.order.in_flight:
            self._wait_flat(self.order.in_flight[0])

    def _free(self, flat: FlatParamGroup) -> None:
        """Free ``flat``'s full buffer; a gather still in flight is waited for first, so no
        collective ever writes into freed memory."""
        if flat.state is ShardState.GATHERING:
            self.wait_for_gather(flat)
        self.gathered.now -= flat.reshard()  # (a free never raises the peak: no call to GatheredBytes.add)

    def reshard(self, unit: Unit, flats: Sequence[FlatParamGroup] | None = None) -> None:
        """Free ``unit``'s groups (``flats``: those of them), as :meth:`_free` each; the bytes
        freed are metered once (a free never raises the peak)."""
        freed = 0
        for flat in flats if flats is not None else unit.flats:
            if flat.state is ShardState.SHARDED:
                continue
            if flat.state is ShardState.GATHERING:
                self.gathered.now -= freed  # metered before a recovery there may gather more
                freed = 0
                self.wait_for_gather(flat)
            freed += flat.reshard()
        self.gathered.now -= freed  # a free never raises the peak

    def _hold_leftovers(self) -> None:
        """Ranks ran different leftover units (see [Note: unit order across ranks]): drain what
        is in flight, then gather every leftover unit again in unit order, identically on every
        rank."""
        for flat in self.order.drain_in_flight():
            self._free(flat)
        for unit in self.order.leftovers:
            for flat in unit.flats:
                if flat.state is not ShardState.SHARDED:
                    self._free(flat)  # its values may be another unit's: gathered again below
        self._gather_leftovers()

    def _gather_leftovers(self) -> None:
        """Gather every leftover unit, in unit order (held: see [Note: unit order across ranks])."""
        for unit in self.order.leftovers:
            self.wait(unit)

    def follow_placement(self) -> None:
        self.order.follow_placement()

    def gathers_per_step(self) -> list[tuple[int, torch.dtype]]:
        """Every unit's groups before its forward, and again before its backward when
        ``reshard_after_forward``, except the units the last forward kept gathered into
        backward ([Note: kept for backward]); each unit used once per pass."""
        gathers = [(flat.layout.numel, flat.dtype) for flat in self.flats]
        if not self.reshard_after_forward:
            return gathers
        kept = {flat for unit in self.last_kept + self._held for flat in unit.flats}
        return gathers + [(flat.layout.numel, flat.dtype) for flat in self.flats if flat not in kept]

    def memory_stats(self) -> dict[str, int]:
        return {
            "peak_params": self.peak_params_bytes,
            "gather_buffers": self.order.receive_buffers.now,  # what a gather receives into
            "peak_gather_buffers": self.order.receive_buffers.peak,
        }

    def params_bytes(self) -> int:
        return self._shard_bytes + self.gathered.now

    @property
    def peak_params_bytes(self) -> int:
        return self._shard_bytes + self.gathered.peak

    # ------------------------------------------------------------------ prefetch

    def _prefetch(self, current: list[Unit], history: Sequence[Unit], count: int, backward: bool) -> None:
        """Start the gathers of the next ``count`` units the recorded order ``history`` runs
        after the uses seen so far, ``current`` (none once the present departs from the
        record; in ``backward`` none whose gradients are already final)."""
        k = len(current)
        if count == 0 or len(history) < k or history[k - 1] is not current[-1]:
            return
        leftovers_held = self.order.leftovers_held
        for unit in history[k : k + count]:
            if backward and unit.backward_done:
                continue
            if unit.from_policy or not leftovers_held:  # held leftovers follow the root
                self.unshard(unit)

    # ------------------------------------------------------------------ hooks

    def begin_forward(self) -> None:
        """The root's forward starts (not a recompute)."""
        self.order.begin_pass()
        self.state.unit = None  # no unit of this forward yet (for reports)
        if self._forward_uses:
            self._last_forward = self._forward_uses
        self._forward_uses = []
        self._forget_running()
        self._free_deferred()  # no backward ran since that forward: the shards may have changed
        if self.order.leftovers_held:
            self._gather_leftovers()

    def begin_backward(self) -> None:
        """The root's backward starts."""
        self.order.begin_backward()
        if self.order.leftovers_held:
            self._gather_leftovers()

    def end_forward(self) -> None:
        """The root's forward ended: gathers prefetched for units that never ran are done and
        freed (a branch not taken), as are gathered units when no backward will follow."""
        keep = self._forward_ended if torch.is_grad_enabled() else []
        self._kept_for_backward, self._forward_ended = list(keep), []
        self.last_kept = list(keep)
        for unit in self.units:
            if unit in keep or unit in self._held:
                continue
            for flat in unit.flats:
                if flat.state is ShardState.GATHERING or (
                    flat.state is ShardState.UNSHARDED
                    and not self.hold_for_double_backward
                    and (self.reshard_after_forward or not torch.is_grad_enabled())
                ):
                    self._free(flat)

    def abandon_forward(self) -> None:
        """The root's forward raised: the units whose release was deferred to the next unit or
        the forward's end are freed now. Nothing else is touched: gathers in flight may be
        ones other ranks never issued (a unit order mismatch)."""
        self._forget_running()
        self._free_deferred()

    def _free_deferred(self) -> None:
        """Free every unit whose release was deferred ([Note: kept for backward]), and the
        units held for a backward that did not come."""
        self._free_forward_ended(None)
        self._free_kept()
        for unit in self._held:
            self.reshard(unit)
        self._held = []

    def pre_forward(self, unit: Unit) -> None:
        """A use of ``unit`` starts (its hook module's forward): gathered, with the next units
        prefetched, or (a recompute) gathered again. The hook layer then hooks the use's
        inputs for :meth:`post_backward`."""
        if _autograd_task() != -1:  # a recompute (TrainingState.is_recompute, asked without a call)
            # A unit recomputed after its gradients were final in this backward: reentrant
            # checkpointing of one module twice. More gradients will follow (late ones; see
            # [Note: a gradient that arrives twice] in reducer.py), so it is gathered again.
            unit.clear_final()
            self.wait(unit)  # usually gathered by its pre-backward already
            unit.running += 1
            return
        self._forward_uses.append(unit)
        self.state.unit = (Phase.FORWARD, self.state.backward_count, unit.name, torch.is_grad_enabled())  # reports
        for ended in self._forward_ended:  # free the units whose forward ended since the last use
            if ended is not unit:
                self.reshard(ended)
        self._forward_ended.clear()
        self.wait(unit)
        self._prefetch(self._forward_uses, self._last_forward, self.forward_prefetch_units, backward=False)
        unit.running += 1

    def enter(self, unit: Unit, module: Any) -> bool:
        """An entry module of ``unit`` starts its forward: whether that starts a use of the unit
        (as :meth:`pre_forward`), which it does unless one is in progress (see [Note: entry
        modules] in units.py)."""
        if unit.running:
            return False
        self.pre_forward(unit)
        unit.entered_by = module
        return True

    def leave(self, unit: Unit, module: Any) -> bool:
        """An entry module's forward ended (or raised): whether that ended the use it started
        (as :meth:`post_forward`)."""
        if unit.entered_by is not module:
            return False
        unit.entered_by = None
        self.post_forward(unit)
        return True

    def _forget_running(self) -> None:
        """Uses a raised forward (or a recompute that checkpointing stopped early) never ended."""
        for unit in self.units:
            unit.running, unit.entered_by = 0, None

    def post_forward(self, unit: Unit) -> None:
        """A use of ``unit`` ended in forward (the hook layer then hooks its outputs for
        :meth:`pre_backward`): freed now, when the next unit starts, or kept."""
        unit.running = max(unit.running - 1, 0)
        if self._kept_gathered(unit) or _autograd_task() != -1:  # (-1: not a recompute)
            return  # the recomputed graph is about to use the storage
        if unit.running:
            return  # a use of it is still running (a registered method called from its forward)
        if not self.reshard_after_forward and torch.is_grad_enabled():
            return  # stays gathered until its backward
        if self.state.phase is not Phase.FORWARD:
            self.reshard(unit)  # called outside the root's forward: nothing to keep it for
        elif unit not in self._forward_ended:
            self._forward_ended.append(unit)  # see [Note: kept for backward]

    def hold_until_backward(self, unit: Unit) -> None:
        """A use of ``unit`` ended whose output hides its tensors: the unit stays gathered
        until its backward is over (see [Note: one step at stage 3], "output that hides its
        tensors"); gathered again if it was freed already (a use outside the root's forward)."""
        if unit in self._forward_ended:
            self._forward_ended.remove(unit)
        if unit not in self._held:
            self._held.append(unit)
        self.wait(unit)

    def _free_forward_ended(self, starting: Unit | None) -> None:
        for unit in self._forward_ended:
            if unit is not starting:
                self.reshard(unit)
        self._forward_ended.clear()

    def _kept_gathered(self, unit: Unit) -> bool:
        """Whether ``unit`` stays gathered past its use: held leftovers follow the root, and a
        graph made by a double backward still multiplies by every gathered unit."""
        return self.hold_for_double_backward or (self.order.leftovers_held and not unit.from_policy)

    def pre_backward(self, unit: Unit) -> None:
        """The first gradient of a use's outputs was computed: that use's backward starts."""
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
        history = self._last_backward or self._last_forward_reversed()
        self._prefetch(self._backward_uses, history, self.backward_prefetch_units, backward=True)

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
        """Backward reached a use's inputs: that use's backward is over."""
        if unit.active_backward > 0:
            unit.active_backward -= 1
        if unit.active_backward == 0 and not self._kept_gathered(unit):
            self.reshard(unit)

    def grads_final(self, flat: FlatParamGroup) -> None:
        """All gradients of a trainable group are final: its parameters are not needed again
        in this backward (every node using them has run)."""
        self.unit_of[flat].mark_final(flat)
        if not self.hold_for_double_backward:  # free the group (its gather completed first)
            if flat.state is ShardState.GATHERING:
                self.wait_for_gather(flat)
            self.gathered.now -= flat.reshard()  # a free never raises the peak

    def finish_backward(self) -> None:
        keep = self._backward_creates_graph  # the graph it made still multiplies by them
        self._backward_creates_graph = False
        self.hold_for_double_backward = keep
        for unit in self.units:
            if not keep:
                for flat in unit.flats:
                    if flat.state is not ShardState.SHARDED:
                        self.reshard(unit)  # (asked first: most units were freed by their backward)
                        break
            unit.active_backward = 0
            if unit.final:
                unit.clear_final()
        self._kept_for_backward = []
        self._held = []
        self._forget_running()
        if self._backward_uses:
            self._last_backward = self._backward_uses
        self._backward_uses = []
        self.order.end_backward()
