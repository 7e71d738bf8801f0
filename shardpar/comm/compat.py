"""Shims for the torch APIs that shardpar uses and that are newer than its torch floor.

Each shim uses the newest spelling when the running torch has it, and the older equivalent
otherwise. The choice is made once, at import. The floor is in pyproject.toml. The table gives
the first release of each API, taken from the released wheels' torch/distributed/distributed_c10d.py
and torch/nn/modules/module.py:

| shim                               | newest API (first release)                    | fallback (present since)                               |
| ---------------------------------- | --------------------------------------------- | ------------------------------------------------------ |
| reduce_scatter_single              | dist.reduce_scatter_single (2.13)             | dist.reduce_scatter_tensor (<= 2.3; alias from 2.13)   |
| all_gather_single                  | dist.all_gather_single (2.13)                 | dist.all_gather_into_tensor (<= 2.3; alias from 2.13)  |
| broadcast / isend / irecv          | group_src= / group_dst= keywords (2.6)        | src= / dst= as a global rank, via get_global_rank      |
| default_backend_for_device         | dist.get_default_backend_for_device (2.6)     | dist.Backend.default_device_backend_map (<= 2.3)       |
| fully_shard                        | torch.distributed.fsdp.fully_shard (2.6)      | torch.distributed._composable.fsdp.fully_shard (2.4)   |

From 2.13 on, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` are deprecated
(FutureWarning) thin wrappers around the ``*_single`` functions. Call these shims rather
than either torch name directly.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "all_gather_single",
    "broadcast",
    "broadcast_keywords",
    "default_backend_for_device",
    "fully_shard",
    "global_rank",
    "irecv",
    "isend",
    "reduce_scatter_single",
]


def _takes(fn: Callable[..., Any] | None, keyword: str) -> bool:
    """Whether ``fn``'s signature names ``keyword``. ``inspect.signature`` follows the
    ``functools.wraps`` of torch's logging decorators."""
    if fn is None:
        return False
    try:
        return keyword in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


_AVAILABLE = dist.is_available()
_REDUCE_SCATTER = (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor) if _AVAILABLE else None
_ALL_GATHER = (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor) if _AVAILABLE else None
_GROUP_RANK_KEYWORDS = (
    _AVAILABLE
    and _takes(dist.broadcast, "group_src")
    and _takes(dist.isend, "group_dst")
    and _takes(dist.irecv, "group_src")
)


def reduce_scatter_single(
    output: torch.Tensor, input: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False
) -> Any:
    """``dist.reduce_scatter_single`` (2.13+), otherwise ``dist.reduce_scatter_tensor``. Both take
    the same arguments and do the same thing."""
    assert _REDUCE_SCATTER is not None, "a collective runs only where torch.distributed is available"
    return _REDUCE_SCATTER(output, input, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
    """``dist.all_gather_single`` (2.13+), otherwise ``dist.all_gather_into_tensor``."""
    assert _ALL_GATHER is not None, "a collective runs only where torch.distributed is available"
    return _ALL_GATHER(output, input, group=group, async_op=async_op)


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` in ``group`` (None: the default group, where the two are equal)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def broadcast(tensor: torch.Tensor, group_src: int, group: Any = None, async_op: bool = False) -> Any:
    """``dist.broadcast`` from the group rank ``group_src``."""
    if _GROUP_RANK_KEYWORDS:
        return dist.broadcast(tensor, group_src=group_src, group=group, async_op=async_op)
    return dist.broadcast(tensor, src=global_rank(group, group_src), group=group, async_op=async_op)


def broadcast_keywords(group_src: int, group: Any = None) -> dict[str, Any]:
    """The keywords of an asynchronous ``dist.broadcast`` from the group rank ``group_src`` on
    ``group`` (what :func:`broadcast` passes), worked out once: a prepared collective (stage 3's
    tagged gathers, a broadcast per rank, twice per unit per step) calls
    ``dist.broadcast(tensor, **keywords)`` itself rather than through the shim each time."""
    if _GROUP_RANK_KEYWORDS:
        return {"group_src": group_src, "group": group, "async_op": True}
    return {"src": global_rank(group, group_src), "group": group, "async_op": True}


def isend(tensor: torch.Tensor, group_dst: int, group: Any = None) -> Any:
    """``dist.isend`` to the group rank ``group_dst``."""
    if _GROUP_RANK_KEYWORDS:
        return dist.isend(tensor, group_dst=group_dst, group=group)
    return dist.isend(tensor, dst=global_rank(group, group_dst), group=group)


def irecv(tensor: torch.Tensor, group_src: int, group: Any = None) -> Any:
    """``dist.irecv`` from the group rank ``group_src``."""
    if _GROUP_RANK_KEYWORDS:
        return dist.irecv(tensor, group_src=group_src, group=group)
    return dist.irecv(tensor, src=global_rank(group, group_src), group=group)


def default_backend_for_device(device: str | torch.device) -> str:
    """``dist.get_default_backend_for_device`` (2.6+). Before 2.6, the same lookup in
    ``Backend.default_device_backend_map``, which is where 2.6 reads it from."""
    getter = getattr(dist, "get_default_backend_for_device", None)
    if getter is not None:
        named: str = getter(device)
        return named
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    backend = dist.Backend.default_device_backend_map.get(device_type)
    if backend is None:
        raise ValueError(f"Default backend not registered for device : {device}")
    return backend


def fully_shard(module: nn.Module, **kwargs: Any) -> Any:
    """FSDP2's ``fully_shard``. It is public from 2.6 on; 2.4 and 2.5 have it under
    ``_composable``. Used only by tools/bench.py and the tests, as the reference."""
    try:
        from torch.distributed.fsdp import fully_shard as impl
    except ImportError:
        # torch 2.4-2.5 only; newer stubs no longer export it from there
        from torch.distributed._composable.fsdp import fully_shard as impl  # type: ignore[attr-defined]
    return impl(module, **kwargs)
