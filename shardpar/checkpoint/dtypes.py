"""The dtypes a checkpoint can hold, under their three names: torch's, the manifest's
(``"bfloat16"``) and the safetensors header's (``"BF16"``). The one table every reader and
writer of checkpoint files, manifests and exports translates through.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..errors import CheckpointError

# manifest dtype name -> (torch dtype, safetensors dtype)
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint64": (torch.uint64, "U64"),
    "uint32": (torch.uint32, "U32"),
    "uint16": (torch.uint16, "U16"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
    "complex64": (torch.complex64, "C64"),
}
_NAME_OF = {dtype: name for name, (dtype, _) in _DTYPES.items()}
_FROM_ST = {st: dtype for dtype, st in _DTYPES.values()}
_SHORTHANDS = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


class TensorSize:
    """``numel`` and ``nbytes`` of a record with a ``shape`` and a ``dtype`` (a tensor in a
    file, a tensor of a manifest)."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def is_storable(dtype: torch.dtype) -> bool:
    """Whether a safetensors file can hold tensors of ``dtype``."""
    return dtype in _NAME_OF


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype`` (``torch.float32`` -> ``"float32"``)."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in a safetensors file") from None


def safetensors_code(dtype: torch.dtype) -> str:
    """The safetensors header's code of ``dtype`` (``torch.bfloat16`` -> ``"BF16"``)."""
    return _DTYPES[dtype_name(dtype)][1]


def parse_dtype(name: Any, where: str = "") -> torch.dtype:
    """Inverse of :func:`dtype_name`; accepts the shorthands ``bf16``, ``fp16``, ``fp32``."""
    key = str(name).lower().removeprefix("torch.")
    key = _SHORTHANDS.get(key, key)
    if not isinstance(name, str) or key not in _DTYPES:
        raise CheckpointError(f"{where}unknown dtype {name!r} (known: {', '.join(_DTYPES)})")
    return _DTYPES[key][0]


def parse_safetensors_dtype(name: Any, where: str = "") -> torch.dtype:
    """The torch dtype of a safetensors header's dtype code (``"BF16"`` -> ``torch.bfloat16``)."""
    if not isinstance(name, str) or name not in _FROM_ST:
        raise CheckpointError(f"{where}unknown dtype {name!r} (known: {', '.join(_FROM_ST)})")
    return _FROM_ST[name]
