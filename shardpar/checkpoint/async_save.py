"""Asynchronous checkpoint saves: the handle ``save_checkpoint`` returns, the host copy a
background save writes from, the thread that writes it, and what happens at exit. The
save's phases themselves are :mod:`.save`'s, the same for both kinds of save.

[Note: asynchronous saves]
``save_checkpoint(..., async_save=True)`` cuts the synchronous protocol (docs/
checkpoint-format.md, "Writing") where the ranks stop needing the model:

- In the call, on every rank, as a synchronous save does it: enter together, check the
  arguments, list the pieces, let rank 0 make the temporary directory, agree, and move the
  pieces of reordered tensors to their writers (collectives of the model's group, which is
  safe here: every rank is in the call). Then copy every piece this rank writes into host
  memory ([Note: staging a snapshot] in host_bytes.py) and agree once more, so that no
  rank starts writing alone. What the manifest needs is taken in the call as well. What is
  saved is therefore what the model and optimizer held at the call, whatever training does
  next; the call blocks for the copies only.
- In a thread: write the rank file from the copy, verify the next rank's file, and rank 0
  writes the manifest and renames -- the same code as a synchronous save, with each
  agreement made through the store instead of the model's group ([Note: exchanges through
  the store] in comm/store_exchange.py), so it never meets training's collectives. Writing
  and hashing release the GIL (``write`` and ``hashlib`` on large buffers), so the training
  thread runs meanwhile.

So the files, the manifest and the moment the checkpoint becomes visible are those of a
synchronous save: nothing is visible until every file is written and verified, then one
rename. A rank killed at any point leaves the previous checkpoint as it was.

Errors: every phase still ends in an agreement, so a failure on any rank (a full disk, a
read-only file system) fails the save on every rank, and a rank that died or stalls is named
by the exchange. The error is a CheckpointError naming the checkpoint and the rank, and the
file where a file failed. Every rank raises it from ``wait()``; where the script never
waited, from the next ``save_checkpoint`` (which first waits for the save in progress: one
at a time per process), or else at exit.

At exit the interpreter waits for the thread (it is not a daemon) before it runs the
``atexit`` functions, so a pending save is finished, not dropped; then an error nobody has
seen is printed on stderr, and the process exits with status 1: a run whose last
checkpoint failed must not look like a success.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..comm.store_exchange import StoreExchange, default_store
from ..errors import CheckpointError
from .dtypes import parse_dtype
from .format import StoredItem
from .host_bytes import HostStaging
from .protocol import Agree, settle

_STAGING = HostStaging()
"""What this process's asynchronous saves write from; see [Note: staging a snapshot]."""
_pending: SaveHandle | None = None
"""This process's latest asynchronous save, until it succeeded or its error was raised."""
_exit_hook: list[bool] = []


class SaveHandle:
    """What :func:`shardpar.save_checkpoint` returns: ``wait()`` until the checkpoint at
    ``path`` is visible (raising the save's error, on every rank), ``done()`` to ask without
    waiting. A synchronous save returns one that is done. See [Note: asynchronous saves]."""

    def __init__(self, path: Path, rank: int = 0) -> None:
        self.path = path
        self.rank = rank
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._raised = False

    @classmethod
    def finished(cls, path: Path) -> SaveHandle:
        return cls(path)

    def done(self) -> bool:
        """Whether the save has ended (the checkpoint is visible, or the save failed)."""
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save has ended; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            self._raised = True
            raise self._error

    def unraised_error(self) -> BaseException | None:
        """Once the save has ended: its error, if ``wait()`` has not raised it yet."""
        if self._thread is not None:
            self._thread.join()
        return None if self._raised else self._error

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._error is not None else "done"
        return f"<shardpar checkpoint save of {self.path}: {state}>"


def finish_pending(raise_error: bool = True) -> None:
    """Wait for this process's save in progress, if any, and (``raise_error``) raise its error
    if nothing has raised it yet."""
    global _pending
    handle = _pending
    if handle is None:
        return
    if handle.unraised_error() is None:
        _pending = None
    elif raise_error:
        _pending = None
        handle.wait()


Written = tuple[StoredItem, "torch.Tensor | Callable[[], torch.Tensor]"]
"""An item a rank writes and its values (1-D), or what makes them when the file is written
(reordered pieces; see [Note: reordered pieces] in reorder.py)."""


def stage(items: list[Written], device: torch.device) -> list[Written]:
    """The items with their values copied into host memory (this process's staging buffer)."""
    copies = _STAGING.copy_in(
        [(parse_dtype(item.dtype), item.end - item.start, values) for item, values in items], device
    )
    return [(item, copy) for (item, _), copy in zip(items, copies)]


def start_in_background(
    target: Path, rank: int, world_size: int, timeout_s: float, prefix: str, run: Callable[[Agree], None]
) -> SaveHandle:
    """Run ``run(agree)`` in a thread, its agreements made through the store under ``prefix``
    (unique to this save); the handle holds its outcome."""
    global _pending
    handle = SaveHandle(target, rank)
    exchange = StoreExchange(default_store(), prefix, rank, world_size, timeout_s)

    def agree(problem: BaseException | None, what: str, payload: Any = None) -> list[Any]:
        def gather(mine: Any) -> list[Any]:
            return [json.loads(text) for text in exchange.all_gather(json.dumps(mine), what)]

        return settle(problem, what, gather, payload, name_own_rank=rank)

    def body() -> None:
        try:
            run(agree)
        except Exception as error:
            handle._error = CheckpointError(f"the asynchronous save_checkpoint to {target} failed: {error}")
            handle._error.__cause__ = error
        except BaseException as error:  # not a failure of the save (a test's stand-in for a kill)
            handle._error = error
        finally:
            try:
                exchange.close("save_checkpoint (done)")
            except Exception as error:  # the checkpoint's fate was agreed already
                warnings.warn(f"rank {rank}: after the asynchronous save_checkpoint to {target}: {error}", stacklevel=1)

    handle._thread = threading.Thread(target=body, name=f"shardpar-save-{target.name}")  # not a daemon: see the note
    if not _exit_hook:
        atexit.register(_report_at_exit)
        _exit_hook.append(True)
    _pending = handle
    handle._thread.start()
    return handle


def _report_at_exit() -> None:
    """An error of a save nobody waited for: on stderr, and exit status 1 (see [Note:
    asynchronous saves]). The interpreter has waited for the thread already."""
    error = None if _pending is None else _pending.unraised_error()
    if error is None:
        return
    assert _pending is not None  # it gave the error
    print(
        f"[rank{_pending.rank}] shardpar: {error} (the script exited without waiting for this save)",
        file=sys.stderr,
        flush=True,
    )
    sys.stdout.flush()
    os._exit(1)
