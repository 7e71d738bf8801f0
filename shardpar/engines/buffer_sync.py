"""When module buffers (BatchNorm running statistics) become rank 0's on every rank.

[Note: when buffers are broadcast]
torch DDP's rule (``broadcast_buffers=True``): at the start of a forward, every rank takes
rank 0's buffers -- but only when the *previous* forward synchronised, i.e. ran with autograd
enabled and outside ``no_sync()`` (DDP's ``require_forward_param_sync``, set after each
forward). So an evaluation under ``no_grad`` right after a training step runs on every rank
with rank 0's statistics; with gradient accumulation the broadcast happens at the first
micro-batch after each synchronising one, not at the synchronising micro-batch itself; and
a forward after a ``no_grad`` or ``no_sync`` forward takes nothing.

Taken literally, the rule puts a collective into an evaluation forward under ``no_grad``,
which DDP scripts often run on rank 0 alone (DDP then hangs). shardpar keeps such an
evaluation working and still gives every rank DDP's values: rank 0's buffers cannot change
between the end of the backward that follows a synchronising forward and the next forward
(only a forward writes running statistics; activation checkpointing's recompute runs inside
that backward, before its end). So at the end of that backward -- where every rank is anyway
-- rank 0's buffers are broadcast into a copy on the other ranks, which each rank puts into
its buffers at the start of its next forward, whatever that forward is. Until then every
rank keeps its own statistics, as under DDP. The next forward sends nothing.

Where no backward ran between a synchronising forward and the next forward, the broadcast
happens at that forward's start, as DDP does it (every rank then runs that forward).

A buffer written between that backward and the next forward on a rank other than 0 (by
``load_state_dict``, ``load_checkpoint``, ``reset_running_stats()``) keeps what was written
there: the copy is older. DDP would give every rank rank 0's buffer at that forward, which is
the same wherever every rank wrote the same values, the usual case (a checkpoint load).

The copy costs ranks other than 0 one copy of the module's buffers from the end of a backward
to the next forward. After ``wrap`` every rank already holds rank 0's buffers (DDP also
broadcasts at its first forward), so the first forward sends nothing.

Which buffers: the module's, read at every broadcast from each module's own buffer dict, so a
buffer re-assigned or registered after ``wrap`` (a rotary cache made at the first forward) is
the one sent, as DDP re-reads ``named_buffers()`` before each of its broadcasts. The modules
themselves are listed once, at wrap: walking ``named_modules()`` at every backward's end costs
more than a hundred microseconds on a model of a few hundred modules (a dozen for this
list), and a submodule added after wrap has no parameters shardpar manages either.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..comm import collectives as C
from ..core.wait_clock import WaitClock


class BufferSync:
    """One engine's buffer broadcasts; see [Note: when buffers are broadcast]."""

    def __init__(
        self,
        module: nn.Module,
        group: Any,
        rank: int,
        world_size: int,
        enabled: bool,
        comm: C.CommStats,
        wait_clock: WaitClock,
    ) -> None:
        self.buffer_dicts = [sub._buffers for sub in module.modules()]
        """Every module's own buffer dict (see the note's last paragraph): torch keeps one dict
        per module for its life, and every registration or re-assignment writes into it."""
        self.group = group
        self.rank = rank
        self.enabled = enabled and world_size > 1
        self.comm = comm
        self.wait_clock = wait_clock
        self.last_forward_synced = False
        """DDP's ``require_forward_param_sync``: the last forward had autograd and was outside
        ``no_sync()``. False after wrap, which made every rank's buffers rank 0's."""
        self.received: list[tuple[torch.Tensor, torch.Tensor, int]] | None = None
        """Rank 0's buffers sent at the end of a backward, for the next forward: (this rank's
        buffer, rank 0's values, the buffer's version when they arrived). Empty on rank 0."""

    def before_forward(self) -> None:
        """A root forward starts (not a recompute)."""
        if not self.enabled:
            return
        if self.received is not None:
            received, self.received = self.received, None
            with torch.no_grad():
                for buffer, values, version in received:
                    if buffer._version == version:  # else written since: see the note
                        buffer.data.copy_(values)  # .data: autograd's saved buffers stay valid, as DDP's
        elif self.last_forward_synced:
            self._broadcast()

    def after_forward(self, synced: bool) -> None:
        """A root forward ended: ``synced``, whether it had autograd outside ``no_sync()``."""
        self.last_forward_synced = synced

    def after_backward(self) -> None:
        """A backward ended on every rank; after a synchronising forward, rank 0's buffers are
        sent now and taken at the next forward."""
        if self.enabled and self.last_forward_synced:
            self.received = self._broadcast(into_copies=self.rank != 0)

    def _broadcast(self, into_copies: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        # Each buffer once, in the modules' order, as module.buffers() gives them: one tensor
        # may be registered under two modules.
        buffers = list({id(b): b for own in self.buffer_dicts for b in own.values() if b is not None}.values())
        targets = [torch.empty_like(b) if into_copies else b for b in buffers]
        with torch.no_grad():
            handles = [C.broadcast(t, 0, group=self.group, async_op=True, stats=self.comm) for t in targets]
            for handle in handles:
                self.wait_clock.wait(handle, gather=False)
        if not into_copies:
            return []
        return [(buffer, values, buffer._version) for buffer, values in zip(buffers, targets)]
