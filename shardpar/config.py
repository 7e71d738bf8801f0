"""Typed configuration for :func:`shardpar.wrap`.

Every option is a field with a docstring-style comment; validation happens in
``__post_init__`` so a bad value fails at ``wrap`` time with a message naming the option.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch
from torch import nn

_SHORTHAND_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_float_dtype(option: str, dtype: torch.dtype | None) -> None:
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        raise ValueError(
            f"MixedPrecision.{option}={dtype} is not supported; use one of "
            f"{', '.join(str(d) for d in _FLOAT_DTYPES)} (or None to keep the parameter's dtype)"
        )


@dataclass(frozen=True)
class MixedPrecision:
    """Which dtype lives where when training in low precision.

    The optimizer always updates fp32 master copies (of the owned slices at stages 1-3);
    ``param_dtype`` is what forward/backward compute with and what stage 3 all-gathers.
    """

    param_dtype: torch.dtype | None = None
    """dtype of the parameters used by forward and backward (None: keep as created)."""
    reduce_dtype: torch.dtype | None = None
    """dtype gradients are communicated in (None: the parameters' own dtype as created,
    normally fp32, the safe default)."""
    buffer_dtype: torch.dtype | None = None
    """dtype module buffers are cast to (None: leave buffers alone)."""

    def __post_init__(self) -> None:
        _check_float_dtype("param_dtype", self.param_dtype)
        _check_float_dtype("reduce_dtype", self.reduce_dtype)
        _check_float_dtype("buffer_dtype", self.buffer_dtype)
        if (
            self.param_dtype is not None
            and self.reduce_dtype is not None
            and self.param_dtype.itemsize > self.reduce_dtype.itemsize
        ):
            raise ValueError(
                f"MixedPrecision(param_dtype={self.param_dtype}, reduce_dtype={self.reduce_dtype}) "
                "reduces gradients in a narrower dtype than they are computed in only by accident; "
                "pick reduce_dtype at least as wide as param_dtype"
            )
        if {self.param_dtype, self.reduce_dtype} >= {torch.float16, torch.bfloat16}:
            raise ValueError(
                "MixedPrecision mixes float16 and bfloat16 (param_dtype and reduce_dtype); "
                "choose one half-precision format"
            )

    @classmethod
    def from_option(cls, option: MixedPrecisionOption) -> MixedPrecision | None:
        """Accept ``None``, ``"bf16"``/``"fp16"`` shorthands or a ``MixedPrecision``."""
        if option is None or isinstance(option, MixedPrecision):
            return option
        if isinstance(option, str):
            dtype = _SHORTHAND_DTYPES.get(option.lower())
            if dtype is None:
                raise ValueError(
                    f"mixed_precision={option!r} is not understood; use None, 'bf16', 'fp16' "
                    "or shardpar.MixedPrecision(param_dtype=..., reduce_dtype=...)"
                )
            if dtype is torch.float32:
                return None
            # Shorthand: compute (parameters and floating buffers) in half precision, reduce
            # gradients in fp32 for accuracy.
            return cls(param_dtype=dtype, reduce_dtype=torch.float32, buffer_dtype=dtype)
        raise TypeError(
            f"mixed_precision must be None, 'bf16', 'fp16' or shardpar.MixedPrecision, got {type(option).__name__}"
        )


def _check_number(option: str, value: object, *, integer: bool = False) -> None:
    """A numeric option given as a string (``bucket_cap_mb="25"``, straight from argparse or a
    YAML file) would otherwise fail later in a comparison that names no option."""
    allowed = numbers.Integral if integer else numbers.Real  # numpy scalars register as these
    if isinstance(value, bool) or not isinstance(value, allowed):
        kind = "an int" if integer else "a number"
        raise TypeError(f"{option} must be {kind}, got {type(value).__name__} {value!r}")


def _check_bool(option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{option} must be True or False, got {type(value).__name__} {value!r}")


MixedPrecisionOption = Union[None, str, MixedPrecision]
_DIRECTED_PREFETCH_OPTIONS = ("forward_prefetch_units", "backward_prefetch_units")
"""Stage-3 prefetch counts for one direction; None falls back to ``prefetch_units``."""
WrapPolicy = Union[None, int, Sequence[type], Callable[[str, nn.Module], bool]]


@dataclass(frozen=True)
class ShardConfig:
    """Everything :func:`shardpar.wrap` accepts besides the module itself."""

    stage: int = 0
    """0 = DDP, 1 = shard optimizer state, 2 = also gradients, 3 = also parameters."""
    bucket_cap_mb: float = 25.0
    """Size cap of one gradient bucket (stages 0-2), in MiB of the buffer dtype."""
    rebuild_buckets: bool = True
    """Stages 0-2: after the first synchronising backward, lay the buckets out again in the
    order gradients became ready in it (agreed across ranks, once), as torch DDP does; False
    keeps reverse registration order. Stage 3's buckets are its units: no effect there."""
    mixed_precision: MixedPrecision | None = None
    """Low-precision policy; None trains in the parameters' own dtype."""
    broadcast_buffers: bool = True
    """Every rank takes rank 0's module buffers (e.g. BatchNorm running stats) by torch DDP's rule:
    at a forward that follows a synchronising forward; see [Note: when buffers are broadcast]
    in engines/buffer_sync.py."""
    wrap_policy: WrapPolicy = None
    """Stage 3 units: None = submodules above ``min_unit_params`` parameters, an int = that
    threshold, a sequence of module classes (e.g. transformer blocks), or a callable
    ``(qualified_name, module) -> bool``."""
    min_unit_params: int = 100_000
    """Default stage-3 policy: a submodule with at least this many parameters becomes a unit."""
    reshard_after_forward: bool = True
    """Stage 3: free gathered parameters after each unit's forward (gathered again for backward)."""
    prefetch_units: int = 1
    """Stage 3: how many units ahead to start all-gathering (0 disables prefetch), in forward
    and in backward unless the two options below say otherwise."""
    forward_prefetch_units: int | None = None
    """Stage 3: units of the last forward's order gathered ahead of the one computing in
    forward (None: ``prefetch_units``)."""
    backward_prefetch_units: int | None = None
    """Stage 3: units of the last backward's order (the first backward: the forward's,
    reversed) gathered ahead of the one computing in backward (None: ``prefetch_units``)."""
    timeout_s: float = 300.0
    """Seconds a collective may wait for the other ranks before the job fails (process group
    timeout when shardpar creates the group)."""
    shard_group_size: int | str | None = None
    """Stages 1-3, hybrid sharding: shard within groups of G consecutive ranks and replicate
    across the N/G groups (an int G dividing the world size, or ``"node"``: G =
    LOCAL_WORLD_SIZE); None shards over every rank. Stage 0 ignores it. See [Note: sharding
    groups] in comm/sharding_groups.py."""
    mesh: Any = None
    """Stages 1-3: a 2-D ``DeviceMesh`` (replicate, shard), as FSDP2's HSDP takes it, instead
    of ``shard_group_size``."""
    gradient_divide_factor: float | None = None
    """What the gradients summed over all ranks are divided by (FSDP2's
    ``set_gradient_divide_factor``): None = the world size, DDP's mean; 1.0 = the plain sum
    (torchtitan's global-token loss normalisation); any positive finite number. At every
    stage, under hybrid sharding over both collectives together; ``comm_stats()`` is
    unchanged. See [Note: averaging] in core/averaging.py."""
    align_for_bandwidth: bool | None = None
    """Start every parameter at a multiple of 64 elements and pad every bucket and stage-3 unit
    to a multiple of lcm(N, 128), as Megatron-core does for NCCL's bandwidth (memory and bytes
    sent grow by that padding). None: on when the process group's backend is NCCL, off
    otherwise (gloo keeps the dense layout). See [Note: alignment] in core/layout.py."""

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0, 1, 2 or 3 (or 'auto' with a memory budget), got {self.stage!r}")
        for option in ("bucket_cap_mb", "timeout_s"):
            _check_number(option, getattr(self, option))
        # The per-direction counts may be None (prefetch_units applies); prefetch_units may not.
        prefetch_counts = {"prefetch_units": self.prefetch_units}
        prefetch_counts.update(
            (option, getattr(self, option))
            for option in _DIRECTED_PREFETCH_OPTIONS
            if getattr(self, option) is not None
        )
        for option, value in {**prefetch_counts, "min_unit_params": self.min_unit_params}.items():
            _check_number(option, value, integer=True)
        for option in ("broadcast_buffers", "reshard_after_forward", "rebuild_buckets"):
            _check_bool(option, getattr(self, option))
        if self.align_for_bandwidth is not None and not isinstance(self.align_for_bandwidth, bool):
            raise TypeError(
                f"align_for_bandwidth must be None (on for NCCL only), True or False, got "
                f"{type(self.align_for_bandwidth).__name__} {self.align_for_bandwidth!r}"
            )
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {self.bucket_cap_mb!r}")
        for option, value in prefetch_counts.items():
            if value < 0:
                raise ValueError(f"{option} must be >= 0, got {value!r}")
        if self.min_unit_params < 1:
            raise ValueError(f"min_unit_params must be >= 1, got {self.min_unit_params!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if self.shard_group_size is not None and (
            isinstance(self.shard_group_size, bool)
            or not isinstance(self.shard_group_size, (int, str))
            or (isinstance(self.shard_group_size, str) and self.shard_group_size != "node")
            or (isinstance(self.shard_group_size, int) and self.shard_group_size < 1)
        ):
            raise ValueError(
                f"shard_group_size must be None (shard over every rank), a positive int dividing the world size "
                f"or 'node', got {self.shard_group_size!r}"
            )
        if self.gradient_divide_factor is not None:
            _check_number("gradient_divide_factor", self.gradient_divide_factor)
            try:
                factor = float(self.gradient_divide_factor)
            except OverflowError:  # an int beyond float's range
                factor = math.inf
            if not (math.isfinite(factor) and factor > 0):
                raise ValueError(
                    "gradient_divide_factor must be a positive finite number (1.0 sums the gradients over "
                    f"the ranks, None averages them), got {self.gradient_divide_factor!r}"
                )
            # One float in every rank's fingerprint and every strategy: 2 and 2.0 are the same request.
            object.__setattr__(self, "gradient_divide_factor", factor)
        if self.mesh is not None and self.shard_group_size is not None:
            raise ValueError("pass shard_group_size or mesh, not both: a mesh's shard dimension is the group size")
        object.__setattr__(self, "mixed_precision", MixedPrecision.from_option(self.mixed_precision))

    @property
    def units_to_prefetch_in_forward(self) -> int:
        """``forward_prefetch_units``, or ``prefetch_units`` when that is None."""
        return self.prefetch_units if self.forward_prefetch_units is None else self.forward_prefetch_units

    @property
    def units_to_prefetch_in_backward(self) -> int:
        """``backward_prefetch_units``, or ``prefetch_units`` when that is None."""
        return self.prefetch_units if self.backward_prefetch_units is None else self.backward_prefetch_units

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def fingerprint(self) -> str:
        """A string every rank must agree on (compared at wrap time)."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "mesh" and value is not None:
                value = f"DeviceMesh{tuple(getattr(value, 'shape', ()))}"  # its groups are objects of each rank
            elif isinstance(value, (list, tuple)):
                value = [getattr(c, "__qualname__", repr(c)) for c in value]
            elif callable(value) and not isinstance(value, type):
                value = getattr(value, "__qualname__", "callable")
            parts.append(f"{f.name}={value}")
        return " ".join(parts)
