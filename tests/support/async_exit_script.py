"""A script that saves asynchronously and exits without waiting, for
tests/test_async_checkpoint.py:

    torchrun --nproc-per-node 2 tests/support/async_exit_script.py OUT      # the save must commit
    python tests/support/async_exit_script.py OUT --full-disk                # the save fails: exit 1

Trains the KitchenSink two steps, saves ``OUT/step-2`` with ``async_save=True`` (its first
write held back a second, so the script surely exits while it writes), writes what it saved
to ``OUT/expected.safetensors``, destroys the process group as scripts do at their end, and
returns. With ``--full-disk`` every write fails as on a full disk.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

import shardpar  # noqa: E402
from shardpar.checkpoint import io as checkpoint_io  # noqa: E402
from shardpar.checkpoint.files import write_failure  # noqa: E402
from shardpar.comm import collectives as C  # noqa: E402
from tests.support.checkpoint_helpers import build, train  # noqa: E402


def slow_or_full_disk(full: bool) -> None:
    write = checkpoint_io.SafetensorsWriter.write
    first = [True]

    def slow_write(self: checkpoint_io.SafetensorsWriter, tensor) -> None:
        if first[0]:
            first[0] = False
            time.sleep(1.0)
        if full:
            raise write_failure(self.path, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
        write(self, tensor)

    checkpoint_io.SafetensorsWriter.write = slow_write


def main() -> None:
    out = Path(sys.argv[1])
    module, model, opt = build(2)
    train(module, model, opt, 0, 2)
    slow_or_full_disk("--full-disk" in sys.argv)
    handle = shardpar.save_checkpoint(out / "step-2", model, opt, extra={"step": 2}, async_save=True)
    state = model.full_state_dict()  # a collective, while the save writes
    if C.get_rank() == 0:
        save_file({k: v.clone() for k, v in state.items()}, str(out / "expected.safetensors"))  # untie
    train(module, model, opt, 2, 3)
    rank = C.get_rank()
    if dist.is_initialized():
        dist.destroy_process_group()
    if not handle.done():
        print(f"rank {rank}: exiting with the save still writing", flush=True)


if __name__ == "__main__":
    main()
