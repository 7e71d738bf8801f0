"""Clipping by the global gradient norm, as ``torch.nn.utils.clip_grad_norm_`` does on one process.

[Note: a norm per piece]
torch takes one norm per parameter (``torch._foreach_norm``) and then the norm of those
norms. shardpar does the same with the tensors it holds: at stage 0 every parameter's
reduced gradient, the tensors torch's function would see, in the order it would see them
(so the norm equals DDP's followed by torch's ``clip_grad_norm_``, bit for bit); at stages
1-3 every piece of a parameter that this rank owns (``BufferLayout.pieces``), never more
than the parameter. A norm over a whole flat bucket or shard instead (millions of elements)
is systematically low in fp32 on the CPU, whose norm kernel accumulates serially: 1e-5
relative at a million elements, 1e-4 at five million, against torch's 1e-7 for the same
gradients taken per parameter -- a bias that compounds over a clipped run (issue #32).

Sharded, a rank sums the p-th powers of its pieces' norms in fp64 and one all-reduce sums
those over ranks (a MAX of the largest piece norm and a NaN flag for ``inf``; see
:func:`total_norm`): for any p > 0, the p-th powers of the pieces of a parameter add up to
the p-th power of its norm. fp64 keeps that sum as exact as torch's fp32 norm of a few
hundred parameter norms, for any number of pieces and ranks. The norm comes back in the
dtype torch returns (the gradients' dtypes promoted), on the gradients' device, without
the host waiting for the device (only ``error_if_nonfinite`` reads it, as torch does).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch

try:  # what torch's clip_grad_norm_ asks when foreach is None (torch >= 2.1)
    from torch.utils._foreach_utils import _device_has_foreach_support, _has_foreach_support
except ImportError:  # pragma: no cover - another torch's layout: the CPU and CUDA have foreach kernels

    def _device_has_foreach_support(device: torch.device) -> bool:
        return device.type in ("cpu", "cuda")

    def _has_foreach_support(tensors: list[torch.Tensor], device: torch.device) -> bool:
        return _device_has_foreach_support(device) and all(type(t) is torch.Tensor for t in tensors)


AllReduce = Callable[[torch.Tensor, str], None]
"""Reduce a tensor in place across the ranks that share the gradients' shards, with ``"sum"``
or ``"max"``: one collective."""


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float, refused where norms of pieces do not compose into the norm of
    the whole (p <= 0, NaN): torch computes something for those, but no p-norm a clip needs."""
    norm_type = float(norm_type)
    if not (norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive or inf, got {norm_type!r}")
    return norm_type


def _by_device_and_dtype(tensors: Sequence[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    """``tensors`` grouped as torch's ``_group_tensors_by_device_and_dtype`` groups them: by
    first appearance, each group in the order given."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def _uses_foreach(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None) -> bool:
    """torch's rule: ``None`` takes the foreach kernels where the device has them, ``True``
    insists on them (an error where there are none), ``False`` loops over the tensors."""
    if foreach is None:
        return _has_foreach_support(tensors, device)
    if foreach and not _device_has_foreach_support(device):
        raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")
    return foreach


def piece_norms(pieces: Sequence[torch.Tensor], norm_type: float, foreach: bool | None = None) -> list[torch.Tensor]:
    """One norm of order ``norm_type`` per tensor (empty ones skipped), each in its tensor's
    dtype, as torch's ``get_total_norm`` takes them."""
    norms: list[torch.Tensor] = []
    for (device, _), group in _by_device_and_dtype([p for p in pieces if p.numel()]).items():
        if _uses_foreach(group, device, foreach):
            norms.extend(torch._foreach_norm(group, norm_type))
        else:
            norms.extend(torch.linalg.vector_norm(g, norm_type) for g in group)
    return norms


def result_dtype(grads: Sequence[torch.Tensor]) -> torch.dtype:
    """The dtype torch's norm of ``grads`` has: their dtypes promoted (fp32 for none)."""
    return functools.reduce(torch.promote_types, (g.dtype for g in grads)) if grads else torch.float32


def total_norm(
    pieces: Sequence[torch.Tensor],
    norm_type: float,
    *,
    device: torch.device,
    dtype: torch.dtype,
    all_reduce: AllReduce | None = None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The norm of order ``norm_type`` of all ``pieces`` taken as one vector; with
    ``all_reduce``, of every rank's pieces (see [Note: a norm per piece]). ``device`` and
    ``dtype``: where the norm lives and its dtype, the same on every rank whatever pieces it
    holds (:func:`result_dtype`). Never waits for the device."""
    norm_type = check_norm_type(norm_type)
    norms = piece_norms(pieces, norm_type, foreach)
    if all_reduce is None:
        if not norms:
            return torch.zeros((), dtype=dtype, device=device)
        norm: torch.Tensor = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
        return norm
    # 1-D, one fp64 norm per piece (a zero where this rank holds none)
    stacked = (
        torch.stack([n.to(device=device, dtype=torch.float64) for n in norms])
        if norms
        else torch.zeros(1, dtype=torch.float64, device=device)
    )
    if norm_type == math.inf:
        local = stacked.max()
        # A MAX reduction may drop a NaN (max(1, nan) is 1 for gloo and others), so a NaN in one
        # rank's pieces would leave the others with a finite norm. Reduce a NaN flag beside the
        # maximum and put the NaN back, as torch would return it.
        has_nan = torch.isnan(local)
        pair = torch.stack([torch.where(has_nan, torch.zeros_like(local), local), has_nan.to(local.dtype)])
        all_reduce(pair, "max")
        total = torch.where(pair[1] > 0, torch.full_like(pair[0], math.nan), pair[0])
    else:
        total = stacked.pow(norm_type).sum()
        all_reduce(total, "sum")
        total = total.pow(1.0 / norm_type)
    return total.to(dtype)


def clip_with_norm_(
    pieces: Sequence[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None = None
) -> None:
    """Scale ``pieces`` in place by ``min(max_norm / (total + 1e-6), 1)``, as torch's
    ``clip_grads_with_norm_`` scales gradients: the coefficient stays a tensor (no host sync)
    and the tensors are multiplied by it whether or not it clips."""
    if not pieces:
        return
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for (device, _), group in _by_device_and_dtype(pieces).items():
        on_device = coefficient.to(device)
        if _uses_foreach(group, device, foreach):
            torch._foreach_mul_(group, on_device)
        else:
            for tensor in group:
                tensor.mul_(on_device)
