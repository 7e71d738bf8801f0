"""Rebuilding the gradient buckets (stages 0-2) from the order gradients became ready.

[Note: bucket rebuild]
At wrap each dtype's trainable parameters are laid out in reverse registration order and cut
into buckets of ``bucket_cap_mb`` ([Note: layout order] in layout.py). A bucket completes when
the last of its gradients does, so when forward runs modules in another order than they are
registered in (reversed, interleaved, a parameter registered on a parent and used at the end
of its forward), a bucket mixes gradients that are ready early with some that are ready late:
it completes late, its collective overlaps less of backward, and at stage 2 its staging is
held longer. The learnt launch order ([Note: launch order] in first_step_orders.py) only orders those
fixed buckets. So, as torch DDP does, the buckets are rebuilt once from what backward did:

1. *Record.* During the first synchronising backward the reducer's first-step orders note
   the order in which gradients become final, module by module ([Note: ready order] in
   first_step_orders.py).
2. *Agree.* At the end of that backward -- every bucket reduced and waited for, nothing in
   flight -- every rank proposes "the ready order, then the parameters that got no gradient
   here in today's layout order" and all adopt rank 0's: one object all-gather, once.
3. *Lay out.* Each dtype's buffer lays its tensors out in that order with the same cap,
   through the one helper that built its first layout (``ParamBuffer.layout_in``). Where the
   new layout puts the same tensors together in every bucket, nothing moves (the order
   within a bucket decides nothing). Otherwise everything indexed by the layout moves to the
   new one, values unchanged (:class:`Relayout`):

   - tensors complete on every rank (the replicated parameters, stage 0's full master and
     gradient buffers) are copied by name, locally; parameters' ``.data`` (and stage 0's
     ``.grad``) are pointed at the new views -- the Parameter objects never change;
   - sharded tensors (stages 1-2: master shards under mixed precision, stage 1's reduced
     slices of its gradient buffer and their master-dtype copy, stage 2's gradient shards,
     elementwise optimizer state) cross ranks: each old bucket's full contents are
     assembled by one all-gather of every rank's slice (counted as kind ``rebuild`` in
     ``comm_stats()``) and every rank copies out its pieces of the new layout. One bucket at
     a time, so the transient is one old bucket;
   - then the per-bucket flat groups and the post-step gatherer (stages 1-2), the reducer's
     buckets and used-flags, and the use-module hooks that complete lazy gathers. The
     layout generation counts up; each sharded optimizer follows on its next use ([Note:
     optimizers follow the layout] in optim/sharded.py): its inner param groups point at
     its new pieces, elementwise state moves as above (after one object all-gather of what
     state each rank holds), scalar state such as ``step`` -- equal on every rank holding a
     piece of the parameter -- is copied.
4. *Launch order.* A bucket completes at the last of its gradients in the agreed order; the
   buckets launch in the order they complete, which for one dtype is the layout order.

Why then: gradients are reduced and nothing is in flight, and the optimizer has normally
no state yet (a step before the first synchronising backward changes nothing; state exists
only when a checkpoint was loaded), so at stages 1-2 what crosses ranks is the reduced
gradient shards (and the master shards under mixed precision): S·(N-1)/N bytes per sharded
tensor of S bytes, once. Stage 0 sends nothing. A new buffer exists beside the old one until
its copy is done (one extra copy of the largest buffer moved, not counted by
``memory_stats()``); afterwards ``memory_stats()`` reports what the new layout holds, the
same as before but for padding (every bucket is padded to a multiple of N). Checkpoints
address parameters in param space, so they do not depend on which layout wrote them.

The layout is rebuilt once: a model whose order changes later keeps it (correct, less
overlap). Stage 3's buckets are its units, fixed by the module tree; there only the launch
order is learnt.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..comm import collectives as C
from .layout import Bucket, BufferLayout, ShardPiece
from .pieces import is_elementwise

if TYPE_CHECKING:
    from .reducer import GradientReducer


def same_buckets(old: BufferLayout, new: BufferLayout) -> bool:
    """Whether ``new`` puts the same tensors together in every bucket as ``old``."""
    return [set(b.names) for b in old.buckets] == [set(b.names) for b in new.buckets]


def same_placement(old: BufferLayout, new: BufferLayout) -> bool:
    """Whether ``new`` puts every tensor where ``old`` does, in buckets of the same ranges."""
    return [b.range for b in old.buckets] == [b.range for b in new.buckets] and all(
        old.slots[name].range == slot.range for name, slot in new.slots.items()
    )


def whole_layouts(
    spaces: Sequence[Any],
    names: frozenset[str],
    world_size: int,
    lay_out: Callable[[Any, frozenset[str], list[int]], BufferLayout],
) -> dict[Any, BufferLayout]:
    """Each bucketed parameter set laid out again by ``lay_out(space, its names to own whole,
    the elements each rank updates in the sets before)``, in order; the new layouts where they
    move anything ([Note: whole-tensor ownership] in layout.py). Where nothing moves, the set
    takes the new layout at once: only its owners are new."""
    layouts = {}
    loads = [0] * world_size
    for space in spaces:
        layout = lay_out(space, names & space.params.keys(), loads)
        loads = [sum(pair) for pair in zip(loads, layout.rank_loads())]
        if same_placement(space.layout, layout):
            space.layout = layout
        else:
            layouts[space] = layout
    return layouts


class Relayout:
    """One bucketed parameter set's move from layout ``old`` to ``new`` on this rank (step 3 of
    [Note: bucket rebuild]). Every method returns new tensors; the old ones are untouched."""

    def __init__(self, old: BufferLayout, new: BufferLayout, rank: int, group: Any, comm: C.CommStats) -> None:
        assert old.slots.keys() == new.slots.keys() and old.world_size == new.world_size
        self.old = old
        self.new = new
        self.rank = rank
        self.group = group
        self.comm = comm
        self._new_pieces = {piece.name: piece for piece in new.pieces(rank)}  # at most one per tensor

    def full(self, tensor: torch.Tensor) -> torch.Tensor:
        """A buffer-space tensor complete on every rank, in the new layout (padding zero); local."""
        moved = torch.zeros(self.new.numel, dtype=tensor.dtype, device=tensor.device)
        for name in self.new.slots:
            self.new.view(moved, name).copy_(self.old.view(tensor, name))
        return moved

    def owned(self, tensor: torch.Tensor) -> torch.Tensor:
        """A buffer-space tensor of which only this rank's slice of each bucket counts (stage
        1's reduced gradients): those slices in the new layout, the rest zero."""
        moved = torch.zeros(self.new.numel, dtype=tensor.dtype, device=tensor.device)
        self._each_old_bucket(
            lambda bucket: bucket.shard(self.rank).of(tensor), lambda piece: piece.buffer_range.of(moved)
        )
        return moved

    def local(self, shard: torch.Tensor) -> torch.Tensor:
        """A local-space tensor (this rank's slice of every bucket) in the new layout."""
        moved = torch.zeros(self.new.shard_numel, dtype=shard.dtype, device=shard.device)
        self._each_old_bucket(
            lambda bucket: self.old.shard_of(bucket, shard), lambda piece: piece.local_range.of(moved)
        )
        return moved

    def pieces(
        self, values: Mapping[str, torch.Tensor], names: Iterable[str], dtype: torch.dtype, device: torch.device
    ) -> dict[str, torch.Tensor]:
        """Per-piece tensors (elementwise optimizer state): ``values[name]`` holds this rank's
        old piece of ``name`` (any shape, its piece's number of elements); returns 1-D tensors
        for this rank's new pieces of ``names`` (the names some rank has values of)."""
        wanted = set(names)
        moved = {
            name: torch.zeros(piece.param_range.size, dtype=dtype, device=device)
            for name, piece in self._new_pieces.items()
            if name in wanted
        }
        old_pieces: dict[int, list[ShardPiece]] = {}
        for piece in self.old.pieces(self.rank):
            old_pieces.setdefault(piece.bucket, []).append(piece)

        def send(bucket: Bucket) -> torch.Tensor:
            out = torch.zeros(bucket.shard_size, dtype=dtype, device=device)
            start = self.old.local_offset(bucket)
            for piece in old_pieces.get(bucket.index, []):
                if piece.name in values:
                    piece.local_range.shift(-start).of(out).copy_(values[piece.name].reshape(-1))
            return out

        self._each_old_bucket(send, lambda piece: moved.get(piece.name))
        return moved

    def _each_old_bucket(
        self, send_of: Callable[[Bucket], torch.Tensor], receive: Callable[[ShardPiece], torch.Tensor | None]
    ) -> None:
        """Per old bucket: all-gather its full contents from every rank's slice (``send_of``),
        then copy each of this rank's new pieces of its tensors into ``receive(piece)``."""
        for bucket in self.old.buckets:
            send = send_of(bucket)
            full = torch.empty(bucket.range.size, dtype=send.dtype, device=send.device)
            C.all_gather(full, send, group=self.group, stats=self.comm, padding_numel=bucket.padding, kind="rebuild")
            for name in bucket.names:
                piece = self._new_pieces.get(name)
                target = receive(piece) if piece is not None else None
                if target is not None:
                    assert piece is not None  # a target is only asked for where there is a piece
                    offset = self.old.slots[name].range.start - bucket.range.start
                    target.copy_(piece.param_range.shift(offset).of(full))


# --------------------------------------------------------------------------- optimizer state

StateDescription = dict[str, dict[str, tuple[Any, ...]]]
"""name -> key -> ``("elementwise", dtype)`` or ``("scalar", value, on_the_tensors_device)``."""


def describe_state(states: Mapping[str, tuple[torch.Tensor, dict[str, Any]]]) -> StateDescription:
    """What this rank's optimizer state is (``name -> (piece tensor, state)``), for the other
    ranks: elementwise state by dtype, scalar state by value (equal wherever it is held)."""
    described: StateDescription = {}
    for name, (owner, state) in states.items():
        entry = described[name] = {}
        for key, value in state.items():
            if is_elementwise(key, value, owner):
                entry[key] = ("elementwise", value.dtype)
            elif isinstance(value, torch.Tensor):
                entry[key] = ("scalar", value.detach().cpu().clone(), value.device == owner.device)
            else:
                entry[key] = ("scalar", value, False)
    return described


def merge_descriptions(rows: Iterable[StateDescription]) -> StateDescription:
    """Every rank's descriptions in one (the lowest rank's value where several hold one)."""
    merged: StateDescription = {}
    for row in rows:
        for name, entry in row.items():
            for key, what in entry.items():
                merged.setdefault(name, {}).setdefault(key, what)
    return merged


def move_state(
    states: Mapping[str, tuple[torch.Tensor, dict[str, Any]]],
    described: StateDescription,
    moves: Sequence[Relayout],
    device: torch.device,
) -> dict[str, dict[str, Any]]:
    """Sharded optimizer state in the new layouts: ``name -> state`` of this rank's new
    pieces. Every rank runs the same collectives: one pass over the old buckets per space
    and elementwise (key, dtype) that some rank holds, in a fixed order."""
    elementwise: dict[tuple[str, str], torch.Tensor] = {}  # (name, key) -> this rank's new piece
    moved: dict[str, dict[str, Any]] = {}
    for move in moves:
        names = [name for name in move.new.slots if name in described]
        kinds = sorted(
            {(key, what[1]) for name in names for key, what in described[name].items() if what[0] == "elementwise"},
            key=str,
        )
        for key, dtype in kinds:
            holders = [name for name in names if described[name].get(key, ())[:2] == ("elementwise", dtype)]
            values = {name: states[name][1][key] for name in holders if name in states}
            for name, tensor in move.pieces(values, holders, dtype, device).items():
                elementwise[name, key] = tensor
        for piece in move.new.pieces(move.rank):
            state = {}
            for key, what in described.get(piece.name, {}).items():  # keys in the optimizer's order
                if what[0] == "elementwise":
                    state[key] = elementwise[piece.name, key]
                elif isinstance(what[1], torch.Tensor):
                    state[key] = what[1].to(device) if what[2] else what[1].clone()
                else:
                    state[key] = copy.deepcopy(what[1])
            if state:
                moved[piece.name] = state
    return moved


# ---------------------------------------------------------------------------- the rebuild itself
# The engine's one rebuild of the gradient buckets (stages 0-2): the ranks agree on the new order
# and the parts move to it; the sharded optimizers built before follow on their next use.


class BucketRebuild:
    """One rebuild, at the end of the first synchronising backward. Every rank takes part, in
    the same order: one object all-gather, then (where a layout changes) the all-gathers that
    move sharded values. The optimizers are not part of it: each follows on its next use
    (:func:`carry_state`)."""

    def __init__(
        self,
        reducer: GradientReducer,
        storage: Any,
        strategy: Any,
        rank: int,
        group: Any,
        comm: C.CommStats,
        device: torch.device,
    ) -> None:
        self.reducer, self.storage, self.strategy = reducer, storage, strategy
        self.rank, self.group, self.comm, self.device = rank, group, comm, device
        self.moves: dict[Any, Relayout] = {}
        """Each bucketed parameter set whose layout changed: its move (kept by the engine for the
        optimizers that follow later)."""

    def relayout(self) -> bool:
        """Agree on the ready order and move the storage, the strategy and the reducer to it;
        whether any layout changed (else nothing else moves)."""
        reducer, storage = self.reducer, self.storage
        proposal = reducer.orders.end_ready_record().proposal(reducer.names)
        rows = C.all_gather_objects(proposal, group=self.group, device=self.device, stats=self.comm, kind="control")
        order = [reducer.names[i] for i in rows[0]]
        layouts = storage.rebuilt_layouts(order)
        if layouts:
            self.moves = {
                buf: Relayout(buf.layout, layout, self.rank, self.group, self.comm) for buf, layout in layouts.items()
            }
            storage.relayout(self.moves)
            self.strategy.relayout(self.moves)
        reducer.relayout(order)
        return bool(layouts)


def carry_state(
    states: dict[str, tuple[torch.Tensor, dict[str, Any]]],
    moves: dict[Any, Relayout],
    storage: Any,
    group: Any,
    comm: C.CommStats,
    device: torch.device,
) -> dict[str, dict[str, Any]]:
    """An optimizer's state (``name -> (tensor, state)`` in the old layout) in the new one,
    ``name -> state``. Where the masters are sharded, a rank's pieces change and their state
    crosses ranks: every rank calls this for the optimizer at the same point (its first use
    after the rebuild: see [Note: optimizers follow the layout] in optim/sharded.py)."""
    if not storage.sharded_master:
        return {name: state for name, (_, state) in states.items()}
    rows = C.all_gather_objects(describe_state(states), group=group, device=device, stats=comm, kind="control")
    return move_state(states, merge_descriptions(rows), [moves[b] for b in storage.buffers if b in moves], device)
