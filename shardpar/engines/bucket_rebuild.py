"""The engine's one rebuild of the gradient buckets (stages 0-2): the ranks agree on the new
order, the parts move to it, and the sharded optimizers built over the engine follow; see
[Note: bucket rebuild] in core/rebuild.py.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import collectives as C
from ..core.rebuild import Relayout, describe_state, merge_descriptions, move_state
from ..core.reducer import GradientReducer


class BucketRebuild:
    """One rebuild, at the end of the first synchronising backward. Every rank takes part, in
    the same order: one object all-gather, then (where a layout changes) the all-gathers that
    move sharded values. ``optimizers``: the live sharded optimizers, each with its serial."""

    def __init__(self, reducer: GradientReducer, storage: Any, strategy: Any, optimizers: list[tuple[int, Any]],
                 rank: int, group: Any, comm: C.CommStats, device: torch.device) -> None:
        self.reducer, self.storage, self.strategy = reducer, storage, strategy
        self.optimizers = optimizers
        self.rank, self.group, self.comm, self.device = rank, group, comm, device
        self.moves: dict[Any, Relayout] = {}

    def relayout(self) -> bool:
        """Agree on the ready order and move the storage, the strategy and the reducer to it;
        whether any layout changed (else nothing else moves)."""
        reducer, storage = self.reducer, self.storage
        record, reducer.ready_order = reducer.ready_order, None
        self.states = {serial: opt.state_by_name() for serial, opt in self.optimizers}
        self.sharded = storage.sharded_master  # optimizer pieces differ by rank: their state crosses ranks
        described = {serial: describe_state(state) for serial, state in self.states.items()} if self.sharded else {}
        proposal = record.proposal(reducer.names)
        self.rows = C.all_gather_objects((proposal, described), group=self.group, device=self.device,
                                         stats=self.comm, kind="control")
        order = [reducer.names[i] for i in self.rows[0][0]]
        layouts = storage.rebuilt_layouts(order)
        if layouts:
            self.moves = {buf: Relayout(buf.layout, layout, self.rank, self.group, self.comm)
                          for buf, layout in layouts.items()}
            storage.relayout(self.moves)
            self.strategy.relayout(self.moves)
        reducer.relayout(order)
        return bool(layouts)

    def repoint_optimizers(self) -> None:
        """After a layout changed: each optimizer's pieces point at the new layout, its state moved."""
        rows, states, moves = self.rows, self.states, self.moves
        # An optimizer alive on some ranks only is garbage not collected yet elsewhere: left
        # alone, it refuses to step (its generation is old).
        everywhere = set.intersection(*(set(row[1]) for row in rows)) if self.sharded else set(states)
        for serial, opt in self.optimizers:
            if serial not in everywhere:
                continue
            if self.sharded:
                merged = merge_descriptions(row[1][serial] for row in rows)
                opt.repoint(move_state(states[serial], merged, [moves[b] for b in self.storage.buffers if b in moves],
                                       self.device))
            else:
                opt.repoint({name: state for name, (_, state) in states[serial].items()})
