"""Dynamic loss scaling for fp16 training at any stage.

Used exactly like ``torch.amp.GradScaler``::

    scaler = shardpar.GradScaler(model)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)              # optional: before clipping
    model.clip_grad_norm_(1.0)
    scaler.step(opt)                  # skipped on every rank if any rank saw inf/nan
    scaler.update()

The difference from torch's: gradients may be sharded, so an inf/nan can be visible on one
rank only. ``unscale_`` checks this rank's gradients and combines the verdict with one
all-reduce (max) of a flag, so every rank skips or takes the same step and the scale stays
identical everywhere.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..comm import collectives as C
from ..facade import ShardedModule, sharded_module_of


class GradScaler:
    """Loss scaler whose overflow check spans all ranks' gradient shards."""

    def __init__(
        self,
        model: ShardedModule,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        model = sharded_module_of(model, "shardpar.GradScaler")  # or a torch.compile wrapper of it
        if not (math.isfinite(init_scale) and init_scale > 0.0):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.model = model
        self.enabled = enabled
        self._scale = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self._growth_tracker = 0
        self._unscaled = False
        self._found_inf_flag: torch.Tensor | None = None
        """Set by ``unscale_``: 1 where some rank saw inf/nan, on the device until read."""
        self._found_inf: bool | None = False
        """``_found_inf_flag`` read on the host (None: not read yet)."""
        self.skipped_steps = 0

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer: Any = None) -> None:
        """Divide this rank's gradients by the scale and agree across ranks on overflow."""
        if not self.enabled:
            return
        if self._unscaled:
            raise RuntimeError("unscale_() was already called since the last update()")
        engine = self.model.engine
        grads, _ = engine.owned_grads()  # none since zero_grad(), not an earlier overflow's stale inf
        found = torch.zeros(1, dtype=torch.float32, device=engine.device)
        inv_scale = torch.full((1,), 1.0 / self._scale, dtype=torch.float32, device=engine.device)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        with torch.no_grad():
            for same_dtype in by_dtype.values():  # one fused kernel per dtype, as torch's scaler
                torch._amp_foreach_non_finite_check_and_unscale_(same_dtype, found, inv_scale)
        # Always reduced, even when gradients are replicated: it costs 4 bytes and keeps the
        # decision identical on every rank whatever a rank's local numerics did. The verdict
        # stays on the device until step() needs it: no host sync here (torch's scaler
        # likewise reads it once, in step).
        engine.wait_clock.wait(
            C.all_reduce(found, group=engine.group, async_op=True, op="max", stats=engine.comm, kind="found_inf"),
            gather=False,
        )
        self._found_inf_flag = found
        self._found_inf = None
        self._unscaled = True

    def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """``optimizer.step()`` unless some rank found inf/nan gradients."""
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if not self._unscaled:
            self.unscale_(optimizer)
        if self.found_inf:
            self.skipped_steps += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if self.found_inf:
            self._scale *= self.backoff_factor
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self._growth_tracker = 0
        self._unscaled = False
        self._found_inf_flag = None
        self._found_inf = False

    @property
    def found_inf(self) -> bool:
        """Whether the last ``unscale_`` saw inf/nan on any rank."""
        if self._found_inf is None:  # read from the device once per step, then kept
            self._found_inf = self._found_inf_flag is not None and bool(self._found_inf_flag.item())
        return self._found_inf

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self._scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "growth_tracker": self._growth_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scale = float(state["scale"])
        self.growth_factor = state["growth_factor"]
        self.backoff_factor = state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
        self._growth_tracker = state["growth_tracker"]
