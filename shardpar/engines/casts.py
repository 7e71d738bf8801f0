"""What mixed precision casts besides the parameters' storage: buffers (``buffer_dtype``),
floating-point inputs (``param_dtype``), and the dtype gradients are reduced in
(``reduce_dtype``).

[Note: what mixed precision casts]
Under ``param_dtype`` every floating-point input of the wrapped model *and of each
module that registers parameters* is cast to it, at every stage. FSDP2 casts the inputs
of each ``fully_shard`` module, so a block may add an fp32 buffer (a position table, a
mask, an fp32 norm statistic) to a bf16 activation and the next block still gets bf16;
casting at each parameter-holding module keeps that working wherever the units are,
and gives every stage the same cast points (stage 3's units differ from stages 0-2's
buckets). Outputs are not cast back, buffers only by ``buffer_dtype``, and code that
casts inside a module (an RMSNorm computing in fp32) is left alone. Modules compiled
before wrapping are cast at the compiled module's inputs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..config import MixedPrecision
from ..core.reducer import BucketedParams
from .hooks import engine_hook


class MixedPrecisionCasts:
    """The casts of one engine's ``MixedPrecision`` (None: nothing is cast)."""

    def __init__(self, mp: MixedPrecision | None) -> None:
        self.mp = mp
        self.param_dtype = mp.param_dtype if mp is not None else None
        self.original_buffer_dtypes: dict[str, torch.dtype] = {}
        """Buffers that ``MixedPrecision.buffer_dtype`` cast: their dtypes as created."""

    def cast_buffers(self, module: nn.Module) -> None:
        mp = self.mp
        if mp is None or mp.buffer_dtype is None:
            return
        for name, buffer in module.named_buffers():
            # Only buffers not cast yet: stage 3 calls this again after a meta-built model's
            # init, which may have re-assigned a buffer in its own dtype.
            if buffer.is_floating_point() and buffer.dtype != mp.buffer_dtype:
                self.original_buffer_dtypes[name] = buffer.dtype
                buffer.data = buffer.data.to(mp.buffer_dtype)

    def reduce_dtype(self, space: BucketedParams) -> torch.dtype:
        """dtype gradients of ``space`` are accumulated and communicated in."""
        mp = self.mp
        if mp is None or not space.master_dtype.is_floating_point:
            return space.compute_dtype
        return mp.reduce_dtype if mp.reduce_dtype is not None else space.master_dtype

    def cast_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Floating-point inputs are cast to ``param_dtype`` so layers see one dtype (see
        [Note: what mixed precision casts])."""
        if self.param_dtype is None:
            return args, kwargs
        dtype = self.param_dtype
        if not kwargs and all(isinstance(a, torch.Tensor) for a in args):  # layer(x): no tree walk
            return tuple(a.to(dtype) if a.is_floating_point() else a for a in args), kwargs

        def cast(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return value.to(dtype)
            return value

        return tree_map(cast, args), tree_map(cast, kwargs)

    def install_hooks(self, tree: Any) -> list[Any]:
        """Casting pre-hooks on the modules of ``tree`` (the engine's module tree) that register
        parameters, lifted out of compiled regions; see [Note: what mixed precision casts]."""
        if self.param_dtype is None:
            return []
        handles, seen = [], set()
        for name, module in tree.modules.items():
            if not name or next(module.parameters(recurse=False), None) is None:
                continue  # the root's inputs are cast by ShardedModule.forward
            lifted = tree.lift(name)
            if lifted in seen:
                continue
            seen.add(lifted)
            handles.append(
                tree.modules[lifted].register_forward_pre_hook(
                    engine_hook(lambda m, args, kwargs: self.cast_inputs(args, kwargs)), with_kwargs=True
                )
            )
        return handles
