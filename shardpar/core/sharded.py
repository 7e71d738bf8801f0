"""Sharded parameter storage (stage 3): each rank keeps 1/N of every parameter, grouped in
units ([Note: units] in units.py) of flat parameter groups, gathered per use
([Note: one step at stage 3] in gatherer.py).

Groups are *born sharded*: a group is built from names, shapes and dtypes, its values are put
into the shard by a :class:`ValueSource`, and its full buffer is freed before the next group
is built, so building never holds more than the shards plus one group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from ..comm import collectives as C
from .deferred_init import InitWalk
from .element_order import ElementOrder
from .flat_param import FlatParamGroup
from .inventory import ParamInventory, group_by_dtype
from .layout import BufferLayout, alignment_for
from .pieces import FullValues, TensorPiece
from .rebuild import Relayout, whole_layouts
from .reduce_strategies import PieceGradients
from .units import Unit, UnitPlan, plan_units

if TYPE_CHECKING:
    from ..config import ShardConfig
    from .reduce_strategies import ReduceStrategy


class ValueSource(Protocol):
    device: torch.device
    """Where the shards live."""

    def build_order(self, plans: Sequence[UnitPlan]) -> list[int]:
        """The order in which to build the units (indices into ``plans``)."""

    def fill(self, flat: FlatParamGroup, shard: torch.Tensor) -> None:
        """Write this rank's shard of the group's values into ``shard`` (1-D, master dtype,
        ``flat.layout``'s slice for this rank, zeroed)."""


class FromLiveModule:
    """The parameters' current values on rank 0 (every rank built the model; rank 0's win)."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device

    def build_order(self, plans: Sequence[UnitPlan]) -> list[int]:
        return list(range(len(plans)))

    def fill(self, flat: FlatParamGroup, shard: torch.Tensor) -> None:
        values = torch.zeros(flat.layout.numel, dtype=shard.dtype, device=shard.device)
        with torch.no_grad():
            for name, param in flat.params.items():
                flat.layout.view(values, name).copy_(param.data)
            C.broadcast(values, 0, group=self.group)
            shard.copy_(flat.bucket.shard(flat.rank).of(values))


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


class FromInit:
    """Values computed by replaying the initialisation, unit by unit, on every rank
    ([Note: deferred initialisation] in deferred_init.py): no broadcast, no full model."""

    def __init__(self, module: nn.Module, walk: InitWalk, device: torch.device) -> None:
        self.module = module
        self.walk = walk
        self.device = device
        self._complete_at: dict[str, int] = {}

    def build_order(self, plans: Sequence[UnitPlan]) -> list[int]:
        """Units in the order the walk completes them: a unit is complete once every module
        holding one of its parameters, the unit's own module and its parent have been visited
        (inits commonly set a child's weight: Hugging Face GPT-2's attention scales its
        ``c_proj``). A parent that is a container (``ModuleList``...) or the root is not
        waited for: that would hold every sibling unit at once."""
        modules = dict(self.module.named_modules(remove_duplicate=False))
        params = dict(self.module.named_parameters(remove_duplicate=False))
        last = len(self.walk.visits) - 1
        for plan in plans:
            if plan.from_policy and plan.name in modules:
                waits = [self.walk.last_visit_of(modules[plan.name])]
                parent = modules[plan.name.rpartition(".")[0]] if "." in plan.name else None
                if parent is not None and not isinstance(parent, _CONTAINERS):
                    waits.append(self.walk.last_visit_of(parent))
            else:
                waits = [last]
            waits += [i for name in plan.params for i in self.walk.visits_holding(params[name])]
            self._complete_at[plan.name] = max(waits)
        return sorted(range(len(plans)), key=lambda i: self._complete_at[plans[i].name])

    def fill(self, flat: FlatParamGroup, shard: torch.Tensor) -> None:
        self.walk.advance_to(self._complete_at[flat.unit])
        self.walk.check_initialised(list(flat.params.items()))
        with torch.no_grad():  # only this rank's pieces: no full-size buffer on the device
            for piece in flat.layout.pieces(flat.rank):
                in_memory_order = flat.layout.slots[piece.name].order.flatten(flat.params[piece.name].data)
                piece.local_range.of(shard).copy_(piece.param_range.of(in_memory_order))


class ShardedStorage:
    """Stage 3 (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        inventory: ParamInventory,
        config: ShardConfig,
        group: Any,
        world_size: int,
        rank: int,
        source: ValueSource,
    ) -> None:
        self.module = module
        self.inventory = inventory
        self.rank = rank
        self.world_size = world_size
        self.alignment = alignment_for(config.align_for_bandwidth, group, world_size)
        mp = config.mixed_precision
        self.param_dtype = mp.param_dtype if mp is not None else None
        for name, _ in inventory.named:
            inventory.order(name)  # a parameter no flat buffer can keep is refused, by name, before any work
        self.plans: list[UnitPlan] = plan_units(module, config.wrap_policy, config.min_unit_params)
        built: dict[int, list[FlatParamGroup]] = {}
        for index in source.build_order(self.plans):
            plan = self.plans[index]
            named = [(name, inventory.by_name[name]) for name in plan.params]
            flats = []
            for trainable in (True, False):
                members = [(n, p) for n, p in named if p.requires_grad == trainable]
                for dtype_group in group_by_dtype(members) if members else []:
                    flats.append(self._born_sharded(plan.name, dtype_group, trainable, source))
            built[index] = flats
        self.units: list[Unit] = [
            Unit(index, plan.name, plan.hook_modules, built[index], plan.from_policy)
            for index, plan in enumerate(self.plans)
        ]
        # The reducer's layout order: gradients come last unit first.
        self.trainable_groups = [f for unit in reversed(self.units) for f in unit.trainable]
        self.groups = [f for unit in self.units for f in unit.flats]

    def _born_sharded(
        self, unit: str, named: Sequence[tuple[str, nn.Parameter]], trainable: bool, source: ValueSource
    ) -> FlatParamGroup:
        first = named[0][1]
        master_dtype = first.dtype
        compute = self.param_dtype if self.param_dtype is not None and master_dtype.is_floating_point else master_dtype
        layout = BufferLayout(
            [(n, self.inventory.order(n)) for n, _ in reversed(named)],
            self.world_size,
            None,
            **self.alignment._asdict(),
        )  # one bucket; refuses non-dense parameters by name
        device = source.device
        # Views are made while allocated; the room in front lets gathers receive in place.
        full = C.gather_target(layout.numel, compute, device)
        # The shard lives behind room for a gather tag, so a gather sends it without a copy.
        tagged, shard = C.tagged_buffer(layout.shard_numel, master_dtype, device)
        shard.zero_()
        label = f"{'trainable' if trainable else 'frozen'} {str(master_dtype).replace('torch.', '')}"
        flat = FlatParamGroup(
            label, unit, list(reversed(named)), layout, full, shard, self.rank, frees_storage=True, trainable=trainable
        )
        flat.tagged_shard = tagged
        full.untyped_storage().resize_(0)  # the views exist; the first gather allocates it again
        source.fill(flat, shard)
        flat.reshard()
        return flat

    @property
    def spaces(self) -> list[FlatParamGroup]:
        return self.trainable_groups

    def element_orders(self) -> dict[str, ElementOrder]:
        """Every parameter's element order: what its pieces' ranges count in ([Note: element order])."""
        return {name: order for flat in self.groups for name, order in flat.layout.orders().items()}

    params_are_masters = False
    """Parameters have no values between uses: state dicts and loads go to the shards."""
    relayouts = False
    """Its buckets are its units: never laid out again."""

    full_values = FullValues.GATHERED
    """Parameters have no values between uses: full values are gathered from the shards."""

    def layout_summary(self) -> dict[str, Any]:
        return {"units": [{"name": u.name, "params": [n for f in u.flats for n in f.layout.names]} for u in self.units]}

    def layouts(self) -> list[BufferLayout]:
        return [f.layout for f in self.groups]

    # ------------------------------------------------------------------ whole-tensor ownership

    def whole_layouts(self, names: frozenset[str]) -> dict[FlatParamGroup, BufferLayout]:
        """Each trainable group's layout with ``names`` owned whole besides those owned before
        (owners given to the new ones only), for the groups where that moves anything ([Note:
        whole-tensor ownership] in layout.py)."""

        def lay_out(flat: FlatParamGroup, whole: frozenset[str], loads: list[int]) -> BufferLayout:
            return BufferLayout(
                [(name, slot.order) for name, slot in flat.layout.slots.items()],
                self.world_size,
                None,
                **self.alignment._asdict(),
                owners=flat.layout.owners,
                whole=whole,
                loads=loads,
            )

        return whole_layouts(self.trainable_groups, names, self.world_size, lay_out)

    def relayout(self, moves: dict[FlatParamGroup, Relayout]) -> None:
        """Each moved group gets a full buffer and a shard of its new layout, the shard's values
        moved across ranks (one all-gather of the old shards per group); every group is sharded
        between steps, so no parameter points into the old buffers."""
        with torch.no_grad():
            for flat, move in moves.items():
                full = C.gather_target(move.new.numel, flat.dtype, flat.device)  # views are made while allocated
                tagged, shard = C.tagged_buffer(move.new.shard_numel, flat.master_dtype, flat.device)
                shard.copy_(move.local(flat.shard))
                flat.move_to(move.new, full, shard)
                flat.tagged_shard = tagged
                full.untyped_storage().resize_(0)

    # ------------------------------------------------------------------ optimizer

    def optimizer_pieces(self, names: Sequence[str], strategy: ReduceStrategy) -> list[TensorPiece]:
        assert isinstance(strategy, PieceGradients), "stage 3's row pairs its shards with sharded gradients"
        wanted = set(names)
        found = {}
        for flat in self.trainable_groups:
            for piece in flat.layout.pieces(self.rank):
                if piece.name in wanted:
                    found[piece.name] = TensorPiece(
                        piece.name,
                        flat.layout.optimizer_view(piece, piece.local_range.of(flat.shard)),
                        (piece.param_range.start, piece.param_range.end),
                        flat.layout.optimizer_view(piece, strategy.piece_grad(flat, piece)),
                    )
        return [found[name] for name in names if name in found]

    def before_optimizer_step(self, names: frozenset[str] | None = None) -> None:
        """Nothing is gathered between steps at stage 3."""

    def after_optimizer_step(self, names: frozenset[str] | None = None) -> None:
        """The shards were updated in place; the next forward gathers them."""

    def wait_for_params(self) -> None:
        """Nothing is pending between steps at stage 3."""

    # ------------------------------------------------------------------ checkpoint pieces

    def save_pieces(self) -> list[TensorPiece]:
        return [
            TensorPiece(p.name, p.local_range.of(flat.shard), (p.param_range.start, p.param_range.end))
            for flat in self.groups
            for p in flat.layout.pieces(self.rank)
        ]

    def load_pieces(self) -> list[TensorPiece]:
        return self.save_pieces()  # a rank holds exactly its shards

    def after_load(self) -> None:
        """Shards are the only copy at stage 3; the next forward gathers them."""

    # ------------------------------------------------------------------ memory

    def param_bytes(self) -> int:
        return sum(f.shard_bytes + f.allocated_full_bytes() for f in self.groups)
