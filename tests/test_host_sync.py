"""The sync audit of issue #31: no call from shardpar's code in a steady-state step would make
the host wait for a GPU ([Note: no host sync in a step] in shardpar/comm/host.py).

On the CPU nothing can be measured against a device, so the audit counts the *calls* that
would sync one: ``Tensor.item``/``tolist``/``cpu``/``numpy``, ``bool``/``int``/``float`` of a
tensor, ``torch.equal``, ``nonzero``, ``masked_select``, and tensors made from Python data
(``torch.tensor``/``as_tensor``, which then need a copy to the device). A call counts when the
frame that makes it is shardpar's own code, except shardpar/comm/host.py, whose reads are of
host memory behind an event and whose copies go from pinned memory without blocking. The
steps run on the paths CUDA takes (``forcing_native_paths`` and ``deferring_reads``: see
tests/test_nccl_paths_on_gloo.py) and on gloo's own. tests/test_cuda.py runs the same kind of
step under ``torch.cuda.set_sync_debug_mode("error")`` where a GPU is lent.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardpar
from shardpar.comm import backend_traits, host
from tests.support.harness import run_ranks

_PACKAGE = os.path.dirname(shardpar.__file__) + os.sep
_EXEMPT = os.path.abspath(host.__file__)

_TENSOR_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero", "masked_select")
_TORCH_FUNCTIONS = ("equal", "nonzero", "masked_select", "tensor", "as_tensor")


@contextlib.contextmanager
def counting_syncs() -> Iterator[Counter]:
    """Count the calls named above made from shardpar's code (file:line -> calls)."""
    counts: Counter = Counter()
    saved: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1)
            path = os.path.abspath(caller.f_code.co_filename)
            if path.startswith(_PACKAGE) and path != _EXEMPT:
                counts[f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{caller.f_lineno} {name}"] += 1
            return original(*args, **kwargs)

        saved.append((owner, name, original))
        setattr(owner, name, counted)

    for name in _TENSOR_METHODS:
        wrap(torch.Tensor, name)
    for name in _TORCH_FUNCTIONS:
        wrap(torch, name)
    try:
        yield counts
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.norm(self.fc(x)).relu()


class Net(nn.Module):
    """Blocks (stage-3 units), one of them checkpointed (reentrant and not, alternately) and
    one used twice, a frozen parameter and a head."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.frozen = nn.Parameter(torch.ones(width), requires_grad=False)
        self.head = nn.Linear(width, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.inp(x) * self.frozen
        x = checkpoint(self.blocks[0], x, use_reentrant=self.calls % 2 == 0)
        x = self.blocks[1](self.blocks[1](x))
        return self.head(self.blocks[2](x))


def _audit(stage: int, mixed_precision: str | None, like_cuda: bool) -> dict[str, int]:
    paths = contextlib.ExitStack()
    if like_cuda:
        paths.enter_context(backend_traits.forcing_native_paths())
        paths.enter_context(host.deferring_reads())
    with paths:
        torch.manual_seed(0)
        model = shardpar.wrap(
            Net(), stage=stage, mixed_precision=mixed_precision, wrap_policy=[Block], min_unit_params=1
        )
        opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
        x = torch.randn(6, 8)

        def step() -> None:
            with model.no_sync():  # gradient accumulation
                model(x).square().mean().backward()
            model(x).square().mean().backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()

        for _ in range(3):  # warm-up: the first backward agrees on the launch order, rebuilds buckets
            step()
        with counting_syncs() as counts:
            for _ in range(2):
                step()
    return dict(counts)


@pytest.mark.parametrize("like_cuda", [True, False], ids=["cuda-paths", "gloo-paths"])
@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_no_host_sync_in_a_steady_step(stage: int, mixed_precision: str | None, like_cuda: bool) -> None:
    for rank, counts in enumerate(run_ranks(_audit, 2, stage, mixed_precision, like_cuda)):
        assert counts == {}, f"rank {rank}: calls that would sync a GPU in steady steps: {counts}"


def test_the_audit_counts_what_it_should() -> None:
    """The counter sees a sync made from shardpar's code (here: a clipping that must check the
    norm on the host, torch's own ``error_if_nonfinite``), and not one made from elsewhere."""
    torch.manual_seed(0)
    model = shardpar.wrap(nn.Linear(4, 4), stage=0)
    model(torch.randn(2, 4)).sum().backward()
    with counting_syncs() as counts:
        torch.zeros(2).tolist()  # this file: not shardpar's
        model.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert sum(counts.values()) >= 1 and all("module.py" in key for key in counts), counts
