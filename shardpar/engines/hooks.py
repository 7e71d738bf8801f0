"""How the engine's hooks are made: module hooks run eagerly and are marked as the engine's;
tensor hooks fire once per backward, and those on parameters hold the engine weakly.

Hooks are excluded from compilation (:func:`never_compiled`), because they launch
collectives: where compiled code calls one (``torch.compile`` of the whole wrapped model) it is
a graph break, and under ``fullgraph=True`` an error, so none is placed inside a compiled module
([Note: compiled modules] in core/units.py). Each module hook is marked, so that a method
declared with ``shardpar.register_forward_method`` can run the engine's hooks around it and no
others ([Note: forward methods] in facade/forward_methods.py).

[Note: the host's share of a step]
Every hook below that fires once per parameter per step (the post-accumulate-grad hook, the
placeholders' pre-accumulation hook) is what the host pays per parameter tensor: a model of
386 small tensors spends more time in this per-gradient work than in its arithmetic (issue #44,
tools/bench.py's overhead model; docs/benchmarks.md measures it at about 10 µs a gradient on a
CPU core, most of it torch's own dispatch -- autograd calling into Python, the compile guard,
the copy into the bucket -- and about 0.1 µs per Python call). So such a hook is one
closure, with what it needs bound in, reaching its owner through ``weakref.ref`` (not
``WeakMethod``, whose ``__call__`` is Python); it asks the cheap question first and calls
further only when there is work. At stages 0-1 the common arrival is one call: the reducer
counts it, the gradient being in the bucket already ([Note: gradients accumulate in the
buffer] in core/reducer.py); at stages 2-3 two: the reducer counts it and the strategy copies
it into its staging bucket. Any other arrival goes through the engine, the backward path,
the reducer and the strategy, one call each, the reducer doing its per-gradient bookkeeping
(used flag, ready order, the bucket's count) inline rather than in a helper per fact. Work that
is the same for every parameter of a bucket is done per bucket at launch, with the
(parameter, view) pairs computed once per layout.

[Note: hooks hold their owner weakly]
A tensor hook lives in C++ state that Python's cycle collector cannot see into, so a hook
that held the engine strongly (parameter -> hook -> engine -> parameter) made every wrapped
model immortal: dropping the model and its optimizer freed neither their tensors nor the
process group they use, whose threads then outlived ``destroy_process_group`` into the
interpreter's exit (where gloo's can abort a finished run). The parameter hooks therefore
reach the engine through a weak reference; the engine lives exactly as long as the user
holds the model or the optimizer. Module hooks are plain Python and need no such care.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

FORWARD_HOOK_MARK = "_shardpar_forward_hook"
"""Set on every forward hook an engine registers: what a registered method runs."""


@functools.cache
def _frame_skipper() -> Callable[[Any], None] | None:
    """What marks a code object's frames, and all they call, to run eagerly under dynamo
    (torch >= 2.6's frame strategies); None on an older torch. Asked at the first wrap, not at
    ``import shardpar``: importing dynamo takes seconds, as ``torch.compiler.disable`` does."""
    from torch._dynamo import eval_frame

    set_strategy = getattr(eval_frame, "set_code_exec_strategy", None)
    if set_strategy is None:
        return None
    skip_all = eval_frame.FrameExecStrategy(eval_frame.FrameAction.SKIP, eval_frame.FrameAction.SKIP)  # type: ignore[attr-defined]  # not re-exported by torch
    return lambda code: set_strategy(code, skip_all)


def _code_of(fn: Callable[..., Any]) -> Any:
    """The code object a call of ``fn`` runs: of a function, a bound method, or a partial of either."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return getattr(fn, "__code__", None)


def never_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, which dynamo neither traces nor inlines, nor anything it calls.

    [Note: excluded from compilation at no cost per call]
    ``torch.compiler.disable(fn)`` wraps ``fn`` in a Python function that switches dynamo's
    frame callback off and on again around each call, 1-2 µs on a CPU core: on a
    post-accumulate-grad hook, more than the hook's own work (issue #44; measured by
    interleaved backward passes of the overhead model, 386 hooks). The same exclusion is two
    marks made once: the frame strategy of ``fn``'s code (skip it, and every frame it calls,
    which is what the wrapper's switch does for a call from eager code or a compiled graph's
    break) and ``_torchdynamo_disable`` on ``fn`` itself (what dynamo asks before inlining a
    call, where the wrapper's mark stops it: a graph break, after which the call is a frame
    again). A call then costs nothing more where no compilation is under way. Where the marks
    cannot be made (older torch, or an object without its own attributes), the wrapper it is.
    The code is marked for every function made from it, which is what every engine hook wants:
    its code is the engine's and never meant for compiled graphs."""
    code, skip_frames_of = _code_of(fn), _frame_skipper()
    if skip_frames_of is not None and code is not None:
        try:
            fn._torchdynamo_disable = True  # type: ignore[attr-defined]  # dynamo's own mark
        except AttributeError:  # a bound method, say: the wrapper below
            pass
        else:
            skip_frames_of(code)
            return fn
    return torch.compiler.disable(fn)  # type: ignore[no-untyped-call,no-any-return]  # untyped in torch


def engine_hook(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` as one of the engine's hooks: never compiled, and marked."""
    hook = never_compiled(fn)
    setattr(hook, FORWARD_HOOK_MARK, True)
    return hook


def output_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output, where torch's pytree looks (and a dict's values)."""
    if isinstance(output, torch.Tensor):  # the common case, without a tree walk
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    leaves, _ = tree_flatten(output)
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors in a module's output that autograd will give a gradient."""
    return [t for t in output_tensors(output) if t.requires_grad]


def on_first_grad(tensors: list[torch.Tensor], hook: Callable[[Any], None]) -> Any:
    """Call ``hook`` once per backward, when the first gradient of one of ``tensors`` is
    computed (``register_multi_grad_hook(mode="any")``; for one tensor, a pre-hook on the node
    that made it does the same without the per-forward setup, which matters once per unit per
    step: torch runs it where it would run the tensor's own hook, just before that node, and
    registering it costs about 0.7 µs on a CPU core against 2.5 µs for ``Tensor.register_hook``'s
    Python; a tensor without a node, a leaf, takes its own hook)."""
    if len(tensors) == 1:
        return hook_first_grad(tensors[0], hook)
    return torch.autograd.graph.register_multi_grad_hook(tensors, hook, mode="any")


def hook_first_grad(tensor: torch.Tensor, hook: Callable[[Any], None]) -> Any:
    """:func:`on_first_grad` of one tensor."""
    node = tensor.grad_fn
    if node is None:
        return tensor.register_hook(hook)  # type: ignore[no-untyped-call]  # untyped in torch
    return node.register_prehook(hook)


def _weakly(method: Callable[..., Any]) -> tuple[Callable[[], Any], Callable[..., Any]]:
    """A bound method as (a weak reference to its object, its function): calling the function
    on the referent is a bound call without ``weakref.WeakMethod``'s Python-level ``__call__``
    (about 1 µs a gradient on a CPU core, [Note: the host's share of a step])."""
    return weakref.ref(method.__self__), method.__func__  # type: ignore[attr-defined]  # a bound method's


def grad_ready_hooks(
    params: Iterable[tuple[str, nn.Parameter]],
    on_ready: Callable[[str, nn.Parameter], None],
    count_arrival: Callable[[str, nn.Parameter], bool] | None = None,
) -> list[Any]:
    """One post-accumulate-grad hook per (name, parameter), calling ``on_ready`` (a bound
    method) through a weak reference to its object: see [Note: hooks hold their owner weakly].
    Each hook is one closure; where ``count_arrival`` (a bound method too: the reducer's
    ``arrival_counter``) is given, it is asked first and ``on_ready`` is called only when it
    did not take the arrival ([Note: the host's share of a step])."""
    receiver, on_ready_fn = _weakly(on_ready)
    counting = None if count_arrival is None else _weakly(count_arrival)

    def hook_for(name: str) -> Callable[[nn.Parameter], None]:
        def on_accumulated(param: nn.Parameter) -> None:
            if counting is not None:
                counter, counted = counting
                reducer = counter()
                if reducer is not None and counted(reducer, name, param):
                    return
            engine = receiver()
            if engine is not None:  # else the engine is gone: the parameter is plain again
                on_ready_fn(engine, name, param)

        return never_compiled(on_accumulated)

    return [
        param.register_post_accumulate_grad_hook(hook_for(name))  # type: ignore[no-untyped-call]  # untyped in torch
        for name, param in params
    ]
