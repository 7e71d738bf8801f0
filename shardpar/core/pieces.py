"""What the optimizer updates and what checkpoints read and write: pieces of parameters."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorPiece:
    """A local tensor holding part of one parameter, and which part.

    ``param_range`` is in param space (offsets into the parameter's elements in memory order,
    row-major unless it keeps another memory format: [Note: element order]). Used for what
    the wrapped optimizer updates (the whole parameter at stage 0, this rank's piece at
    stages 1-3) and for what a checkpoint writes and reads. ``grad`` is the reduced gradient
    the optimizer reads for it (None where the tensor is a Parameter with its own ``.grad``,
    and for checkpoint pieces).
    """

    name: str
    tensor: torch.Tensor
    param_range: tuple[int, int]
    grad: torch.Tensor | None = None


def is_elementwise(key: str, value: object, owner: torch.Tensor) -> bool:
    """Whether optimizer state ``value`` (under ``key``) of the tensor ``owner`` has one value
    per element of it (``exp_avg``), as opposed to *scalar* state (Adam's 0-d ``step``,
    Python numbers). See [Note: optimizer state in pieces] in checkpoint/save.py."""
    if not isinstance(value, torch.Tensor) or value.numel() != owner.numel():
        return False
    return value.dim() > 0 or (owner.dim() == 0 and key != "step")


class FullValues(enum.Enum):
    """Where a storage keeps every parameter's full, full-precision values between steps: what
    a full state dict reads and what ``model.gathered()`` puts in the parameters ([Note: full
    values in the module] in facade/module_state.py)."""

    IN_PARAMS = "in the parameters"
    """Stage 0 at full precision: the parameters themselves (no copy, no collective)."""
    IN_MASTERS = "in this rank's full master copy"
    """Stage 0 under mixed precision: every rank's full-precision masters (no collective)."""
    GATHERED = "gathered from every rank's shards"
    """Stages 1-3: the masters or the parameters are sharded, so the values are assembled on
    every rank (a collective)."""
