"""Which device a rank trains on, and which devices its process group can serve.

[Note: a rank's device]
Under torchrun every process sees every GPU of its node unless the launcher hides some, and
a GPU is picked by index: ``torch.cuda.set_device``, ``.to("cuda")`` and ``.cuda()`` all mean
"the current device", which is ``cuda:0`` until the script changes it. So the device a rank
should train on is not a property of the model; it is, in order:

1. the CPU, when no GPU is visible;
2. the device the group was bound to, ``init_process_group(device_id=...)``
   (``group.bound_device_id``): the script said so;
3. ``torch.cuda.current_device()`` when the script moved it off 0 (``set_device``);
4. ``cuda:LOCAL_RANK`` when torchrun set ``LOCAL_RANK`` and that GPU is visible: a script that
   calls neither of the above leaves every rank's current device at 0, and ``model.cuda()``
   then puts every rank's model on the same GPU;
5. otherwise the current device, ``cuda:0``. This is the case of one visible GPU per rank
   (``CUDA_VISIBLE_DEVICES`` set per rank, so ``LOCAL_RANK`` is at least the visible count):
   every rank's ``cuda:0`` is another GPU, and that is right.

A model is checked against that device only at world size > 1 (a single process may train on
any GPU it likes), and against the group: the group runs one backend per device type
(``"cpu:gloo,cuda:nccl"``; ``"nccl"`` alone serves CUDA only), and a collective on a tensor of
a type it has no backend for fails deep inside, long after wrap. Every check raises
ValueError naming both devices, the rank and the fix; ``shardpar.wrap`` turns it into the
same error on every rank.

The backend is read per device type, never compared whole to ``"nccl"``: a group made with
``init_process_group()`` and no backend reports ``dist.get_backend() == "undefined"``, and a
mixed one ``"cpu:gloo,cuda:nccl"``; ``dist.get_backend_config`` gives the mapping torch
dispatches by in every case.

[Note: object collectives]
Small host objects (the wrap agreement's signatures, counters) are pickled into byte tensors
and all-gathered. They travel on the CPU where the group has a CPU backend (no copy to a GPU
and back), else on the device the caller trains on: on an NCCL-only group, a rank that never
called ``set_device`` would otherwise send them from ``cuda:0`` on every rank, which NCCL
refuses (two ranks on one GPU) or hangs on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

ProcessGroup = Any  # torch's ProcessGroup; kept loose so world size 1 needs no torch.distributed

CPU = torch.device("cpu")


@dataclass(frozen=True)
class RankDevice:
    """The device a rank is expected to train on, and what says so ([Note: a rank's device])."""

    device: torch.device
    source: str
    """Which rule chose it, as an error message says it: ``"LOCAL_RANK=1"``, ``"the process
    group's device_id"``, ``"torch.cuda.set_device"``, ..."""


def local_rank() -> int | None:
    """``LOCAL_RANK`` as torchrun sets it; None when no launcher set it (or it is not a number)."""
    value = os.environ.get("LOCAL_RANK")
    if value is None or not value.strip().isdigit():
        return None
    return int(value)


def _group_exists() -> bool:
    return dist.is_available() and dist.is_initialized()


def bound_device(group: ProcessGroup | None = None) -> torch.device | None:
    """The device ``group`` (None: the default group) was bound to with
    ``init_process_group(device_id=...)``, or None (not bound, or no group)."""
    if not _group_exists():
        return None
    pg = group if group is not None else dist.group.WORLD
    return getattr(pg, "bound_device_id", None)


def rank_device(group: ProcessGroup | None = None) -> RankDevice:
    """The device this rank should train on, by the rules of [Note: a rank's device]."""
    if not torch.cuda.is_available():
        return RankDevice(CPU, "no GPU is visible")
    bound = bound_device(group)
    if bound is not None and bound.type == "cuda":
        index = bound.index if bound.index is not None else torch.cuda.current_device()
        return RankDevice(torch.device("cuda", index), "the process group's device_id")
    current = torch.cuda.current_device()
    if current != 0:
        return RankDevice(torch.device("cuda", current), "torch.cuda.set_device")
    local, visible = local_rank(), torch.cuda.device_count()
    if local is not None and local < visible:
        return RankDevice(torch.device("cuda", local), f"LOCAL_RANK={local}")
    if local is not None:
        return RankDevice(
            torch.device("cuda", 0), f"the only GPU visible to this rank (LOCAL_RANK={local}, {visible} visible)"
        )
    return RankDevice(torch.device("cuda", 0), "torch.cuda.current_device()")


def training_device(group: ProcessGroup | None = None) -> torch.device:
    """Where a model built on the meta device is materialised: this rank's GPU (see
    :func:`rank_device`) when there is one and the group (if any) has a backend for CUDA,
    else the CPU. Call it once the group exists: it may be bound to a device."""
    chosen = rank_device(group).device
    if chosen.type != "cpu" and _group_exists():
        served = group_backends(group)
        if served and chosen.type not in served:
            return CPU
    return chosen


# --------------------------------------------------------------------------- backends


def backend_config(group: ProcessGroup | None = None) -> str:
    """What ``group`` (None: the default group, which must exist) runs per device type, as torch
    reports it: ``"cpu:gloo,cuda:nccl"``; a torch without ``get_backend_config`` gives the
    backend's name (``"nccl"``), which :func:`parse_backends` reads too."""
    read = getattr(dist, "get_backend_config", None)
    return str(read(group) if read is not None else dist.get_backend(group))


def parse_backends(text: str) -> dict[str, str]:
    """``{device type: backend}`` from a backend string: ``"cpu:gloo,cuda:nccl"`` maps each
    entry; a single name (``"nccl"``) maps every device type torch says it serves
    (``dist.Backend.backend_capability``: nccl serves cuda, gloo cpu and cuda). Empty for a
    name torch does not know (``"undefined"``, an unregistered backend): nothing to check by."""
    text = text.strip().lower()
    if ":" in text:
        served: dict[str, str] = {}
        for entry in text.split(","):
            device_type, _, backend = entry.partition(":")
            if device_type.strip() and backend.strip():
                served[device_type.strip()] = backend.strip()
        return served
    capability: Mapping[str, list[str]] = getattr(dist.Backend, "backend_capability", {}) or {}
    return {device_type: text for device_type in capability.get(text, [])}


def group_backends(group: ProcessGroup | None = None) -> dict[str, str]:
    """``{device type: backend}`` that ``group`` runs collectives on (see :func:`parse_backends`)."""
    return parse_backends(backend_config(group))


def group_backend(group: ProcessGroup | None, device_type: str) -> str | None:
    """The backend ``group`` runs collectives of ``device_type`` tensors on (``"nccl"`` for
    ``"cuda"`` on a ``"cpu:gloo,cuda:nccl"`` group), or None when it has none."""
    return group_backends(group).get(device_type)


def object_device(group: ProcessGroup | None, device: torch.device | None = None) -> torch.device:
    """Where the bytes of an object collective of ``group`` travel ([Note: object
    collectives]): the CPU where the group has a backend for it, else ``device`` (the
    engine's, the module's), else this rank's GPU. The CPU without a group."""
    if not _group_exists():
        return CPU
    served = group_backends(group)
    if "cpu" in served:
        return CPU
    if device is not None and device.type in served and device.type != "meta":
        if device.type == "cuda" and device.index is None:
            return rank_device(group).device
        return device
    return rank_device(group).device


# --------------------------------------------------------------------------- checks


def check_module_device(
    device: torch.device, *, rank: int, expected: RankDevice, backends: Mapping[str, str], backend_text: str = ""
) -> None:
    """Raise ValueError if a model on ``device`` cannot train on rank ``rank``: its device type
    has no backend in the group (``backends``, as :func:`parse_backends` gives; empty: not
    known, not checked; ``backend_text`` is how the message names the group's backend), or
    it is on another GPU than ``expected`` (:func:`rank_device`). Pure: every fact is passed
    in. A meta-device model is not checked (it is materialised on the rank's device)."""
    if device.type == "meta":
        return
    named = backend_text or ",".join(f"{t}:{b}" for t, b in sorted(backends.items()))
    if backends and device.type not in backends:
        served = " and ".join(sorted(backends))
        if device.type == "cpu" and expected.device.type == "cuda":
            fix = (
                f"move the model to this rank's GPU before wrapping (model.to('{expected.device}'), "
                f"{expected.source}), or create the group with a CPU backend too "
                "(torch.distributed.init_process_group(backend='cpu:gloo,cuda:nccl'), or 'gloo')"
            )
        elif device.type == "cpu":
            fix = "create the group with a CPU backend: torch.distributed.init_process_group(backend='gloo')"
        else:
            fix = (
                f"create the group with a backend for {device.type} (backend='nccl' or "
                f"'cpu:gloo,cuda:nccl' for CUDA), or move the model to the {served}"
            )
        raise ValueError(
            f"shardpar.wrap on rank {rank}: the model is on {device}, but the process group's backend "
            f"'{named}' serves only {served} tensors, so every collective on the model's tensors would fail; "
            f"{fix}"
        )
    if device.type == "cuda" and expected.device.type == "cuda" and device.index is not None:
        if device.index != expected.device.index:
            raise ValueError(
                f"shardpar.wrap on rank {rank}: the model is on {device}, but this rank's GPU "
                f"is {expected.device} ({expected.source}); ranks that share a GPU make NCCL fail or hang. Call "
                "torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before any CUDA work (model.cuda() and "
                f"model.to('cuda') then use that GPU), or move the model with model.to('{expected.device}'); "
                "with one GPU visible per rank (CUDA_VISIBLE_DEVICES), use cuda:0 on every rank"
            )


def check_rank_device(device: torch.device, group: ProcessGroup | None = None) -> None:
    """:func:`check_module_device` with this rank's facts, at world size > 1 only (one process
    may train on any device; with no group there is nothing to serve)."""
    if not _group_exists() or dist.get_world_size(group) <= 1:
        return
    text = backend_config(group)
    check_module_device(
        device, rank=dist.get_rank(group), expected=rank_device(group), backends=parse_backends(text), backend_text=text
    )
