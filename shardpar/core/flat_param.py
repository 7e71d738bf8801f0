"""Flat parameter groups: parameters of one dtype stored back to back, with an explicit state.

[Note: flat parameter groups]
A :class:`FlatParamGroup` owns one dtype's parameters laid out by a one-bucket
:class:`~shardpar.core.layout.BufferLayout`: a 1-D *full* buffer (compute dtype; padded to a
multiple of N) and this rank's *shard* of it (slice r, in the dtype the optimizer updates).
Its state says which of the two the parameters are views of right now:

    SHARDED ──begin_gather()──▶ GATHERING ──complete_gather()──▶ UNSHARDED ──reshard()──▶ SHARDED

The group is passive, as FSDP2's parameter group is below its ``unshard``/``wait_for_unshard``:
its *gatherer* (stages 1-2: the post-step gatherer; stage 3: the unit gatherer) allocates the
full buffer (``allocate_full``), issues the all-gather, hands the handle to ``begin_gather``,
and later waits for it and calls ``complete_gather``; the group only records the state and
handle, points its parameters at views and guards them, and says how many bytes of full
storage each step allocated or freed, so that the gatherer meters them. The one way back up
is the :class:`GatherWaiter` handed down with the handle: code that holds a parameter or a
group but not its gatherer (a guarded parameter read while gathering, stages 1-2's use
hooks) waits through ``wait_unsharded``, which asks that waiter to complete the gather as
the gatherer always does (stage 3: after every gather issued before it, its tags checked).

- stage 3: one group per (unit, dtype, trainable). The shard is the only persistent copy; the
  full buffer's storage exists only while GATHERING/UNSHARDED (it is resized to 0 by
  ``reshard``, never replaced, so tensors autograd saved in forward see the values again once
  the next gather refills the same storage). The parameters stay views of the full buffer
  from the group's first free on, sharded or not: freed, a view has no storage to read (see
  [Note: guarded parameters]), and the next gather gives it its values back with no
  ``.data`` assignment (two per parameter per gather otherwise). Only a new layout
  (``move_to``) or a borrow of the parameters (the facade's full values) points them
  elsewhere: the group points them back at its next transition, the borrower when it is done.
- stages 1-2: one group per gradient bucket, a view of the replicated buffer whose owned slice
  the optimizer updated; after ``step()`` it is GATHERING until the first module using it runs
  (it never reshards). Its parameters are views of the same memory already (the replicated
  buffer's), pointed at the group's own views at its first gather; a relayout of the buffer
  makes new groups.

While not UNSHARDED the parameters are guarded ([Note: guarded parameters] in
``param_guard.py``): a pending parameter waits for its gather when read, a sharded one raises
naming itself and its unit. A group is *born sharded*: it needs only names, shapes and
dtypes; the values arrive in the shard from wherever they come from (a rank's live module,
an initialisation run one unit at a time, checkpoint or Hugging Face byte ranges). No rank
ever needs the full group except while it is gathered.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Sequence
from typing import Protocol, cast

import torch
from torch import nn

from ..comm import collectives as C
from .layout import Bucket, BufferLayout
from .param_guard import forget_guards, guard_all, set_guard, unguard_all


class ShardState(enum.Enum):
    SHARDED = "sharded"
    """Only this rank's shard exists."""
    GATHERING = "gathering"
    """The full buffer is allocated and an all-gather into it is in flight."""
    UNSHARDED = "unsharded"
    """The full parameters are valid; the parameters are views of them."""


class GatherWaiter(Protocol):
    """Who completes a group's gather in flight: the gatherer that issued it, handed to
    :meth:`FlatParamGroup.begin_gather` with the handle (see [Note: flat parameter groups])."""

    def wait_for_gather(self, flat: FlatParamGroup) -> None:
        """Wait for ``flat``'s gather and complete it (``flat`` is GATHERING)."""
        ...


class ShardedParameterAccess(RuntimeError):
    """Code read (or wrote) a stage-3 parameter while its unit is sharded."""

    def __init__(self, message: str, name: str, unit: str) -> None:
        super().__init__(message)
        self.name = name
        self.unit = unit


class _ParamAccess:
    """The guard of one parameter of a group (see param_guard.py), registered once: what a read
    of it does depends on the group's state. While the group gathers, the read waits for the
    gather (through the gatherer that issued it); while it is sharded (stage 3), the read is an
    error naming the parameter and its unit."""

    def __init__(self, group: FlatParamGroup, name: str) -> None:
        self._group = weakref.ref(group)
        """Weakly: the guard table outlives groups, and the group holds the parameter (a strong
        reference from the table would keep a dropped model alive); the group takes its guards
        out of the table when it goes."""
        self.name = name

    @property
    def group(self) -> FlatParamGroup:
        group = self._group()
        if group is None:
            raise RuntimeError(f"parameter '{self.name}' is guarded by a shardpar engine that no longer exists")
        return group

    def on_access(self, param: nn.Parameter, operation: str) -> None:
        group = self.group
        if group.state is ShardState.GATHERING:
            group.wait_unsharded()
            return
        if group.state is ShardState.UNSHARDED:
            return  # guarded again after its gather completed (model.gathered() gives guards back): usable
        raise ShardedParameterAccess(
            f"parameter '{self.name}' of stage-3 unit '{group.unit}' was read ({operation}) while the unit "
            "is sharded: its values exist only while the forward (or backward) of a module of that unit runs, "
            "or a method of such a module declared with shardpar.register_forward_method(module, 'method_name') "
            "(a generate that reads parameters directly). Read parameters of another unit only inside that "
            "unit's modules (register the module under the unit that uses it, or tie the weight by "
            "registration), and read full values outside forward with model.full_state_dict(). Code that needs "
            "whole parameters and their gradients between backward and step (per-parameter clipping such as "
            "timm's adaptive gradient clipping) needs stage=0: only stage 0 keeps whole gradients",
            self.name,
            group.unit,
        )

    def __str__(self) -> str:
        group = self.group
        if group.state is ShardState.GATHERING:
            return f"all-gather of '{group.label}' in flight"
        return f"sharded, unit '{group.unit}'"


class GatheredBytes:
    """Bytes of full buffers allocated right now, and the most ever, over the groups a gatherer
    meters (stage 3: every unit's groups). Kept as the buffers are allocated (:meth:`add`) and
    freed (``now`` lowered: a free never raises the peak), the bytes each transition of a group
    returns, so the peak costs nothing per gather."""

    def __init__(self, now: int) -> None:
        self.now = now
        self.peak = now

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


class FlatParamGroup:
    """See [Note: flat parameter groups]."""

    def __init__(
        self,
        label: str,
        unit: str,
        named: Sequence[tuple[str, nn.Parameter]],
        layout: BufferLayout,
        full: torch.Tensor,
        shard: torch.Tensor,
        rank: int,
        frees_storage: bool,
        trainable: bool,
    ) -> None:
        assert len(layout.buckets) == 1, "a flat parameter group is one bucket"
        self.label = label
        self.unit = unit
        self.params = dict(named)
        self.shard = shard  # 1-D, master dtype, numel = layout.shard_numel
        self.rank = rank
        self.frees_storage = frees_storage
        self.trainable = trainable
        self.state = ShardState.UNSHARDED
        self.handle: C.Handle | None = None
        self.tagged_shard: torch.Tensor | None = None
        """Stage 3: the shard's storage as bytes, with room for a gather tag in front."""
        self.waiter: GatherWaiter | None = None
        """Who completes the gather in flight (given to :meth:`begin_gather` with its handle)."""
        self._lay_out(layout, full)
        # Made once, in parameter order: a transition only walks this list, switching each
        # parameter's class (no per-parameter call; each parameter's guard is registered once,
        # here: see [Note: guarded parameters] in param_guard.py).
        self._param_list = list(self.params.values())
        guards = [(id(param), _ParamAccess(self, name)) for name, param in self.params.items()]
        for param, (_, access) in zip(self._param_list, guards):
            set_guard(param, access)
        weakref.finalize(self, forget_guards, guards)  # their parameters may go with this group

    def _lay_out(self, layout: BufferLayout, full: torch.Tensor) -> None:
        self.layout = layout
        self.full = full  # 1-D, compute dtype, numel = layout.numel (padded)
        # Stage 3's full buffers have a gather tag's room in front in their storage (see
        # tagged_gather.gather_target); the room is not counted in the byte figures.
        # (an eager tensor's storage offset is an int; torch's stubs allow a SymInt for tracing)
        self._storage_bytes = cast(int, (full.storage_offset() + full.numel()) * full.element_size())
        self._views = {name: layout.view(full, name) for name in self.params}
        self._view_list = list(self._views.values())
        self._params_on_views = False
        """Whether the parameters are this layout's views now, which a transition then need
        not say again."""
        self.full_bytes = layout.numel * full.element_size()
        """Bytes of the full buffer while allocated (the tag's room in front not counted)."""

    def move_to(self, layout: BufferLayout, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Stage 3, sharded: lay the group out anew ([Note: whole-tensor ownership] in
        layout.py), its full buffer ``full`` (storage freed) and its shard ``shard``
        replacing the old ones; the parameters stay the same objects, pointed at the new
        views at the next transition."""
        assert self.frees_storage and self.state is ShardState.SHARDED, f"'{self.label}' is in use"
        assert len(layout.buckets) == 1, "a flat parameter group is one bucket"
        self._lay_out(layout, full)
        self.shard = shard

    # ------------------------------------------------------------------ sizes and spaces

    @property
    def bucket(self) -> Bucket:
        return self.layout.buckets[0]

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (what forward uses and what is gathered)."""
        return self.full.dtype

    @property
    def master_dtype(self) -> torch.dtype:
        return self.shard.dtype

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.full.dtype

    @property
    def device(self) -> torch.device:
        return self.shard.device

    @property
    def shard_bytes(self) -> int:
        return self.shard.numel() * self.shard.element_size()

    @property
    def payload_numel(self) -> int:
        return self.layout.numel - self.layout.padding

    def allocated_full_bytes(self) -> int:
        allocated = self.frees_storage and self.full.untyped_storage().nbytes() > 0
        return self.full_bytes if allocated else 0

    def own_slice(self) -> torch.Tensor:
        """This rank's slice of the full buffer (1-D, compute dtype)."""
        return self.bucket.shard(self.rank).of(self.full)

    def view(self, name: str) -> torch.Tensor:
        return self._views[name]

    # ------------------------------------------------------------------ transitions

    def allocate_full(self) -> int:
        """Give the full buffer its storage again before a gather writes into it (stage 3);
        returns the bytes allocated (0: it had them, or it keeps its full buffer)."""
        if not self.frees_storage or self.full.untyped_storage().nbytes() > 0:
            return 0
        self.full.untyped_storage().resize_(self._storage_bytes)
        return self.full_bytes

    def begin_gather(self, handle: C.Handle, waiter: GatherWaiter) -> None:
        """The all-gather into the full buffer that ``waiter`` issued is in flight (``handle``):
        until it completes, reading a parameter asks ``waiter`` to complete it."""
        assert self.state is not ShardState.GATHERING, f"'{self.label}' is already gathering"
        self.handle, self.waiter = handle, waiter
        self.state = ShardState.GATHERING
        guard_all(self._param_list)

    def take_handle(self) -> C.Handle:
        """The gather's handle, handed to the one caller that waits for it (then :meth:`complete_gather`)."""
        handle, self.handle = self.handle, None
        assert self.state is ShardState.GATHERING and handle is not None, f"'{self.label}' has no gather to wait for"
        return handle

    def complete_gather(self) -> None:
        """The gather's handle was waited for (taken with :meth:`take_handle`, or read from
        :attr:`handle` by the one caller that waits for it): the parameters are views of the
        full buffer."""
        assert self.state is ShardState.GATHERING, f"'{self.label}' is {self.state.value}, not gathering"
        self.handle = self.waiter = None
        self.state = ShardState.UNSHARDED
        unguard_all(self._param_list)
        if not self._params_on_views:
            self._point_params_at_views()

    def wait_unsharded(self) -> None:
        """Block until the gather is done, through the gatherer that issued it: for code that
        holds the group but not its gatherer (see [Note: flat parameter groups])."""
        if self.state is ShardState.UNSHARDED:
            return
        assert self.state is ShardState.GATHERING, f"'{self.label}' is {self.state.value}, not gathering"
        assert self.waiter is not None  # begin_gather, which began the gather, set it
        self.waiter.wait_for_gather(self)

    def reshard(self) -> int:
        """Free the full buffer (stage 3); returns the bytes freed. Its gatherer completes a
        gather still in flight first, so no collective ever writes into freed memory."""
        assert self.frees_storage, f"'{self.label}' keeps its full buffer"
        if self.state is ShardState.SHARDED:
            return 0
        assert self.state is not ShardState.GATHERING, f"'{self.label}' is freed while its gather is in flight"
        storage = self.full.untyped_storage()
        freed = self.full_bytes if storage.nbytes() > 0 else 0
        storage.resize_(0)
        self.state = ShardState.SHARDED
        if not self._params_on_views:  # the first free (or the first after a new layout or a borrow)
            self._point_params_at_views()
        guard_all(self._param_list)
        return freed

    def _point_params_at_views(self) -> None:
        """Each parameter's ``.data`` its view of the full buffer, where it stays (see [Note:
        flat parameter groups])."""
        for param, view in zip(self._param_list, self._view_list):
            param.data = view
        self._params_on_views = True
