"""A DistMuon-style peer for issue #43's benchmark: nanochat's ``DistMuon`` and ``DistAdamW``
in their essentials, over torch's own ``Muon`` and ``AdamW``: the optimizer of config
``distmuon`` (``DistMuonRunner`` in runners.py).

[Note: the DistMuon peer]
The model is not wrapped: every rank runs forward and backward on its own batch and keeps its
local gradients (no collective in backward, so gradient accumulation needs nothing). The
optimizer step moves them, in two optimizers over one model as nanochat splits it (the
blocks' matrices to Muon, the embedding and the head to AdamW):

- :class:`DistMuon` gives each matrix one owner rank: longest first (by elements), each to the
  rank holding the fewest elements so far, so the heaviest rank holds at most the average plus
  one matrix. The local gradients are laid out in one flat buffer by owner, each rank's
  segment padded to the longest segment, divided by the world size and reduce-scattered: each
  owner receives the averaged whole gradient of its matrices. It runs ``torch.optim.Muon`` on
  them (so only the owner holds their momentum and runs their Newton-Schulz), and the updated
  matrices go back to every rank by one all-gather of the segments.
- :class:`DistAdamW` is ZeRO-1: each param group's parameters are concatenated into one flat
  vector padded to a multiple of the world size, rank r owns slice r, reduce-scattered from
  the local gradients (divided by the world size first), and keeps the fp32 values and
  AdamW's moments of that slice only; the updated slices are all-gathered back.

Per rank, bytes sent per step are ``2·(P_muon + P_adamw)·4·(N-1)/N`` plus padding, as DDP's,
and the optimizer state is about 1/N of DDP's. :class:`DistMuonAdamW` starts both
reduce-scatters before either step, so AdamW's gradients travel while Muon computes.

At world size 2 training is bit for bit torch DDP + the same two optimizers on the same
per-rank batches: the averaged gradient is ``g0/2 + g1/2`` (halving is exact and a sum of two
values does not depend on their order), Muon steps the same whole matrices, and AdamW's update
is elementwise, so its flat slices compute what whole tensors do. At larger world sizes the
reduction order of the collective may differ from DDP's by an ulp.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .optimizers import ADAMW_OPTIONS, MUON_OPTIONS, muon_and_adamw_params


def owners_longest_first(numels: list[int], world: int) -> list[int]:
    """Each tensor's owner rank: longest first (ties by position), each to the least loaded
    rank so far (ties to the lowest rank). The heaviest rank's load is at most the average
    plus one tensor."""
    loads = [0] * world
    owners = [0] * len(numels)
    for index in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        rank = min(range(world), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += numels[index]
    return owners


def _flat_grad(param: nn.Parameter) -> torch.Tensor:
    """The local gradient, flattened (zeros where backward gave none: a rank that did not use
    a parameter counts zero in the average, as DDP's ``find_unused_parameters`` counts it)."""
    return (
        torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
        if param.grad is None
        else param.grad.reshape(-1)
    )


class _OwnedShares:
    """What both peers share: a step is a reduce-scatter, this rank's update and an all-gather
    (``start_reduce``, ``step_and_start_gather``, ``finish_gather``), and the state is the
    inner optimizer's over what this rank owns (none where it owns nothing)."""

    params: list[nn.Parameter]
    inner: torch.optim.Optimizer | None

    def start_reduce(self) -> None:
        raise NotImplementedError

    def step_and_start_gather(self) -> None:
        raise NotImplementedError

    def finish_gather(self) -> None:
        raise NotImplementedError

    def step(self) -> None:
        self.start_reduce()
        self.step_and_start_gather()
        self.finish_gather()

    def zero_grad(self) -> None:
        for param in self.params:
            param.grad = None

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """This rank's optimizer state (Muon: the momentum of the matrices it owns; AdamW: the
        moments of its slice, and its step)."""
        if self.inner is not None:
            for state in self.inner.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class DistMuon(_OwnedShares):
    """Whole matrices owned round-robin by size: see [Note: the DistMuon peer]."""

    def __init__(self, params: Iterable[nn.Parameter], **options: Any) -> None:
        self.params = list(params)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.owners = owners_longest_first([p.numel() for p in self.params], self.world)
        self.offsets: list[int] = []  # each matrix's offset in its owner's segment
        loads = [0] * self.world
        for param, owner in zip(self.params, self.owners):
            self.offsets.append(loads[owner])
            loads[owner] += param.numel()
        self.segment = max(loads)  # every rank's segment padded to the longest
        self.owned = [p for p, owner in zip(self.params, self.owners) if owner == self.rank]
        self.inner = torch.optim.Muon(self.owned, **options) if self.owned else None
        self._reduce: Any = None
        self._gather: Any = None

    def start_reduce(self) -> None:
        """Launch the reduce-scatter that brings each owner its matrices' averaged gradients."""
        assert self._reduce is None, "a reduce-scatter is already in flight"
        first = self.params[0]
        send = torch.zeros(self.world * self.segment, dtype=first.dtype, device=first.device)
        for param, owner, offset in zip(self.params, self.owners, self.offsets):
            start = owner * self.segment + offset
            send[start : start + param.numel()].copy_(_flat_grad(param))
        send.div_(self.world)
        received = torch.empty(self.segment, dtype=first.dtype, device=first.device)
        self._reduce = (dist.reduce_scatter_tensor(received, send, async_op=True), received)

    def step_and_start_gather(self) -> None:
        """Wait for the gradients, step the owned matrices, launch the all-gather of the segments."""
        work, received = self._reduce
        work.wait()
        self._reduce = None
        for param, owner, offset in zip(self.params, self.owners, self.offsets):
            if owner == self.rank:
                param.grad = received[offset : offset + param.numel()].view_as(param)
        if self.inner is not None:
            self.inner.step()
        mine = torch.zeros_like(received)
        for param, owner, offset in zip(self.params, self.owners, self.offsets):
            if owner == self.rank:
                mine[offset : offset + param.numel()].copy_(param.detach().reshape(-1))
        gathered = torch.empty(self.world * self.segment, dtype=mine.dtype, device=mine.device)
        self._gather = (dist.all_gather_into_tensor(gathered, mine, async_op=True), gathered)

    @torch.no_grad()
    def finish_gather(self) -> None:
        """Every rank takes the matrices it does not own from their owners."""
        work, gathered = self._gather
        work.wait()
        self._gather = None
        for param, owner, offset in zip(self.params, self.owners, self.offsets):
            if owner != self.rank:
                start = owner * self.segment + offset
                param.copy_(gathered[start : start + param.numel()].view_as(param))


class DistAdamW(_OwnedShares):
    """ZeRO-1 AdamW over flat slices: see [Note: the DistMuon peer]."""

    def __init__(self, params: Iterable[nn.Parameter], **options: Any) -> None:
        self.params = list(params)
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        total = sum(p.numel() for p in self.params)
        self.slice = -(-total // self.world)  # 1-D, the flat vector padded to world * slice
        flat = torch.zeros(self.world * self.slice, dtype=self.params[0].dtype, device=self.params[0].device)
        torch.cat([p.detach().reshape(-1) for p in self.params], out=flat[:total])
        self.master = flat[self.rank * self.slice : (self.rank + 1) * self.slice].clone()  # this rank's values
        self.inner = torch.optim.AdamW([self.master], **options)
        self._reduce: Any = None
        self._gather: Any = None

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.zeros(self.world * self.slice, dtype=self.master.dtype, device=self.master.device)
        torch.cat(tensors, out=flat[: sum(t.numel() for t in tensors)])
        return flat

    def start_reduce(self) -> None:
        assert self._reduce is None, "a reduce-scatter is already in flight"
        send = self._flat([_flat_grad(p) for p in self.params]).div_(self.world)
        received = torch.empty_like(self.master)
        self._reduce = (dist.reduce_scatter_tensor(received, send, async_op=True), received)

    def step_and_start_gather(self) -> None:
        work, received = self._reduce
        work.wait()
        self._reduce = None
        self.master.grad = received
        self.inner.step()
        gathered = torch.empty(self.world * self.slice, dtype=self.master.dtype, device=self.master.device)
        self._gather = (dist.all_gather_into_tensor(gathered, self.master, async_op=True), gathered)

    @torch.no_grad()
    def finish_gather(self) -> None:
        work, gathered = self._gather
        work.wait()
        self._gather = None
        start = 0
        for param in self.params:
            param.copy_(gathered[start : start + param.numel()].view_as(param))
            start += param.numel()


class DistMuonAdamW:
    """Both, as one optimizer: both reduce-scatters start before either step."""

    def __init__(self, model: nn.Module) -> None:
        matrices, rest = muon_and_adamw_params(model)
        self.parts: list[DistMuon | DistAdamW] = [DistMuon(matrices, **MUON_OPTIONS), DistAdamW(rest, **ADAMW_OPTIONS)]

    def step(self) -> None:
        for part in self.parts:
            part.start_reduce()
        for part in self.parts:
            part.step_and_start_gather()
        for part in self.parts:
            part.finish_gather()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def state_tensors(self) -> Iterator[torch.Tensor]:
        for part in self.parts:
            yield from part.state_tensors()
