"""What the optimizer updates and what checkpoints read and write: pieces of parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorPiece:
    """A local tensor holding part of one parameter, and which part.

    ``param_range`` is in param space (offsets into the flattened parameter). Used for what
    the wrapped optimizer updates (the whole parameter at stage 0, this rank's piece at
    stages 1-3) and for what a checkpoint writes and reads. ``grad`` is the reduced gradient
    the optimizer reads for it (None where the tensor is a Parameter with its own ``.grad``,
    and for checkpoint pieces).
    """

    name: str
    tensor: torch.Tensor
    param_range: tuple[int, int]
    grad: torch.Tensor | None = None
