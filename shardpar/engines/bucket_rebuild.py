"""The engine's one rebuild of the gradient buckets (stages 0-2): the ranks agree on the new
order and the parts move to it; the sharded optimizers built before follow on their next use.
See [Note: bucket rebuild] in core/rebuild.py.
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
        """Each parameter space whose layout changed: its move (kept by the engine for the
        optimizers that follow later)."""

    def relayout(self) -> bool:
        """Agree on the ready order and move the storage, the strategy and the reducer to it;
        whether any layout changed (else nothing else moves)."""
        reducer, storage = self.reducer, self.storage
        record, reducer.ready_order = reducer.ready_order, None
        assert record is not None  # the engine rebuilds only while the reducer records a ready order
        proposal = record.proposal(reducer.names)
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
