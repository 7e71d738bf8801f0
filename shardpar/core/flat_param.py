"""Flat parameter groups: parameters of one dtype stored back to back, with an explicit state.

[Note: flat parameter groups]
A :class:`FlatParamGroup` owns one dtype's parameters laid out by a one-bucket
:class:`~shardpar.core.layout.BufferLayout`: a 1-D *full* buffer (compute dtype; padded to a
multiple of N) and this rank's *shard* of it (slice r, in the dtype the optimizer updates).
Its state says which of the two the parameters are views of right now:

    SHARDED ──start_unshard()──▶ GATHERING ──wait_unsharded()──▶ UNSHARDED ──reshard()──▶ SHARDED

- stage 3: one group per (unit, dtype, trainable). The shard is the only persistent copy; the
  full buffer's storage exists only while GATHERING/UNSHARDED (it is resized to 0 by
  ``reshard``, never replaced, so tensors autograd saved in forward see the values again once
  the next gather refills the same storage).
- stages 1-2: one group per gradient bucket, a view of the replicated buffer whose owned slice
  the optimizer updated; after ``step()`` it is GATHERING until the first module using it runs
  (it never reshards).

While not UNSHARDED the parameters are guarded ([Note: guarded parameters] in
``param_guard.py``): a pending parameter waits for its gather when read, a sharded one raises
naming itself and its unit. A group is *born sharded*: it needs only names, shapes and
dtypes; the values arrive in the shard from wherever they come from (a rank's live module,
an initialisation run one unit at a time, checkpoint or Hugging Face byte ranges). No rank
ever needs the full group except while it is gathered.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, cast

import torch
from torch import nn

from ..comm import collectives as C
from .layout import Bucket, BufferLayout
from .param_guard import guard, storageless, unguard


class ShardState(enum.Enum):
    SHARDED = "sharded"
    """Only this rank's shard exists."""
    GATHERING = "gathering"
    """The full buffer is allocated and an all-gather into it is in flight."""
    UNSHARDED = "unsharded"
    """The full parameters are valid; the parameters are views of them."""


class _PendingGather:
    """Guard of a parameter whose group is gathering: reading it waits (see param_guard)."""

    def __init__(self, group: FlatParamGroup) -> None:
        self.group = group

    def on_access(self, param: nn.Parameter, operation: str) -> None:
        self.group.wait_unsharded()

    def __str__(self) -> str:
        return f"all-gather of '{self.group.label}' in flight"


class ShardedParameterAccess(RuntimeError):
    """Code read (or wrote) a stage-3 parameter while its unit is sharded."""

    def __init__(self, message: str, name: str, unit: str) -> None:
        super().__init__(message)
        self.name = name
        self.unit = unit


class _Sharded:
    """Guard of a sharded stage-3 parameter: reading it is an error naming it and its unit."""

    def __init__(self, group: FlatParamGroup, name: str) -> None:
        self.group = group
        self.name = name

    def on_access(self, param: nn.Parameter, operation: str) -> None:
        raise ShardedParameterAccess(
            f"parameter '{self.name}' of stage-3 unit '{self.group.unit}' was read ({operation}) while the unit "
            "is sharded: its values exist only while the forward (or backward) of a module of that unit runs, "
            "or a method of such a module declared with shardpar.register_forward_method(module, 'method_name') "
            "(a generate that reads parameters directly). Read parameters of another unit only inside that "
            "unit's modules (register the module under the unit that uses it, or tie the weight by "
            "registration), and read full values outside forward with model.full_state_dict(). Code that needs "
            "whole parameters and their gradients between backward and step (per-parameter clipping such as "
            "timm's adaptive gradient clipping) needs stage=0: only stage 0 keeps whole gradients",
            self.name,
            self.group.unit,
        )

    def __str__(self) -> str:
        return f"sharded, unit '{self.group.unit}'"


class GatheredBytes:
    """Bytes of full buffers allocated right now, and the most ever, over the groups that
    report here (stage 3: every unit's groups). Kept as the buffers are allocated and freed,
    so the peak costs nothing per gather."""

    def __init__(self, now: int) -> None:
        self.now = now
        self.peak = now

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


class GatherChannel:
    """Who gathers a group: it issues the group's all-gathers and is told of each step of one
    (stages 1-2: the post-step gatherer; stage 3: the unit gatherer, which checks every
    gather's tag and meters the full buffers). A group hands itself to the channel it is
    gathered by; the base does nothing but issue and wait."""

    def issue_gather(self, flat: FlatParamGroup) -> C.Handle:
        raise NotImplementedError

    def before_gather_wait(self, flat: FlatParamGroup) -> None:
        """A wait for ``flat``'s gather begins (stage 3 completes the gathers issued before it)."""

    def wait_gather(self, handle: C.Handle) -> Any:
        return handle.wait()

    def gather_received(self, flat: FlatParamGroup, result: Any) -> None:
        """``flat``'s gather completed; ``result`` is what its handle returned."""

    def full_storage_changed(self, nbytes: int) -> None:
        """A full buffer's storage was allocated (``nbytes`` > 0) or freed (< 0)."""


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
        self.layout = layout
        self.full = full  # 1-D, compute dtype, numel = layout.numel (padded)
        # Stage 3's full buffers have a gather tag's room in front in their storage (see
        # tagged_gather.gather_target); the room is not counted in the byte figures.
        # (an eager tensor's storage offset is an int; torch's stubs allow a SymInt for tracing)
        self._storage_bytes = cast(int, (full.storage_offset() + full.numel()) * full.element_size())
        self.shard = shard  # 1-D, master dtype, numel = layout.shard_numel
        self.rank = rank
        self.frees_storage = frees_storage
        self.trainable = trainable
        self.state = ShardState.UNSHARDED
        self.handle: C.Handle | None = None
        self.tagged_shard: torch.Tensor | None = None
        """Stage 3: the shard's storage as bytes, with room for a gather tag in front."""
        self.channel: GatherChannel | None = None
        """What gathered this group last (given to :meth:`start_unshard`): told of the waits
        and of the full buffer's storage until the next gather."""
        self._views = {name: layout.view(full, name) for name in self.params}
        # Guards made once: a transition only switches each parameter's class and guard.
        self._pending = _PendingGather(self)
        self._sharded = {name: _Sharded(self, name) for name in self.params}
        self._placeholders = (
            {
                name: storageless(order.shape, full.dtype, full.device, order.strides)
                for name, order in layout.orders().items()
            }
            if frees_storage
            else {}
        )

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
    def full_bytes(self) -> int:
        return self.layout.numel * self.full.element_size()

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

    def start_unshard(self, channel: GatherChannel) -> None:
        """Begin the all-gather ``channel`` issues into the full buffer (allocated first)."""
        assert self.state is not ShardState.GATHERING, f"'{self.label}' is already gathering"
        self.channel = channel
        if self.frees_storage and self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self._storage_bytes)
            channel.full_storage_changed(self.full_bytes)
        self.handle = channel.issue_gather(self)
        self.state = ShardState.GATHERING
        for param in self.params.values():
            guard(param, self._pending)

    def wait_unsharded(self) -> None:
        """Block until the gather is done; the parameters are views of the full buffer after."""
        if self.state is ShardState.UNSHARDED:
            return
        assert self.state is ShardState.GATHERING, f"'{self.label}' is {self.state.value}, not gathering"
        assert self.channel is not None  # start_unshard, which began the gather, set it
        self.channel.before_gather_wait(self)
        if self.state is not ShardState.GATHERING:
            return  # completed or dropped by a recovery while earlier gathers were waited for
        self.channel.gather_received(self, self._complete_gather())

    def drop_gather(self) -> object:
        """Complete the gather in flight without using what arrived, and free the full buffer
        (stage 3: a gather drained after ranks' gathers fell out of step); returns what the
        gather's handle returned."""
        assert self.state is ShardState.GATHERING, f"'{self.label}' is {self.state.value}, not gathering"
        result = self._complete_gather()
        self.reshard()
        return result

    def _complete_gather(self) -> object:
        handle, self.handle = self.handle, None
        # Only called while gathering: start_unshard set both.
        assert handle is not None and self.channel is not None
        result = self.channel.wait_gather(handle)
        self.state = ShardState.UNSHARDED
        self.point_params_at_full()
        return result

    def reshard(self) -> None:
        """Free the full buffer (stage 3); a gather still in flight is waited for first, so no
        collective ever writes into freed memory."""
        assert self.frees_storage, f"'{self.label}' keeps its full buffer"
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.GATHERING:
            self.wait_unsharded()
        storage = self.full.untyped_storage()
        if self.channel is not None and storage.nbytes() > 0:
            self.channel.full_storage_changed(-self.full_bytes)
        storage.resize_(0)
        self.state = ShardState.SHARDED
        for name, param in self.params.items():
            param.data = self._placeholders[name]
            guard(param, self._sharded[name])

    def point_params_at_full(self) -> None:
        for name, param in self.params.items():
            unguard(param)
            param.data = self._views[name]
