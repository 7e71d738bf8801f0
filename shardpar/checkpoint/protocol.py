"""The protocol every collective checkpoint operation follows (``save_checkpoint``,
``load_checkpoint``, ``save_full``, ``load_pretrained``): the ranks enter together, agree on
the outcome after every phase, and read on every rank; and the inventory of the model they
all walk (state-dict tensors, their kinds, aliases).

[Note: every rank agrees before it moves on]
A rank that fails alone (a full disk, a corrupted file only it reads) must not leave the
others waiting in the next collective. Each phase therefore ends in :func:`agree`: one
all-gather of every rank's verdict, after which *every* rank raises (the failing rank its
own exception, the others a CheckpointError naming that rank) or every rank goes on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from ..comm import collectives as C
from ..comm import watch
from ..core.element_order import ElementOrder
from ..core.inventory import plain_state_entries
from ..engines import Engine
from ..errors import CheckpointError
from ..facade import sharded_module_of
from ..optim import ShardedOptimizer

_Result = TypeVar("_Result")


def collective_phase(name: str) -> Callable[[Callable[..., _Result]], Callable[..., _Result]]:
    """Run a checkpoint function as a phase every rank enters together: the ranks first meet
    through the store, so a call on some ranks only is named instead of pairing its
    collectives with training's (see [Note: ranks out of step] in shardpar.comm.watch)."""

    def decorate(fn: Callable[..., _Result]) -> Callable[..., _Result]:
        @functools.wraps(fn)
        def run(path: Any, model: Any, *args: Any, **kwargs: Any) -> _Result:
            model = sharded_module_of(model, f"shardpar.{name}")  # or a torch.compile wrapper of it
            group = model.engine.group
            with watch.operation(name):
                watch.meet(group, name)
                return fn(path, model, *args, **kwargs)

        return run

    return decorate


def agree(problem: BaseException | None, what: str, group: Any, payload: Any = None) -> list[Any]:
    """See [Note: every rank agrees before it moves on]. Returns every rank's payload."""
    return settle(problem, what, lambda verdict: C.all_gather_objects(verdict, group=group), payload)


Agree = Callable[[BaseException | None, str, Any], list[Any]]
"""``agree(problem, what, payload)`` over some channel: every rank's payload, or every rank raises."""


def settle(
    problem: BaseException | None,
    what: str,
    gather: Callable[[Any], list[Any]],
    payload: Any = None,
    name_own_rank: int | None = None,
) -> list[Any]:
    """:func:`agree` with ``gather`` (this rank's ``[verdict, payload]`` -> every rank's) as the
    channel. ``name_own_rank``: the failing rank raises a CheckpointError naming it, caused by
    its own exception, instead of that exception (an asynchronous save: its error surfaces
    later, away from the call)."""
    verdict = None if problem is None else [type(problem).__name__, str(problem)]
    gathered = gather([verdict, payload])
    for rank, (other, _) in enumerate(gathered):
        if other is not None:
            if problem is not None and name_own_rank is None:
                raise problem
            if problem is not None:
                raise CheckpointError(f"{what} failed on rank {name_own_rank}: {problem}") from problem
            kind = {"TypeError": TypeError, "ValueError": ValueError}.get(other[0], CheckpointError)
            raise kind(f"{what} failed on rank {rank}: {other[1]}")
    return [p for _, p in gathered]


def read_on_every_rank(
    run_reads: Callable[[], None], staged: list[tuple[torch.Tensor, torch.Tensor]], what: str, group: Any
) -> None:
    """Run the planned reads, copy staged buffers back, and agree on the outcome (a failure on
    any rank raises on every rank; the model may then be partially loaded)."""
    problem: BaseException | None = None
    try:
        with torch.no_grad():
            run_reads()
            for tensor, values in staged:
                tensor.copy_(values.view(tensor.shape))
    except Exception as error:
        problem = error
    agree(problem, f"{what} (reading)", group)


def buffer_target(tensor: torch.Tensor, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Where a buffer's values are read to: the buffer itself, or (not contiguous) a stand-in
    recorded in ``staged`` and copied back by :func:`read_on_every_rank`."""
    if tensor.is_contiguous():
        return tensor.data.view(-1)
    target = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    staged.append((tensor, target))
    return target


def check_optimizer(optimizer: Any, engine: Engine) -> None:
    """TypeError unless ``optimizer`` is None or the shardpar optimizer over ``engine``."""
    if optimizer is not None and (not isinstance(optimizer, ShardedOptimizer) or optimizer.engine is not engine):
        raise TypeError("optimizer must be the shardpar.optimizer(...) built over this model")


# --------------------------------------------------------------------------- model inventory


def model_tensors(engine: Engine) -> tuple[list[tuple[str, str, torch.Tensor]], dict[str, str]]:
    """``(name, kind, tensor)`` for every state-dict entry except aliases, in state-dict order,
    and ``alias -> canonical name`` (tied parameters, and buffers registered twice)."""
    aliases = dict(engine.inventory.aliases)
    params = dict(engine.named_params)
    out: list[tuple[str, str, torch.Tensor]] = []
    seen: dict[int, str] = {}
    for name, tensor in plain_state_entries(engine.module).items():
        if name in aliases:
            continue
        if name in params:
            out.append((name, "param" if params[name].requires_grad else "frozen", params[name]))
        elif id(tensor) in seen:
            aliases[name] = seen[id(tensor)]
        else:
            seen[id(tensor)] = name
            out.append((name, "buffer", tensor))
    return out, aliases


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as 1-D, row-major (a view where it is contiguous)."""
    return tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().contiguous().view(-1)


def in_param_space(value: torch.Tensor, order: ElementOrder) -> torch.Tensor:
    """An elementwise optimizer state as 1-D in param space: a piece's (1-D) as it is, a
    whole parameter's (stage 0) in the parameter's memory order."""
    return order.flatten(value.detach()) if value.dim() > 1 else flat(value)
