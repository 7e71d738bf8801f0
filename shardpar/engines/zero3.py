"""Stage 3 (ZeRO-3): parameters are sharded too, and gathered per unit only while needed.

[Note: units]
A wrap policy picks submodules as *units*; the wrapped module itself is the root unit and
holds every parameter no other unit claims. A parameter registered by several modules (a
tied embedding and LM head) belongs to the innermost unit that encloses all of them, so it
is gathered whenever any of its users runs -- no user change needed for tied weights.
Each unit keeps one :class:`ShardedFlatParams` per (dtype, trainable) of its parameters:
a persistent shard (1/N) and a full buffer whose storage exists only while gathered.
While gathered, parameters are views of the full buffer with their original shapes; while
sharded, they point at a NaN scalar expanded to their shape (reading a parameter outside
forward gives NaN, never freed memory). The Parameter objects never change, and tensors
autograd saved in forward (the parameter, or views of its storage) see the data again once
the storage is re-allocated and gathered for backward.

[Note: one step at stage 3]
forward:  unit pre-hook -> all-gather (or wait for the prefetched gather) -> prefetch the
          next unit in recorded order -> run -> post-hook frees the full buffer (when
          ``reshard_after_forward``) and hooks the outputs for backward.
backward: a hook on the unit's outputs fires before the unit's backward -> gather again,
          prefetch the next unit in reverse order; once every trainable gradient of the
          unit is final (stage 0's readiness counting, one bucket per flat) its full
          parameters are freed and the gradients reduce-scattered into the grad shard
          exactly as at stage 2.
step:     the optimizer updates the shards in place; nothing to gather until next forward.
Bytes per step: 2 all-gathers + 1 reduce-scatter of every parameter = 3Ψ·b·(N-1)/N
(2Ψ without resharding after forward).
"""

from __future__ import annotations

import enum
from typing import Any, Callable, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm import collectives as C
from ..core.layout import ShardPiece
from .base import TensorPiece
from .ddp import FlatParams, GradBucket, group_by_dtype
from .zero import GradientShardEngine


class ShardState(enum.Enum):
    SHARDED = "sharded"  # only the local shard exists
    GATHERING = "gathering"  # full storage allocated, all-gather in flight
    UNSHARDED = "unsharded"  # full parameters valid


class ShardedFlatParams(FlatParams):
    """A unit's parameters of one dtype: a local shard, and a full buffer on demand."""

    def __init__(
        self, named: Sequence[tuple[str, nn.Parameter]], world_size: int, trainable: bool,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(named, world_size, bucket_cap_numel=None, param_dtype=param_dtype)  # one bucket
        self.trainable = trainable
        self.shard = self.values  # replaced by shard_storage() once ranks agree on the values
        self._send: torch.Tensor | None = None
        self._views = {name: self.layout.view(self.data, name) for name in self.params}
        # While sharded, parameters point at a NaN scalar expanded to their shape: reading one
        # outside forward shows NaN instead of touching freed memory. See [Note: units].
        self._placeholder = torch.full((), float("nan"), dtype=self.dtype, device=self.device)

    @property
    def is_gathered(self) -> bool:
        return self.data.untyped_storage().nbytes() > 0

    @property
    def full_bytes(self) -> int:
        return self.layout.numel * self.data.element_size()

    def shard_storage(self, rank: int) -> None:
        """Keep only this rank's slice (of the master, in full precision); free the full
        buffers (after the initial broadcast)."""
        self.shard = self.layout.buckets[0].shard(rank).of(self.values).clone()  # 1-D, shard_numel
        self.master = None
        self.free_full()

    def free_full(self) -> None:
        for param in self.params.values():
            param.data = self._placeholder.expand(param.shape)
        self.data.untyped_storage().resize_(0)

    def start_gather(self, group: Any, stats: C.CommStats) -> C.Handle:
        self.data.untyped_storage().resize_(self.full_bytes)
        for name, param in self.params.items():
            param.data = self._views[name]
        # Mixed precision: gather the compute dtype (half the bytes of the fp32 shard).
        self._send = self.shard if self.shard.dtype == self.dtype else self.shard.to(self.dtype)
        return C.all_gather(
            self.data, self._send, group=group, async_op=True, stats=stats,
            padding_numel=self.layout.buckets[0].padding,
        )


class Unit:
    """One module whose parameters are gathered and freed together."""

    def __init__(self, name: str, module: nn.Module, flats: list[ShardedFlatParams]) -> None:
        self.name = name
        self.module = module
        self.flats = flats
        self.state = ShardState.SHARDED
        self._handles: list[C.Handle] = []
        self.trainable_flats_pending = sum(f.trainable for f in flats)
        """Trainable flats whose gradients are not final yet in this backward."""
        self.pending_backward = 0
        """Forward calls (with autograd) whose backward has not reached this unit's inputs yet."""

    @property
    def backward_done(self) -> bool:
        """Every trainable gradient of this unit is final: no gather needed until forward."""
        return any(f.trainable for f in self.flats) and self.trainable_flats_pending == 0

    def start_unshard(self, engine: "ParameterShardEngine") -> None:
        if self.state is ShardState.GATHERING:
            return
        missing = [flat for flat in self.flats if not flat.is_gathered]
        if not missing:  # all gathered (a unit may have had only its frozen flats freed)
            return
        with torch.no_grad():
            self._handles = [flat.start_gather(engine.group, engine.comm) for flat in missing]
        self.state = ShardState.GATHERING
        engine.note_params_gathered()

    def wait_unsharded(self, engine: "ParameterShardEngine") -> None:
        self.start_unshard(engine)
        for handle in self._handles:
            handle.wait()
        self._handles = []
        for flat in self.flats:
            flat._send = None  # the low-precision send copy is not needed once gathered
        self.state = ShardState.UNSHARDED

    def reshard(self, flats: Sequence[ShardedFlatParams] | None = None) -> None:
        """Free the full buffers (all of them, or just ``flats``)."""
        if self.state is ShardState.SHARDED:
            return
        if self.state is ShardState.GATHERING:
            for handle in self._handles:  # never free memory a collective still writes into
                handle.wait()
            self._handles = []
        for flat in flats if flats is not None else self.flats:
            flat.free_full()
        if not any(f.is_gathered for f in self.flats):
            self.state = ShardState.SHARDED


def _runs_forward(module: nn.Module) -> bool:
    """Containers such as ModuleList/ModuleDict never run ``forward``: hooks on them never
    fire, so they cannot be units."""
    return type(module).forward is not nn.Module.forward


def _select_unit_modules(module: nn.Module, policy: Any, min_params: int) -> list[str]:
    """Qualified names of the submodules the wrap policy makes units (root excluded)."""
    named = [(n, m) for n, m in module.named_modules() if n and _runs_forward(m)]
    if policy is None or isinstance(policy, int):
        threshold = min_params if policy is None else policy
        chosen: list[str] = []
        claimed: set[nn.Parameter] = set()
        for name, sub in reversed(named):  # children before parents (post-order by position)
            own = [p for p in sub.parameters() if p not in claimed]
            if sum(p.numel() for p in own) >= threshold:
                chosen.append(name)
                claimed.update(own)
        if isinstance(policy, int) and not chosen:
            raise ValueError(
                f"wrap_policy={policy} selects no submodule (none has {policy} parameters or more); "
                "lower the threshold or name module classes"
            )
        return sorted(chosen, key=[n for n, _ in named].index)
    if isinstance(policy, (list, tuple, set)):
        classes = tuple(policy)
        for cls in classes:
            if not isinstance(cls, type) or not issubclass(cls, nn.Module):
                raise ValueError(f"wrap_policy entries must be nn.Module classes, got {cls!r}")
            if not any(type(m) is cls or isinstance(m, cls) for _, m in named):
                raise ValueError(f"wrap_policy names {cls.__qualname__}, but the model has no module of that class")
        return [n for n, m in named if isinstance(m, classes)]
    if callable(policy):
        chosen = [n for n, m in named if policy(n, m)]
        if not chosen:
            raise ValueError("wrap_policy selects no submodule; every parameter would be in the root unit")
        return chosen
    raise TypeError(f"wrap_policy must be None, an int, a sequence of module classes or a callable, got {policy!r}")


def _assign_params_to_units(module: nn.Module, unit_names: list[str]) -> dict[str, list[str]]:
    """``unit name ('' = root) -> parameter names``, each parameter in the innermost unit
    enclosing every module that registers it (see [Note: units])."""
    canonical = {p: n for n, p in module.named_parameters()}
    users: dict[str, list[str]] = {}
    for module_name, sub in module.named_modules(remove_duplicate=False):
        for _, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            users.setdefault(canonical[param], []).append(module_name)

    def unit_path(module_name: str) -> list[str]:
        """Units enclosing a module, outermost (root) first."""
        return [""] + [u for u in unit_names if module_name == u or module_name.startswith(u + ".")]

    assignment: dict[str, list[str]] = {name: [] for name in [""] + unit_names}
    for param_name in canonical.values():
        paths = [unit_path(m) for m in users[param_name]]
        common = paths[0]
        for path in paths[1:]:
            common = [a for a, b in zip(common, path) if a == b]
        assignment[common[-1]].append(param_name)
    return assignment


def _output_tensors(output: Any) -> list[torch.Tensor]:
    if isinstance(output, dict) and not isinstance(output, torch.Tensor):
        output = list(output.values())
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward tells the engine the unit's backward is done."""

    @staticmethod
    def forward(ctx, engine, unit, *tensors):  # type: ignore[override]
        ctx.engine, ctx.unit = engine, unit
        return tensors

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        ctx.engine._post_backward(ctx.unit)
        return (None, None) + grads


class ParameterShardEngine(GradientShardEngine):
    """Stage 3: stage 2 plus sharded parameters, gathered per unit around its compute."""

    stage = 3

    def build_flats(self) -> list[FlatParams]:
        named = dict(self.named_params)
        assignment = _assign_params_to_units(
            self.module, _select_unit_modules(self.module, self.config.wrap_policy, self.config.min_unit_params)
        )
        modules = dict(self.module.named_modules())
        self.units: list[Unit] = []
        for unit_name, param_names in assignment.items():
            if not param_names and unit_name:
                continue
            flats = [
                ShardedFlatParams(group, self.world_size, trainable, self.param_dtype)
                for trainable in (True, False)
                for group in group_by_dtype([(n, named[n]) for n in param_names if named[n].requires_grad == trainable])
            ]
            self.units.append(Unit(unit_name, modules[unit_name], flats))
        self.root = self.units[0]
        # Gradients come last-unit-first; the root (embeddings, head) finishes last.
        trainable = [f for unit in reversed(self.units[1:]) for f in unit.flats if f.trainable]
        trainable += [f for f in self.root.flats if f.trainable]
        self.frozen_flats = [f for unit in self.units for f in unit.flats if not f.trainable]
        self.unit_of_flat = {flat: unit for unit in self.units for flat in unit.flats}
        return trainable

    def cast_frozen_params(self) -> dict[str, torch.Tensor]:
        """Frozen parameters live in the units' flats (sharded, cast on gather)."""
        return {}

    def iter_frozen_and_buffers(self):
        yield from (flat.values for flat in self.frozen_flats)
        yield from self.module.buffers()

    def allocate_grads(self) -> None:
        super().allocate_grads()
        for flat in self.flats + self.frozen_flats:
            flat.shard_storage(self.rank)
        self._forward_order: list[Unit] = []
        self._order_checked = False
        self._params_bytes_peak = 0
        self.note_params_gathered()
        for unit in self.units:
            self.add_hook(unit.module.register_forward_pre_hook(self._make_pre_forward(unit), prepend=True))
            self.add_hook(unit.module.register_forward_hook(self._make_post_forward(unit)))

    # ------------------------------------------------------------------ forward

    def _make_pre_forward(self, unit: Unit) -> Callable:
        def pre_forward(module: nn.Module, args: Any) -> Any:
            if not self._order_checked:
                self._check_same_unit_across_ranks(unit)
                self._forward_order.append(unit)
            unit.wait_unsharded(self)
            self._prefetch_after(unit, self._forward_order)
            if torch.is_grad_enabled() and any(not flat.trainable for flat in unit.flats):
                return self._hook_post_backward(unit, args)
            return None

        return pre_forward

    def _hook_post_backward(self, unit: Unit, args: Any) -> Any:
        """Frozen flats are freed when the backward reaches the unit's inputs. An identity
        autograd Function on the inputs (not a tensor hook) runs before the hooks on those
        tensors, i.e. before the previous unit's pre-backward starts its prefetch."""
        leaves, spec = tree_flatten(args)
        positions = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not positions:
            return None  # freed in after_backward
        unit.pending_backward += 1
        outputs = _PostBackward.apply(self, unit, *[leaves[i] for i in positions])
        for i, tensor in zip(positions, outputs):
            leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def _make_post_forward(self, unit: Unit) -> Callable:
        def post_forward(module: nn.Module, args: Any, output: Any) -> Any:
            if torch.is_grad_enabled():
                tensors = _output_tensors(output)
                if tensors:
                    torch.autograd.graph.register_multi_grad_hook(
                        tensors, lambda grads: self._pre_backward(unit), mode="any"
                    )
            if self.config.reshard_after_forward or not torch.is_grad_enabled():
                unit.reshard()
            if unit is self.root:
                self._after_root_forward()
            return output

        return post_forward

    def _after_root_forward(self) -> None:
        if not self._order_checked:
            self._check_order_across_ranks()
        for unit in self.units:  # prefetched but never run (e.g. a skipped branch)
            if unit.state is ShardState.GATHERING or (
                unit.state is ShardState.UNSHARDED and (self.config.reshard_after_forward or not torch.is_grad_enabled())
            ):
                unit.reshard()

    def _check_same_unit_across_ranks(self, unit: Unit) -> None:
        """First forward only: before a unit's gather (a collective), check that every rank is
        about to gather the same unit, so a rank-dependent forward raises on every rank instead
        of pairing collectives of different units (wrong values, a gloo abort, or a hang)."""
        names = C.all_gather_objects(("unit", unit.name), group=self.group)
        for rank, other in enumerate(names):
            if other != names[0]:
                raise RuntimeError(
                    f"stage 3: units ran in a different order on different ranks: rank {rank} is at "
                    f"{other!r} where rank 0 is at {names[0]!r}; every rank must call the same "
                    "submodules in the same order"
                )

    def _check_order_across_ranks(self) -> None:
        """Gathers are collectives: every rank must run units in the same order."""
        order = [u.name for u in self._forward_order]
        orders = C.all_gather_objects(("order", order), group=self.group)  # tagged: see above
        for rank, (_, other) in enumerate(orders):
            if other != orders[0][1]:
                raise RuntimeError(
                    f"stage 3: units ran in a different order on rank {rank} than on rank 0 "
                    f"({other} vs {orders[0][1]}); every rank must call the same submodules in the same order"
                )
        self._order_checked = True

    def _prefetch_after(self, unit: Unit, order: list[Unit]) -> None:
        if not self._order_checked or self.config.prefetch_units == 0 or unit not in order:
            return
        index = order.index(unit)
        for upcoming in order[index + 1 : index + 1 + self.config.prefetch_units]:
            upcoming.start_unshard(self)

    # ------------------------------------------------------------------ backward

    def _pre_backward(self, unit: Unit) -> None:
        if unit.backward_done:
            return
        unit.wait_unsharded(self)
        self._prefetch_after(unit, [u for u in self._forward_order[::-1] if not u.backward_done])

    def _post_backward(self, unit: Unit) -> None:
        """The backward of one call of ``unit`` reached its inputs; after the last pending
        call its frozen parameters are not needed any more (trainable ones: on_bucket_complete)."""
        unit.pending_backward -= 1
        if unit.pending_backward == 0:
            unit.reshard([flat for flat in unit.flats if not flat.trainable])

    def on_bucket_complete(self, bucket: GradBucket) -> None:
        """All gradients of this flat are final: its full parameters are no longer needed."""
        unit = self.unit_of_flat[bucket.flat]
        unit.trainable_flats_pending -= 1
        unit.reshard([bucket.flat])

    def after_backward(self) -> None:
        for unit in self.units:
            unit.reshard()
            unit.trainable_flats_pending = sum(f.trainable for f in unit.flats)
            unit.pending_backward = 0

    # ------------------------------------------------------------------ shards

    def master_piece(self, flat: FlatParams, piece: ShardPiece) -> torch.Tensor:
        return piece.local_range.of(flat.shard)

    def after_optimizer_step(self) -> None:
        """The shards were updated in place; the next forward gathers them."""

    def wait_for_params(self) -> None:
        """Nothing is pending between steps at stage 3."""

    def pre_forward(self) -> None:
        self.broadcast_buffers()

    def note_params_gathered(self) -> None:
        self._params_bytes_peak = max(self._params_bytes_peak, self._params_bytes())

    def _params_bytes(self) -> int:
        flats = self.flats + self.frozen_flats
        shards = self._bytes(f.shard for f in flats)
        return shards + sum(f.data.untyped_storage().nbytes() for f in flats)

    def memory_stats(self) -> dict[str, int]:
        stats = super().memory_stats()
        stats["params"] = self._params_bytes()
        stats["peak_params"] = self._params_bytes_peak
        return stats

    # ------------------------------------------------------------------ checkpoint pieces

    def save_pieces(self) -> list[TensorPiece]:
        return [
            TensorPiece(p.name, self.master_piece(flat, p), (p.param_range.start, p.param_range.end))
            for flat in self.flats + self.frozen_flats
            for p in flat.layout.pieces(self.rank)
        ]

    def load_pieces(self) -> list[TensorPiece]:
        return self.save_pieces()  # a rank holds exactly its shards

    def after_load(self) -> None:
        """Shards are the only copy at stage 3; the next forward gathers them."""

