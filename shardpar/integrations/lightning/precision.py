"""Lightning's ``precision=`` flag, carried out by shardpar: the precision plugins of
:class:`ShardparStrategy` (Trainer) and :class:`ShardparFabricStrategy` (Fabric).

[Note: Lightning precision in shardpar]
Lightning names a precision with a string and picks a plugin for it; under shardpar the
strategy replaces that plugin with one of these, which does the same with shardpar's parts:

| ``precision=`` | ``shardpar.wrap(mixed_precision=)`` | forward runs under | loss scaling |
|---|---|---|---|
| ``"32-true"`` | the strategy's own option (None by default) | nothing | no |
| ``"bf16-mixed"`` | ``"bf16"`` | ``torch.autocast(bfloat16)`` | no |
| ``"16-mixed"`` | ``"fp16"`` | ``torch.autocast(float16)`` | ``shardpar.GradScaler`` |
| ``"bf16-true"``, ``"16-true"``, ``"64-true"`` | None: the module itself is converted to the dtype | that default dtype | no |

"*-mixed" is what Lightning's FSDP strategy does with FSDP's mixed precision: parameters
compute in half precision (shardpar keeps float32 masters and reduces gradients in float32),
and autocast keeps the ops that need it (losses, softmax) in float32, as a Lightning user of
``precision="bf16-mixed"`` expects of ``F.cross_entropy(self(x), y)``. Clipping goes to
``model.clip_grad_norm_`` / ``clip_grad_value_``, which see every rank's gradient shards
(torch's ``clip_grad_norm_`` over the optimizer's parameters cannot).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.fabric.plugins import precision as fabric_precision
from lightning.pytorch.plugins import precision as pl_precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from ...config import MixedPrecision
from ...facade import ShardedModule, sharded_module_of
from ...optim import GradScaler

if TYPE_CHECKING:
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT_STR


@dataclass(frozen=True)
class PrecisionSpec:
    """What one ``precision=`` value means under shardpar (see the Note above)."""

    name: str
    mixed_precision: str | None = None
    """The ``mixed_precision`` shorthand ``shardpar.wrap`` gets."""
    autocast_dtype: torch.dtype | None = None
    module_dtype: torch.dtype | None = None
    """'*-true': the dtype the module is converted to (and inputs cast to)."""

    @property
    def loss_scaling(self) -> bool:
        return self.mixed_precision == "fp16"

    def resolve(self, option: Any) -> Any:
        """The ``mixed_precision`` to wrap with, given the strategy's own ``mixed_precision=``
        option: that one under '32-true', the precision's otherwise (an option that says
        something else is refused rather than silently overruled)."""
        if self.name == "32-true":
            return option
        if option is None:
            return self.mixed_precision
        wanted = MixedPrecision.from_option(self.mixed_precision)
        given = MixedPrecision.from_option(option)
        if wanted is None or given is None or given.param_dtype != wanted.param_dtype:
            raise ValueError(
                f"precision={self.name!r} and the strategy's mixed_precision={option!r} disagree; set one of them "
                "(precision='32-true' leaves mixed precision to the strategy's option)"
            )
        return option


PRECISIONS = {
    "32-true": PrecisionSpec("32-true"),
    "bf16-mixed": PrecisionSpec("bf16-mixed", "bf16", autocast_dtype=torch.bfloat16),
    "16-mixed": PrecisionSpec("16-mixed", "fp16", autocast_dtype=torch.float16),
    "bf16-true": PrecisionSpec("bf16-true", module_dtype=torch.bfloat16),
    "16-true": PrecisionSpec("16-true", module_dtype=torch.float16),
    "64-true": PrecisionSpec("64-true", module_dtype=torch.float64),
}

_LIGHTNING_PLUGINS = (
    pl_precision.Precision,
    pl_precision.MixedPrecision,
    pl_precision.HalfPrecision,
    pl_precision.DoublePrecision,
    fabric_precision.Precision,
    fabric_precision.MixedPrecision,
    fabric_precision.HalfPrecision,
    fabric_precision.DoublePrecision,
)
"""The plugins Lightning picks for a ``precision=`` string; their behaviour is the string's."""


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _ShardparPrecisionBase:
    """What both frameworks' plugins do alike; the model comes with :meth:`connect_model`."""

    def __init__(self, precision: str = "32-true") -> None:
        if precision not in PRECISIONS:
            raise ValueError(
                f"precision {precision!r} is not supported by shardpar; use one of {', '.join(PRECISIONS)}"
            )
        # Lightning's type for the attribute its own plugins set: every key of PRECISIONS is one of its names
        self.precision: _PRECISION_INPUT_STR = cast("_PRECISION_INPUT_STR", precision)
        self.spec = PRECISIONS[precision]
        self.scaler: GradScaler | None = None
        self._model: ShardedModule | None = None

    def connect_model(self, model: Any) -> None:
        """The wrapped model this plugin serves: its device (autocast's), its clipping and,
        for '16-mixed', the loss scaler over its shards."""
        self._model = sharded_module_of(model, f"{type(self).__name__}")
        if self.spec.loss_scaling and self.scaler is None:
            self.scaler = GradScaler(self._model)

    @property
    def model(self) -> ShardedModule:
        if self._model is None:
            raise RuntimeError(f"{type(self).__name__} is used before the strategy wrapped the model")
        return self._model

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module if self.spec.module_dtype is None else module.to(dtype=self.spec.module_dtype)

    def tensor_init_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.spec.module_dtype is None:
            return contextlib.nullcontext()
        return _default_dtype(self.spec.module_dtype)

    def module_init_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.tensor_init_context()

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.spec.autocast_dtype is not None:
            device_type = "cpu" if self._model is None else self._model.engine.device.type
            return torch.autocast(device_type, dtype=self.spec.autocast_dtype, cache_enabled=False)
        return self.tensor_init_context()

    def convert_input(self, data: Any) -> Any:
        """'*-true': floating inputs in the module's dtype (under '*-mixed' ``ShardedModule``
        casts them to the compute dtype itself)."""
        dtype = self.spec.module_dtype
        if dtype is None:
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(dtype) if torch.is_floating_point(t) else t)

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)


class ShardparPrecision(_ShardparPrecisionBase, pl_precision.Precision):
    """The Trainer's precision plugin under :class:`ShardparStrategy` (see [Note: Lightning
    precision in shardpar]). The strategy makes it from ``Trainer(precision=...)``; pass it
    yourself (``plugins=[ShardparPrecision("16-mixed")]``) only to get a precision Lightning
    would change (it turns '16-mixed' into 'bf16-mixed' on the CPU)."""

    def connect(
        self, model: nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Any], list[Any]]:
        self.connect_model(model)
        return super().connect(model, optimizers, lr_schedulers)

    def pre_backward(self, tensor: torch.Tensor, module: Any) -> torch.Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    # Lightning's Trainer plugin narrows Fabric's optimizer_step(optimizer, **kwargs) the same way
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: Any,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """As Lightning's AMP plugin: backward (the closure), unscale, clip, step unless some
        rank's gradients overflowed (``shardpar.GradScaler`` agrees on that across ranks)."""
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skipped_backward = closure_result is None and model.automatic_optimization
        if not skipped_backward:
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if skipped_backward:
            return closure_result
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return output

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self.model.clip_grad_norm_(clip_val)

    def clip_grad_by_value(self, optimizer: Any, clip_val: float) -> None:
        self.model.clip_grad_value_(clip_val)


class ShardparFabricPrecision(_ShardparPrecisionBase, fabric_precision.Precision):
    """Fabric's precision plugin under :class:`ShardparFabricStrategy` (see [Note: Lightning
    precision in shardpar]); the strategy clips through the model."""

    def backward(self, tensor: torch.Tensor, model: Any, *args: Any, **kwargs: Any) -> None:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, **kwargs)
        output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return output

    def unscale_gradients(self, optimizer: Any) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)


def shardpar_precision(plugin: Any, kind: type) -> Any:
    """``kind`` (one of the two plugins above) doing what Lightning's ``plugin`` would; None
    stays None. A plugin of another kind (bitsandbytes, Transformer Engine, one of your own)
    is refused: its behaviour is not one of the ``precision=`` strings."""
    if plugin is None or isinstance(plugin, kind):
        return plugin
    name = getattr(plugin, "precision", None)
    if type(plugin) in _LIGHTNING_PLUGINS and name in PRECISIONS:
        return kind(name)
    raise TypeError(
        f"shardpar's Lightning strategies carry out precision themselves (precision={name!r} given by the plugin "
        f"{type(plugin).__name__}, which they cannot take); pass precision= one of {', '.join(PRECISIONS)} instead"
    )
