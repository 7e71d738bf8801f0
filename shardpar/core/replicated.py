"""Replicated parameter storage (stages 0-2): every rank holds every trainable parameter, as
views of one flat buffer per dtype, cut into gradient buckets.

What differs between the stages is who owns the values the optimizer updates: the storage's
*master* part (core/masters.py), :class:`FullMaster` at stage 0 and :class:`ShardedMaster` at
stages 1-2 (whose updated slices are all-gathered back after ``step()`` by a
:class:`PostStepGatherer`).

[Note: lazy parameter gather]
The all-gathers after ``step()`` are launched and left in flight: each bucket's gather is
completed by a forward pre-hook of the first module that uses one of its parameters (its
*use module*, lifted out of compiled regions), so the gather of the later buckets overlaps
the first layers' forward. Every use module has that hook in the first forward, which records
the order they run in; after it only the first of each bucket's keeps it ([Note: one gather
hook per bucket] in engines/module_hooks.py). Anything else that reads a parameter in between
sees a guarded parameter that waits for its bucket first ([Note: guarded parameters]);
``state_dict``, checkpoints and the next ``step()`` wait for everything. The same use-module
hooks record, in the first forward, the order buckets are first used in ([Note: launch order]).

After the first synchronising backward every buffer may be laid out again in the order
gradients became ready ([Note: bucket rebuild] in rebuild.py): :meth:`ParamBuffer.layout_in`
builds both layouts, :meth:`ParamBuffer.relayout` moves the values, and stages 1-2 get new
flat groups (and use-module hooks) for the new buckets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .element_order import ElementOrder
from .flat_param import FlatParamGroup
from .inventory import ParamInventory, group_by_dtype
from .layout import Alignment, BufferLayout, alignment_for
from .masters import FullMaster, ShardedMaster
from .pieces import FullValues, TensorPiece
from .rebuild import Relayout, same_buckets, whole_layouts

if TYPE_CHECKING:
    from ..config import ShardConfig
    from .reduce_strategies import ReduceStrategy


class ParamBuffer:
    """One dtype's trainable parameters in one 1-D tensor, the *compute buffer* ``data``
    (compute dtype, padded per bucket and, aligned, in front of each parameter: [Note:
    alignment] in layout.py), and its layout. Once :meth:`hold_params` ran, every parameter's
    ``.data`` is a view into ``data``, with the strides it was wrapped with ([Note: element
    order]). The Parameter objects themselves never change. The values the optimizer updates
    are the storage's master part's (core/masters.py)."""

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        orders: dict[str, ElementOrder],
        world_size: int,
        bucket_cap_numel: int,
        param_dtype: torch.dtype | None,
        alignment: Alignment,
    ) -> None:
        first = named[0][1]
        self.master_dtype = first.dtype
        self.compute_dtype = param_dtype if param_dtype is not None and first.dtype.is_floating_point else first.dtype
        self.device = first.device
        self.params = dict(named)
        self.orders = {name: orders[name] for name in self.params}
        self.alignment = alignment
        self.world_size = world_size
        self.bucket_cap_numel = bucket_cap_numel
        # Reverse registration order: see [Note: layout order] in layout.py.
        self.layout = self.layout_in([name for name, _ in reversed(named)], owners={})
        self.data = torch.zeros(self.layout.numel, dtype=self.compute_dtype, device=self.device)  # 1-D, padded

    def hold_params(self) -> None:
        """The parameters' values into the compute buffer, and the parameters views of it
        (after the master part kept what it needs of their full-precision values)."""
        with torch.no_grad():
            for name, param in self.params.items():
                view = self.layout.view(self.data, name)
                view.copy_(param.data)
                param.data = view

    def layout_in(
        self,
        order: Sequence[str],
        whole: frozenset[str] = frozenset(),
        loads: Sequence[int] | None = None,
        owners: Mapping[str, int] | None = None,
    ) -> BufferLayout:
        """This buffer's tensors laid out in ``order`` and cut into buckets, those owned whole
        each in its owner's slice (``owners``, None: the current layout's, chosen once and kept:
        [Note: whole-tensor ownership] in layout.py) and those in ``whole`` in the slice of a
        rank chosen by ``loads`` (see :class:`BufferLayout`): the one place its layouts are
        built, at wrap, when tensors become owned whole and when the buckets are rebuilt."""
        return BufferLayout(
            [(name, self.orders[name]) for name in order],
            self.world_size,
            self.bucket_cap_numel,
            **self.alignment._asdict(),
            owners=self.layout.owners if owners is None else owners,
            whole=whole,
            loads=loads,
            owned_apart=True,
        )

    def relayout(self, move: Relayout) -> None:
        """Move the compute buffer to ``move.new`` (see [Note: bucket rebuild]): parameters
        become views of the new buffer (the master part moves its own tensors)."""
        with torch.no_grad():
            self.data = move.full(self.data)
            for name, param in self.params.items():
                param.data = move.new.view(self.data, name)
        self.layout = move.new


class ReplicatedStorage:
    """Stages 0-2 (see the module docstring). ``master`` is the part that differs between them:
    who holds the values the optimizer updates (core/masters.py)."""

    def __init__(
        self,
        module: nn.Module,
        inventory: ParamInventory,
        config: ShardConfig,
        group: Any,
        world_size: int,
        rank: int,
        master: FullMaster | ShardedMaster,
    ) -> None:
        self.module = module
        self.inventory = inventory
        self.rank = rank
        self.world_size = world_size
        self.master = master
        mp = config.mixed_precision
        param_dtype = mp.param_dtype if mp is not None else None
        bytes_cap = int(config.bucket_cap_mb * 1024 * 1024)
        self.alignment = alignment_for(config.align_for_bandwidth, group, world_size)
        orders = {name: inventory.order(name) for name, _ in inventory.trainable}  # refuses non-dense ones by name
        self.buffers: list[ParamBuffer] = []
        for named in group_by_dtype(inventory.trainable):
            buf = ParamBuffer(
                named, orders, world_size, max(1, bytes_cap // named[0][1].element_size()), param_dtype, self.alignment
            )
            master.keep_values(buf)  # its full-precision copy, read before the parameters become views
            buf.hold_params()
            self.buffers.append(buf)
        self.frozen_orders = {name: inventory.kept_order(name) for name, _ in inventory.frozen}
        """Frozen parameters stay the module's own tensors (and are saved in their element order
        where they are dense)."""
        self.buffer_of = {name: buf for buf in self.buffers for name in buf.params}
        self.frozen_masters: dict[str, torch.Tensor] = {}
        """Mixed precision: frozen parameters compute in ``param_dtype``; their original values
        are kept here so checkpoints stay exact."""
        if param_dtype is not None:
            for name, param in inventory.frozen:
                if param.is_floating_point() and param.dtype != param_dtype:
                    self.frozen_masters[name] = param.data
                    param.data = param.data.to(param_dtype)
        self.params_are_masters = param_dtype is None
        """Whether the module's parameters hold the values the optimizer updates (else they are
        compute copies of fp32 masters: state dicts and loads go to the masters)."""

    relayouts = True
    """The buckets may be laid out again after the first backward ([Note: bucket rebuild])."""

    # ------------------------------------------------------------------ set-up

    def tensors_to_broadcast(self) -> list[torch.Tensor]:
        """What must equal rank 0's on every rank after wrap."""
        return (
            [b.data for b in self.buffers]
            + self.master.tensors_to_broadcast()
            + list(self.frozen_masters.values())
            + [p.data for _, p in self.inventory.frozen]
        )

    @property
    def groups(self) -> list[FlatParamGroup]:
        """The master part's flat groups, one per bucket at stages 1-2 (none at stage 0)."""
        return self.master.groups

    @property
    def sharded_master(self) -> bool:
        """Whether optimizer pieces differ between ranks (stages 1-2)."""
        return self.master.sharded

    def finish_setup(self) -> None:
        """After the broadcast from rank 0 (see the master part)."""
        self.master.finish_setup(self.buffers)

    @property
    def spaces(self) -> list[ParamBuffer]:
        return self.buffers

    def rebuilt_layouts(self, order: Sequence[str]) -> dict[ParamBuffer, BufferLayout]:
        """Each buffer's layout with its tensors in ``order``, for the buffers where that
        changes which tensors share a bucket (see [Note: bucket rebuild])."""
        layouts = {}
        for buf in self.buffers:
            layout = buf.layout_in([name for name in order if name in buf.params])
            if not same_buckets(buf.layout, layout):
                layouts[buf] = layout
        return layouts

    def whole_layouts(self, names: frozenset[str]) -> dict[ParamBuffer, BufferLayout]:
        """Each buffer's layout in its order with ``names`` owned whole besides those owned
        before (owners given to the new ones only), for the buffers where that moves anything
        ([Note: whole-tensor ownership] in layout.py)."""

        return whole_layouts(
            self.buffers,
            names,
            self.world_size,
            lambda buf, whole, loads: buf.layout_in(list(buf.layout.slots), whole, loads),
        )

    def relayout(self, moves: dict[ParamBuffer, Relayout]) -> None:
        """Move the buffers to their new layouts; stages 1-2 track the new buckets."""
        self.wait_for_params()
        for buf, move in moves.items():
            buf.relayout(move)
        self.master.relayout(self.buffers, moves)

    def element_orders(self) -> dict[str, ElementOrder]:
        """Every parameter's element order: what its pieces' ranges count in ([Note: element order])."""
        orders = {name: buf.orders[name] for buf in self.buffers for name in buf.params}
        for name, order in self.frozen_orders.items():  # not dense: saved row-major, as a copy
            orders[name] = order if order is not None else ElementOrder(self.inventory.shapes[name])
        return orders

    def frozen_values(self) -> list[tuple[str, torch.Tensor]]:
        """Frozen parameters at full precision (their originals under mixed precision)."""
        return [(name, self.frozen_masters.get(name, param.data)) for name, param in self.inventory.frozen]

    # ------------------------------------------------------------------ optimizer

    def optimizer_pieces(self, names: Sequence[str], strategy: ReduceStrategy) -> list[TensorPiece]:
        """Stage 0: whole parameters; stages 1-2: this rank's pieces (see TensorPiece)."""
        return self.master.optimizer_pieces(self.buffers, names, strategy)

    def before_optimizer_step(self, names: frozenset[str] | None = None) -> None:
        self.master.before_optimizer_step(names)

    def after_optimizer_step(self, names: frozenset[str] | None = None) -> None:
        """Make the updated values the ones forward computes with (see the master part)."""
        with torch.no_grad():
            self.master.after_optimizer_step(self.buffers, names)

    def wait_for_params(self) -> None:
        self.master.wait_for_params()

    # ------------------------------------------------------------------ checkpoint pieces

    def save_pieces(self) -> list[TensorPiece]:
        # Parameters are replicated, yet each rank writes only its bucket slices, so saving is
        # parallel and every rank writes the same amount; rank 0 adds the frozen parameters.
        pieces = [
            TensorPiece(p.name, self.master.piece_values(buf, p), (p.param_range.start, p.param_range.end))
            for buf in self.buffers
            for p in buf.layout.pieces(self.rank)
        ]
        if self.rank == 0:
            orders = self.element_orders()
            pieces += [TensorPiece(n, orders[n].flatten(t), (0, t.numel())) for n, t in self.frozen_values()]
        return pieces

    def load_pieces(self) -> list[TensorPiece]:
        pieces = self.master.load_pieces(self.buffers)
        return pieces + self._frozen_load_pieces()

    def _frozen_load_pieces(self) -> list[TensorPiece]:
        pieces = []
        for name, tensor in self.frozen_values():
            order = self.frozen_orders[name]
            if order is None:
                raise ValueError(
                    f"frozen parameter '{name}' is not one dense block of memory (strides "
                    f"{tuple(tensor.stride())}); cannot load into it in place"
                )
            pieces.append(TensorPiece(name, order.flatten(tensor), (0, tensor.numel())))  # a view: dense, its strides
        return pieces

    def after_load(self) -> None:
        with torch.no_grad():
            for name, param in self.inventory.frozen:
                if name in self.frozen_masters:
                    param.data.copy_(self.frozen_masters[name])
        self.after_optimizer_step()
        self.wait_for_params()

    # ------------------------------------------------------------------ memory

    def param_bytes(self) -> int:
        tensors = [b.data for b in self.buffers] + self.master.tensors()
        frozen = sum(p.numel() * p.element_size() for _, p in self.inventory.frozen)
        frozen += sum(t.numel() * t.element_size() for t in self.frozen_masters.values())
        return sum(t.numel() * t.element_size() for t in tensors) + frozen

    @property
    def full_values(self) -> FullValues:
        """Where full-precision values are read: the parameters at stage 0 without mixed precision,
        else the masters (full on every rank at stage 0, sharded at stages 1-2)."""
        if self.params_are_masters and not self.master.sharded:
            return FullValues.IN_PARAMS
        return self.master.full_values

    def layout_summary(self) -> dict[str, Any]:
        return {
            "buckets": [
                {
                    "dtype": str(buf.compute_dtype).replace("torch.", ""),
                    "start": b.range.start,
                    "end": b.range.end,
                    "padding": b.padding,
                    "params": list(b.names),
                }
                for buf in self.buffers
                for b in buf.layout.buckets
            ]
        }

    def layouts(self) -> list[BufferLayout]:
        return [b.layout for b in self.buffers]

    def use_modules(self, tree_lift: Callable[[str], str]) -> dict[str, list[str]]:
        """Hook module name -> the trainable parameters it (or its compiled subtree) registers."""
        canonical = self.inventory.name_of
        uses: dict[str, list[str]] = {}
        for module_name, sub in self.module.named_modules(remove_duplicate=False):
            for _, param in sub.named_parameters(recurse=False, remove_duplicate=False):
                name = canonical.get(param)
                if name in self.buffer_of:
                    hook = tree_lift(module_name)
                    if name not in uses.setdefault(hook, []):
                        uses[hook].append(name)
        return uses
