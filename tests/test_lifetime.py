"""What a wrapped model leaves behind once the script lets go of it.

A dropped model and its optimizer must be freed like any Python objects (a sweep or a notebook
wraps many models in one process), and after ``destroy_process_group`` no process group of
shardpar's may stay alive, since its backend's threads would then run into the interpreter's
exit: [Note: no group outlives destroy_process_group] in shardpar/comm/process_group.py.
"""

from __future__ import annotations

import gc
import sys
import weakref
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint

import shardpar
from tests.support.harness import run_ranks, run_script
from tests.support.models import TRANSFORMER, Block

BF16 = shardpar.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)


def _checkpoint_blocks(module: torch.nn.Module) -> None:
    # (A function of its own, so that no loop variable of the caller keeps a block alive.)
    for block in module.blocks:
        forward = block.forward
        block.forward = lambda x, forward=forward: torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=False)


def _train_then_drop(stage: int, mixed: bool, checkpointed: bool) -> dict[str, bool]:
    """Two steps of the usual script (a no_sync micro-batch, activation checkpointing per block,
    tied embedding and head), then drop the model and its optimizer: which objects are still
    alive after one collection."""
    module = TRANSFORMER.build()
    if checkpointed:
        _checkpoint_blocks(module)
    model = shardpar.wrap(module, stage=stage, wrap_policy=[Block], mixed_precision=BF16 if mixed else None)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    generator = torch.Generator().manual_seed(torch.distributed.get_rank())
    for _ in range(2):
        for micro in range(2):
            tokens, targets = module.example(4, generator)
            with model.no_sync() if micro == 0 else nullcontext():
                module.loss(model(tokens), targets).backward()
        opt.step()
        opt.zero_grad()
    refs = {
        "model": weakref.ref(model),
        "engine": weakref.ref(model.engine),
        "optimizer": weakref.ref(opt),
        "parameter": weakref.ref(next(module.parameters())),
        "module": weakref.ref(module),
    }
    del model, opt, module
    gc.collect()
    return {name: ref() is not None for name, ref in refs.items()}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mixed, checkpointed", [(False, False), (True, True)], ids=["fp32", "bf16-checkpointed"])
def test_a_dropped_model_and_its_optimizer_are_freed(stage: int, mixed: bool, checkpointed: bool) -> None:
    # Before, each parameter's gradient hook held the engine from C++, where the cycle
    # collector cannot see: every wrapped model, its optimizer state and its tensors lived on.
    for rank, alive in enumerate(run_ranks(_train_then_drop, 2, stage, mixed, checkpointed)):
        assert not any(alive.values()), f"rank {rank}: still alive after the script dropped them: " + ", ".join(
            name for name, is_alive in alive.items() if is_alive
        )


def _keep_a_parameter(stage: int) -> list[float] | None:
    """Drop a wrapped model but keep one of its parameters, then backward through it."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model = shardpar.wrap(module, stage=stage, min_unit_params=1)
    model(torch.randn(3, 4)).sum().backward()
    engine = weakref.ref(model.engine)
    kept = module[1].bias
    del model, module
    gc.collect()
    if engine() is not None:
        return None
    kept.grad = None
    (kept * 2).sum().backward()
    return kept.grad.tolist()


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_a_parameter_kept_past_its_engine_is_a_plain_parameter(stage: int) -> None:
    # Its gradient hook outlives the engine (a weak reference to it): a backward through the
    # parameter then accumulates plainly, as for any tensor, instead of calling a dead engine.
    # (At stage 3 a parameter holds no values between steps, so it is not kept usefully.)
    for rank, grad in enumerate(run_ranks(_keep_a_parameter, 2, stage)):
        assert grad == [2.0, 2.0], (rank, grad)


def _read_a_parameter_past_its_engine() -> str:
    """Drop a stage-3 model, keep one of its parameters (sharded: no values here), read it."""
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model = shardpar.wrap(module, stage=3, min_unit_params=1)
    model(torch.randn(3, 4)).sum().backward()
    engine = weakref.ref(model.engine)
    kept = module[1].weight
    del model, module
    gc.collect()
    assert engine() is None, "the engine outlived its model"
    with pytest.raises(RuntimeError) as raised:
        kept + 1
    return str(raised.value)


def test_a_stage3_parameter_kept_past_its_engine_says_so_when_read() -> None:
    # Its guard went with the engine's flat group (the guard table holds no engine object),
    # so the read cannot name the unit; it says what happened instead of reading freed memory.
    for message in run_ranks(_read_a_parameter_past_its_engine, 2):
        assert "(2, 4)" in message and "engine that held them no longer exists" in message, message


GROUPS_SCRIPT = r"""
import gc, glob, sys, weakref
import torch, torch.distributed as dist
from torch import nn
import shardpar  # as scripts do: imported before the group exists

dist.init_process_group("gloo")
world = weakref.ref(dist.group.WORLD)

def train(stage):
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    module = nn.Sequential(torch.compile(block), nn.Linear(8, 8), nn.Linear(8, 2))
    model = shardpar.wrap(module, stage=stage, min_unit_params=1)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    gather_group = model.engine.gatherer.group if stage == 3 else None
    return weakref.ref(gather_group) if gather_group is not None else None

siblings = [train(stage) for stage in (0, 1, 2, 3)]
assert siblings[3] is not None, "stage 3 gathers on its own group"
rank = dist.get_rank()
dist.destroy_process_group()
gc.collect()
alive = [name for name, ref in [("the default group", world), ("stage 3's gather group", siblings[3])]
         if ref() is not None]
# Thread names are readable on Linux (/proc); elsewhere the groups' own lifetime is the check.
threads = sorted(open(path).read().strip() for path in glob.glob("/proc/self/task/*/comm"))
gloo_threads = [name for name in threads if "gloo" in name]
print(f"rank {rank}: alive={alive} gloo_threads={gloo_threads}", flush=True)
sys.exit(1 if alive or gloo_threads else 0)
"""


def test_no_process_group_outlives_destroy_process_group(tmp_path: Path) -> None:
    # Three holders kept the groups (and gloo's threads) alive past destroy_process_group:
    # torch modules with `group=group.WORLD` defaults imported by Dynamo at the first wrap, the
    # engine held by its parameter hooks, and the per-process cache of stage 3's gather group.
    # A finished run could then abort at exit ("terminate called without an active exception").
    script = tmp_path / "groups.py"
    script.write_text(GROUPS_SCRIPT)
    run = run_script(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)],
        timeout=180,
        env={"OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in range(2):
        assert f"rank {rank}: alive=[] gloo_threads=[]" in run.stdout, run.stdout
