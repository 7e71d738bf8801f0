"""What the optimizer updates and what checkpoints read and write: pieces of parameters."""

from __future__ import annotations

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
