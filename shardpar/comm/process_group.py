"""The process groups the collectives run on: the default group made from torchrun's
environment, the world size and rank (1 and 0 without any group), the timeout a group is
given, and the sibling groups that keep two streams of collectives apart.
"""

from __future__ import annotations

import datetime
import importlib
import os
import weakref
from typing import Any

import torch
import torch.distributed as dist

from . import compat, devices, watch

ProcessGroup = Any  # torch's ProcessGroup; kept loose so world size 1 needs no torch.distributed

# [Note: no group outlives destroy_process_group]
# After ``dist.destroy_process_group()`` nothing of shardpar's may hold a process group, as
# nothing of plain torch's does: a group still referenced keeps its backend's threads running
# into the interpreter's exit, where gloo's can abort a run that finished ("terminate called
# without an active exception"). Three things held them:
# - some torch modules give their functions ``group=group.WORLD`` as a default argument,
#   evaluated once at import, so importing them after ``init_process_group`` keeps that group
#   alive for good; ``torch.compiler.disable`` (which shardpar's hooks need) imports them
#   through Dynamo at the first wrap. They are imported here instead, with shardpar, when no
#   group exists yet and the default is None (milliseconds);
# - the parameter hooks held the engine, which holds the group (see [Note: hooks hold their
#   owner weakly] in engines/hooks.py);
# - the sibling groups below are kept per parent group, weakly.
# tests/test_lifetime.py checks that the groups are freed at every stage.
_IMPORTED_BEFORE_ANY_GROUP = (
    "torch.distributed.nn.functional",
    "torch.distributed._shard.sharded_tensor",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops.embedding",
    "torch.distributed._shard.sharding_spec.chunk_sharding_spec_ops.embedding_bag",
)
if dist.is_available():
    for _name in _IMPORTED_BEFORE_ANY_GROUP:
        try:
            importlib.import_module(_name)
        except ImportError:  # another torch version's layout: the lifetime test says what to list
            pass


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def launched_world_size() -> int:
    """World size torchrun (or another launcher) announced through the environment."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU, as torch itself picks."""
    return compat.default_backend_for_device(device.type)


def init_default_group(device: torch.device, timeout_s: float) -> None:
    """Create the default process group from torchrun's environment, if there is none yet.

    Does nothing when a group exists (the script made it) or when no launcher announced a
    world size above one: a plain ``python train.py`` runs at world size 1 with no group.
    """
    if is_initialized() or launched_world_size() <= 1:
        return
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} is set but {var} is not; launch with "
                "torchrun (which sets RANK, MASTER_ADDR and MASTER_PORT) or call "
                "torch.distributed.init_process_group yourself"
            )
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        bound = devices.rank_device().device  # cuda:LOCAL_RANK where visible; one GPU per rank: cuda:0
        torch.cuda.set_device(bound)
        kwargs["device_id"] = bound
    backend = backend_for(device)
    timeout = backend_timeout(timeout_s, backend)
    store = attempt_store(timeout)
    if store is not None:
        kwargs.update(store=store, rank=int(os.environ["RANK"]), world_size=launched_world_size())
    dist.init_process_group(backend=backend, timeout=timeout, **kwargs)


def backend_timeout(timeout_s: float, backend: str) -> datetime.timedelta:
    """The timeout to give a process group that shardpar's ``timeout_s`` governs.

    On gloo shardpar bounds its own waits by ``timeout_s`` and then names the ranks (see
    [Note: ranks out of step] in ``watch``); gloo's own timeout, which closes the connections
    and says only "Application timeout", gets a margin so that it never fires first. It still
    ends collectives shardpar does not wait on (a script's own), a moment later. NCCL's
    watchdog is the only bound there, so it gets ``timeout_s`` itself.
    """
    margin = watch.GLOO_MARGIN_S if backend == dist.Backend.GLOO else 0.0
    return datetime.timedelta(seconds=timeout_s + margin)


def attempt_store(timeout: datetime.timedelta) -> Any:
    """Under torchrun, the agent's store in a namespace of this restart attempt (else None).

    [Note: one store namespace per restart]
    torchrun's agent hosts the TCPStore every attempt of an elastic job rendezvouses in, and
    it outlives the attempts; ``init_process_group`` (env://) writes and reads the same keys
    each time. A rank of a restarted attempt that looks up a peer before that peer re-joined
    reads the dead process's address and fails ("Gloo connectFullMesh failed ... Connection
    refused"), so a restart works or not by chance. Prefixing the keys with
    ``TORCHELASTIC_RESTART_COUNT`` gives every attempt its own.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    # torch.distributed re-exports TCPStore and PrefixStore from torch._C without marking them exported
    store = dist.TCPStore(  # type: ignore[attr-defined]
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        launched_world_size(),
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"shardpar/attempt-{attempt}", store)  # type: ignore[attr-defined]


_SIBLING_GROUPS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
"""Parent group -> its sibling. Weak in the parent, so a sibling lives no longer than its parent
(the default group too, once ``destroy_process_group`` dropped it; a later default group is
another key): [Note: no group outlives destroy_process_group]."""


def sibling_group(group: ProcessGroup | None, timeout_s: float) -> ProcessGroup | None:
    """A second process group over the same ranks as ``group`` (created once per parent),
    so that two independent streams of collectives (stage 3's gathers and its gradient
    reductions) can never be paired with each other when ranks issue them in a different
    interleaving. None at world size 1."""
    if get_world_size(group) == 1:
        return None
    parent = group if group is not None else dist.group.WORLD
    if parent not in _SIBLING_GROUPS:
        _SIBLING_GROUPS[parent] = dist.new_group(
            ranks=dist.get_process_group_ranks(parent),
            timeout=backend_timeout(timeout_s, dist.get_backend(parent)),
            use_local_synchronization=True,
        )
    return _SIBLING_GROUPS[parent]


def retire_sibling_group(group: ProcessGroup | None) -> None:
    """Forget the sibling of ``group`` after its collectives fell out of step (some ranks may
    have gathers outstanding that will never be matched): the next :func:`sibling_group`
    call creates a fresh one. Every rank retires it at the same point, since every rank sees
    the same mismatch."""
    parent = group if group is not None else dist.group.WORLD
    if parent is not None:
        _SIBLING_GROUPS.pop(parent, None)
