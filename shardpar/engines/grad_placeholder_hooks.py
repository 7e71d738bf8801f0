"""When the ``.grad`` placeholders go on and come off, and the torch optimizer step pre-hook
that refuses an optimizer over such parameters (what they are, and why: [Note: no full
gradients at stages 1-3] in core/grad_placeholders.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..core.grad_placeholders import GradPlaceholderSet, refuse_sharded_params, where_grads_live
from ..core.reducer import GradientReducer
from .hooks import engine_hook

_OPTIMIZER_STEP_HOOK: Any = None
"""The one step pre-hook on every torch optimizer (registered once per process)."""


def refuse_torch_optimizers() -> None:
    """From now on a torch optimizer over a parameter shardpar keeps the gradient of elsewhere
    refuses to step (see [Note: no full gradients at stages 1-3])."""
    global _OPTIMIZER_STEP_HOOK
    if _OPTIMIZER_STEP_HOOK is None:
        _OPTIMIZER_STEP_HOOK = register_optimizer_step_pre_hook(refuse_sharded_params)


class GradPlaceholders:
    """One engine's placeholders: on after each synchronising backward, off before anything
    could accumulate into them (the next forward, the next backward, ``zero_grad``)."""

    def __init__(self, trainable: Sequence[tuple[str, nn.Parameter]], stage: int, reducer: GradientReducer) -> None:
        self.trainable = trainable
        self.placeholders = GradPlaceholderSet(trainable, where_grads_live(stage))
        refuse_torch_optimizers()
        self.reducer = reducer
        self.wait_for_flags = False
        """Some placeholders wait for the used-parameter flags (see :meth:`put_on`)."""

    def before_accumulation_hooks(self, start_backward: Callable[[], None]) -> list[Any]:
        """Where ``.grad`` holds placeholders between backward and step (stages 1-3, mixed
        precision), they must come off before autograd accumulates into them. The root's
        output hook does that for a backward through the model's output; a backward through
        a submodule called directly (FSDP2's chunked loss: ``model.module.head(h).backward()``)
        or through a parameter used outside any forward reaches a parameter first. So each
        parameter gets a tensor hook, which runs before accumulation: it starts the backward
        (``start_backward``, a bound method of the engine, which takes the placeholders off) if
        nothing did yet, and otherwise returns at once: the training state, which holds nothing
        of the engine, answers that without a call ([Note: the host's share of a step] in
        hooks.py)."""
        receiver = weakref.WeakMethod(start_backward)
        state = self.reducer.state

        def before_accumulation(grad: torch.Tensor) -> None:
            if state.final_callback_queued:
                return
            start = receiver()
            if start is not None:  # else the engine is gone ([Note: hooks hold their owner weakly])
                start()

        hook = engine_hook(before_accumulation)
        return [param.register_hook(hook) for _, param in self.trainable]  # type: ignore[no-untyped-call]  # torch's Tensor.register_hook is unannotated

    def put_on(self) -> None:
        """Placeholders on the ``.grad`` of parameters that have a gradient: all of them once the
        used-parameter flags are read, until then those this rank used (see [Note: reading the
        used-parameter flags] in core/gradient_ledger.py; the rest follow when the flags are read)."""
        ledger = self.reducer.ledger
        self.wait_for_flags = not ledger.unused_known
        without = ledger.without_gradient_here() if self.wait_for_flags else self.reducer.without_gradient()
        self.placeholders.put_on([n for n, _ in self.trainable if n not in without])

    def take_off(self, names: Iterable[str] | None = None) -> None:
        self.placeholders.take_off(names)
