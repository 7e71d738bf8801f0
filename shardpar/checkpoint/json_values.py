"""The JSON a manifest holds beyond tensors: optimizer hyperparameters and scalar state
(``step``, Python numbers, 0-d tensors) and the user's ``extra``, encoded so that they come
back with their types -- a tensor with its dtype and shape, a float that JSON has no literal
for (NaN, infinities) as text -- and anything JSON cannot hold refused up front.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from ..errors import CheckpointError
from .dtypes import dtype_name, parse_dtype


def encode_value(value: Any, where: str) -> Any:
    """A JSON form of a scalar optimizer state value or hyperparameter (tensors included)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"{where} is a tensor of shape {list(value.shape)}; only single values are "
                            "stored as scalar state")
        return {"tensor": encode_value(value.item(), where), "dtype": dtype_name(value.dtype),
                "shape": list(value.shape)}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}  # 'nan', 'inf', '-inf': JSON has no literal for them
    if isinstance(value, (list, tuple)):
        return [encode_value(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"{where} is a {type(value).__name__}, which a checkpoint cannot store as JSON")


def decode_value(value: Any, device: torch.device | str = "cpu", where: str = "a manifest value") -> Any:
    """Inverse of :func:`encode_value`; a malformed encoding is a CheckpointError naming ``where``."""
    if isinstance(value, dict) and "tensor" in value:
        try:
            number = decode_value(value["tensor"], where=where)
            return torch.tensor(number, dtype=parse_dtype(value.get("dtype"), f"{where}: "),
                                device=device).reshape(value.get("shape", []))
        except (TypeError, ValueError, RuntimeError, OverflowError) as error:
            raise CheckpointError(f"{where}: {value!r} is not a valid encoded tensor ({error})") from None
    if isinstance(value, dict) and "float" in value:
        try:
            return float(value["float"])
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{where}: {value!r} is not a valid encoded float ({error})") from None
    if isinstance(value, list):
        return [decode_value(v, device, where) for v in value]
    return value


def to_json_text(obj: Any, what: str) -> str:
    """``json.dumps`` that raises TypeError for anything not plain JSON (NaN included)."""
    try:
        return json.dumps(obj, indent=1, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise TypeError(f"{what} must be JSON-serialisable: {error}") from None
