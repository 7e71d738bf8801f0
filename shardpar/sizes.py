"""Quantities written with a unit, as users and tools write them: byte sizes (``"5GB"``,
``"512MiB"``) and parameter counts (``"7B"``). One parser serves the planner's memory
budgets and the exports' ``max_shard_size``, and :func:`format_bytes` writes a byte size
back as people read it (the planner's messages, tools/estimate.py); it imports nothing of
shardpar, so every layer may use it.

Decimal units are powers of 1000, as Hugging Face and disk makers write them (``5GB`` =
5·10⁹ bytes, ``80G`` = 80·10⁹); ``KiB``, ``MiB``, ``GiB`` and ``TiB`` are binary. An int,
or a number written without a fraction or exponent, is taken exactly, however large.
"""

from __future__ import annotations

import math
import re
from typing import Any

BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
COUNT_UNITS = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_NUMBER = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

__all__ = ["BYTE_UNITS", "COUNT_UNITS", "format_both", "format_bytes", "parse_bytes", "parse_count"]


def _parse(text: Any, units: dict[str, int], what: str, example: str) -> int:
    if isinstance(text, bool):
        raise ValueError(f"{what} must be a number, got {text!r}")
    if isinstance(text, (int, float)):
        result: int | float = text
    else:
        match = _NUMBER.match(str(text))
        if match is None or match.group(2).lower() not in units:
            raise ValueError(f"cannot read {what} {text!r}; write e.g. {example}")
        number, unit = match.group(1), match.group(2).lower()
        result = (int(number) if number.isdigit() else float(number)) * units[unit]
    if isinstance(result, float):
        if not math.isfinite(result):
            raise ValueError(f"{what} must be positive and finite, got {text!r}")
        result = round(result)
    if result <= 0:
        raise ValueError(f"{what} must be positive, got {text!r}")
    return result


def parse_bytes(text: int | float | str, what: str = "memory size") -> int:
    """``"24GB"`` -> 24·10⁹, ``"512MiB"`` -> 512·2²⁰, ``"80G"`` -> 80·10⁹, an int -> itself.
    ValueError naming ``what`` (the option) for anything else, zero or negative included."""
    return _parse(text, BYTE_UNITS, what, "24GB, 80GiB, 512MiB or 1000000")


def parse_count(text: int | float | str, what: str = "parameter count") -> int:
    """``"7e9"``, ``"7B"``, ``"350M"``, ``"125k"`` -> a parameter count."""
    return _parse(text, COUNT_UNITS, what, "7e9, 7B, 350M or 125K")


# --------------------------------------------------------------------------- sizes, as people read them


def format_bytes(n: float, binary: bool = True) -> str:
    """``format_bytes(3 * 2**30)`` -> ``'3.00 GiB'``; ``binary=False`` -> decimal GB."""
    base, units = (
        (1024.0, ("B", "KiB", "MiB", "GiB", "TiB", "PiB")) if binary else (1000.0, ("B", "kB", "MB", "GB", "TB", "PB"))
    )
    value = float(n)
    for unit in units:
        if abs(value) < base or unit == units[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= base
    raise AssertionError("unreachable")


def format_both(n: float) -> str:
    """``'24.00 GB (22.35 GiB)'``: budgets are written in both bases, so show both."""
    return f"{format_bytes(n, binary=False)} ({format_bytes(n)})"
