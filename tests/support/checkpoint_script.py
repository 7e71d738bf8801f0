"""Checkpoint scenarios that need fresh processes, run by tests/test_checkpoint_crash.py:

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 2 tests/support/checkpoint_script.py OUT [--async-save]

First measures the peak memory of save_checkpoint, save_full and load_checkpoint on a 67 MB
model at stage 3 (``OUT/memory-rank<r>.json``) -- first, while the processes are fresh --
then saves ``OUT/ckpt/step-1`` (its values in ``OUT/expected.safetensors``), trains on, and
has rank 1 SIGKILL itself halfway through writing its file of ``OUT/ckpt/step-2``. One
launch serves both tests because starting ranks is the slow part. With ``--async-save``
every save is asynchronous: the memory measured is the call's and the background's until
the save is complete, and rank 1 dies in the background thread while training goes on.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from torch import nn  # noqa: E402

import shardpar  # noqa: E402
from shardpar.checkpoint.save import TEST_CRASH_ENV  # noqa: E402
from shardpar.comm import collectives as C  # noqa: E402
from tests.support.models import KITCHEN, MLPStack  # noqa: E402


def train_step(module: nn.Module, model: shardpar.ShardedModule, opt, seed: int) -> None:
    x, y = module.example(4, torch.Generator().manual_seed(seed * 100 + C.get_rank()))
    module.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def crash(out: Path, async_save: bool) -> None:
    """Save ``ckpt/step-1``, train on, then rank 1 dies inside the save of ``ckpt/step-2``."""
    module = KITCHEN.build()
    model = shardpar.wrap(module, stage=2)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    train_step(module, model, opt, 1)
    shardpar.save_checkpoint(out / "ckpt" / "step-1", model, opt, extra={"step": 1}, async_save=async_save).wait()
    expected = model.full_state_dict()  # a collective: every rank calls it
    if C.get_rank() == 0:
        save_file({k: v.clone() for k, v in expected.items()}, str(out / "expected.safetensors"))  # untie
    train_step(module, model, opt, 2)
    C.barrier()
    os.environ[TEST_CRASH_ENV] = "1:write"
    (out / f"saving-step-2-rank{C.get_rank()}").touch()
    handle = shardpar.save_checkpoint(out / "ckpt" / "step-2", model, opt, extra={"step": 2}, async_save=async_save)
    train_step(module, model, opt, 3)  # an asynchronous save is killed while this runs, or after it
    handle.wait()
    raise SystemExit("unreachable: the save should have been killed")


# [Note: measuring peak memory]
# tracemalloc sees no torch allocations, and the CPU allocator keeps no statistics, so this
# measures the OS's view: the peak resident set (VmHWM), reset just before the operation by
# writing "5" to /proc/self/clear_refs (Linux >= 4.0). Two things would make RSS lie, and
# both are ruled out: glibc could serve allocations from memory freed earlier without RSS
# growing (the test runs us with MALLOC_MMAP_THRESHOLD_=65536, so every large allocation is
# its own mmap, returned to the OS when freed), and file pages mapped by a reader would
# count as resident (shardpar reads with readinto, writes with write(), maps nothing).


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _peak_since(base: int) -> int:
    return _status("VmHWM") - base


def memory(out: Path, async_save: bool) -> None:
    sizes = (2048,) * 5  # 4 Linear layers of 2048x2048: 16.8M parameters, 67 MB in fp32
    torch.manual_seed(0)
    module = MLPStack(sizes)
    model = shardpar.wrap(module, stage=3, wrap_policy=(nn.Linear,))
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
    train_step(module, model, opt, 1)
    shard_bytes = sum(p.tensor.numel() * p.tensor.element_size() for p in model.engine.save_pieces())
    state_bytes = opt.state_bytes()
    path = out / "ckpt" / "step-1"

    out.mkdir(parents=True, exist_ok=True)
    try:
        _reset_peak()
    except OSError as error:  # no /proc/self/clear_refs here: nothing to measure with
        (out / f"memory-rank{C.get_rank()}.json").write_text(json.dumps({"unsupported": str(error)}))
        return
    C.barrier()
    base = _reset_peak()
    shardpar.save_checkpoint(path, model, opt, extra={"step": 1}, async_save=async_save).wait()
    save_peak = _peak_since(base)

    C.barrier()
    base = _reset_peak()
    shardpar.save_full(out / "full", model, max_shard_size="40MB")
    full_peak = _peak_since(base)

    del model, opt, module
    torch.manual_seed(1)
    module = MLPStack(sizes)
    model = shardpar.wrap(module, stage=3, wrap_policy=(nn.Linear,))
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-3)
    C.barrier()
    base = _reset_peak()
    shardpar.load_checkpoint(path, model, opt)
    load_peak = _peak_since(base)
    loaded_state_bytes = opt.state_bytes()

    result = {
        "rank": C.get_rank(),
        "model_bytes": sum(p.numel() * p.element_size() for p in module.parameters()),
        "param_shard_bytes": shard_bytes,
        "state_bytes": state_bytes,
        "loaded_state_bytes": loaded_state_bytes,
        "save_peak": save_peak,
        "save_full_peak": full_peak,
        "load_peak": load_peak,
    }
    (out / f"memory-rank{C.get_rank()}.json").write_text(json.dumps(result))


def main() -> None:
    out = Path(sys.argv[1])
    faulthandler.dump_traceback_later(200, exit=True)  # a hang shows where, before the test's timeout
    torch.set_num_threads(1)
    async_save = "--async-save" in sys.argv
    memory(out / "memory", async_save)
    crash(out, async_save)


if __name__ == "__main__":
    main()
