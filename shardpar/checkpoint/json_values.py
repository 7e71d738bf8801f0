"""The JSON a manifest holds beyond tensors: optimizer hyperparameters and scalar state
(``step``, Python numbers, 0-d tensors) and the user's ``extra``, encoded so that they come
back with their types -- a tensor with its dtype and shape, a float that JSON has no literal
for (NaN, infinities) as text -- and anything JSON cannot hold refused up front. A framework's
training state (nested dicts, tuples, scalar tensors) travels in ``extra`` as a typed tree:
[Note: typed JSON trees].
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
            raise TypeError(
                f"{where} is a tensor of shape {list(value.shape)}; only single values are stored as scalar state"
            )
        return {
            "tensor": encode_value(value.item(), where),
            "dtype": dtype_name(value.dtype),
            "shape": list(value.shape),
        }
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
            return torch.tensor(number, dtype=parse_dtype(value.get("dtype"), f"{where}: "), device=device).reshape(
                value.get("shape", [])
            )
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


# [Note: typed JSON trees]
# A framework's training state beside the tensors (Lightning's loops, callbacks and LR
# schedulers) is a tree of dicts, lists, tuples, numbers, strings and 0-d tensors: JSON can
# hold it, but not its types (a tuple, an int key, a tensor, NaN). ``encode_tree`` tags every
# dict and tuple, so that a JSON object in the encoded tree is always a tag and nothing the
# user stored can be mistaken for one: ``{"dict": {...}}`` (string keys), ``{"items": [[key,
# value], ...]}`` (other keys), ``{"tuple": [...]}``, and the leaves of :func:`encode_value`
# (``{"tensor": ...}``, ``{"float": "nan"}``). Anything else (an object, a tensor of more
# than one value) is a TypeError naming where it sits; nothing is ever pickled.

_TREE_TAGS = ("dict", "items", "tuple")


def encode_tree(value: Any, where: str) -> Any:
    """A JSON form of ``value`` that :func:`decode_tree` turns back into it, types included
    (see [Note: typed JSON trees]); ``where`` names the root in errors (``checkpoint``)."""
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value):
            return {"dict": {key: encode_tree(item, f"{where}[{key!r}]") for key, item in value.items()}}
        return {
            "items": [
                [encode_tree(key, f"a key of {where}"), encode_tree(item, f"{where}[{key!r}]")]
                for key, item in value.items()
            ]
        }
    if isinstance(value, tuple):
        return {"tuple": [encode_tree(item, f"{where}[{index}]") for index, item in enumerate(value)]}
    if isinstance(value, list):
        return [encode_tree(item, f"{where}[{index}]") for index, item in enumerate(value)]
    return encode_value(value, where)


def decode_tree(value: Any, where: str = "a manifest value") -> Any:
    """Inverse of :func:`encode_tree`; a malformed encoding is a CheckpointError naming ``where``."""
    if isinstance(value, list):
        return [decode_tree(item, where) for item in value]
    if not isinstance(value, dict):
        return value
    tags = [tag for tag in _TREE_TAGS if tag in value]
    if not tags:
        return decode_value(value, where=where)
    body = value[tags[0]]
    if len(value) != 1:
        raise CheckpointError(f"{where}: {sorted(value)} is not a valid encoded tree node (one tag expected)")
    if tags[0] == "dict" and isinstance(body, dict):
        return {key: decode_tree(item, where) for key, item in body.items()}
    if tags[0] == "tuple" and isinstance(body, list):
        return tuple(decode_tree(item, where) for item in body)
    if tags[0] == "items" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        try:
            return {decode_tree(key, where): decode_tree(item, where) for key, item in body}
        except TypeError as error:  # a key that decodes to something unhashable
            raise CheckpointError(f"{where}: an encoded dict has a key that cannot be one ({error})") from None
    raise CheckpointError(f"{where}: {tags[0]!r} holds a {type(body).__name__}, not what the tag says")
