"""``shardpar.optimizer``: any ``torch.optim.Optimizer`` class, run on what this rank owns.

The engine decides which tensors the wrapped optimizer sees: the parameters themselves at
stage 0, flat 1-D views of this rank's pieces at stages 1-3 (see ``TensorPiece``). The class
is handed them as the user handed the parameters: a list of tensors as a list (a class may
group it itself, as nanochat's Muon does by shape), param groups as one dict each with the
group's options, so ``param_groups`` keeps the user's hyperparameters and order and
``torch.optim.lr_scheduler`` schedulers drive it unchanged. ``step(closure)`` hands the
closure on ([Note: closures]).
"""

from __future__ import annotations

import inspect
import math
import traceback
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..comm import collectives as C
from ..core.pieces import TensorPiece
from ..engines import Engine
from ..facade import ShardedModule, sharded_module_of


def _unname(members: list[Any]) -> list[Any]:
    """torch optimizers also take ``model.named_parameters()`` (pairs of name and parameter);
    the name is the wrapped model's anyway, so only the parameter is kept."""
    if members and all(isinstance(m, tuple) and len(m) == 2 and isinstance(m[0], str) for m in members):
        return [param for _, param in members]
    return members


@dataclass(frozen=True)
class ParamRequest:
    """What the user passed as ``params``, resolved to names of the wrapped model's parameters.

    ``groups[g]`` holds group ``g``'s options and ``"names"`` (its trainable parameters, in the
    user's order). ``as_tensors``: the user passed tensors (or None, which means the model's
    parameters, as ``model.parameters()`` gives torch), not param-group dicts, so the class is
    handed a list of tensors, as torch hands it what the user passed: nanochat's ``Muon``
    regroups the tensors it is given by shape, and a dict has no ``numel``."""

    groups: list[dict[str, Any]]
    as_tensors: bool


def _resolve_param_groups(engine: Engine, params: Any) -> ParamRequest:
    """User params (None, tensors, or dicts as torch takes them) -> groups naming params."""
    if params is None:
        params = [p for _, p in engine.trainable]
    if isinstance(params, torch.Tensor):
        raise TypeError("params must be an iterable of parameters or of dicts, not a single tensor")
    params = _unname(list(params))
    if not params:
        raise ValueError("shardpar.optimizer got an empty parameter list")
    as_tensors = not any(isinstance(g, dict) for g in params)
    if all(isinstance(g, dict) for g in params):
        groups = [dict(g) for g in params]
    elif as_tensors:
        groups = [{"params": params}]
    else:
        raise TypeError("params mixes tensors and param-group dicts; pass one kind")

    seen: dict[str, int] = {}
    resolved = []
    for index, group in enumerate(groups):
        if "params" not in group:
            raise ValueError(f"param group {index} has no 'params' entry")
        members = group.pop("params")
        members = [members] if isinstance(members, torch.Tensor) else _unname(list(members))
        names = []
        for param in members:
            name = engine.inventory.name_of.get(param) if isinstance(param, nn.Parameter) else None
            if name is None:
                raise ValueError(
                    f"param group {index} holds a tensor of shape {tuple(getattr(param, 'shape', ()))} "
                    "that is not a parameter of the wrapped model; build groups from "
                    "model.named_parameters() of the ShardedModule (or of the module before wrapping)"
                )
            if name in seen:
                raise ValueError(
                    f"parameter '{name}' appears in param groups {seen[name]} and {index}; "
                    "each parameter may belong to one group only"
                )
            seen[name] = index
            if param.requires_grad:  # frozen parameters are never updated; no storage to hand out
                names.append(name)
        resolved.append({**group, "names": names})
    return ParamRequest(resolved, as_tensors)


class ShardedOptimizer(torch.optim.Optimizer):
    """Facade over one inner torch optimizer that updates this rank's share of the model.

    ``Optimizer.__init__`` is deliberately not called: the inner optimizer owns
    ``param_groups`` and ``state``; this object exposes them live so schedulers and user code
    see one optimizer, and adds the engine's work around ``step`` and ``zero_grad``.
    """

    def __init__(
        self,
        engine: Engine,
        optimizer_class: type[torch.optim.Optimizer],
        request: ParamRequest,
        defaults: dict[str, Any],
        whole_tensors: bool | None = None,
    ) -> None:
        self.engine = engine
        self.optimizer_class = optimizer_class
        self._names = frozenset(name for group in request.groups for name in group["names"])
        """The trainable parameters this optimizer updates (what its ``zero_grad`` clears)."""
        self._as_tensors = request.as_tensors
        # The check first, so that a class that needs whole tensors gets them before it is built
        # (and is refused as such where that cannot help); then the real build, so that bad
        # arguments raise the class's own error, as in torch, also where they kept the check from
        # building it.
        whole, unchecked = (
            _whole_tensor_names(optimizer_class, request, defaults, engine, whole_tensors)
            if engine.stage
            else (frozenset(), None)
        )
        self.whole_tensors = bool(whole)
        """Whether it updates whole tensors, each on the rank that owns it ([Note: whole-tensor
        ownership] in core/layout.py); always so at stage 0, where every rank holds them all."""
        if whole:
            engine.own_whole(whole)
        self._stand_in = torch.empty((0, 0) if whole else (0,), device=engine.device)
        """What a list of tensors holds where this rank has no piece of them: torch refuses an
        empty list, and an empty tensor is one no optimizer steps (its ``.grad`` stays None);
        a matrix of none where the class takes matrices only (Muon)."""
        requested = [engine.storage.optimizer_pieces(group["names"], engine.strategy) for group in request.groups]
        if request.as_tensors:
            handed: list[Any] = self._tensors_of(requested[0])
        else:
            handed = [
                {**{k: v for k, v in group.items() if k != "names"}, "params": [t.tensor for t in tensors]}
                for group, tensors in zip(request.groups, requested)
            ]
        self.inner = optimizer_class(handed, **defaults)
        if unchecked is not None:
            raise ValueError(unchecked)
        self.group_tensors: list[list[TensorPiece]] = self._pieces_of_inner_groups(requested)
        """Per param group of the inner optimizer (the class's own grouping), its pieces."""
        self._group_names: list[list[str]] = self._names_of_inner_groups(request, requested)
        self._optimizer_step_pre_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._optimizer_step_post_hooks: dict[int, Callable[..., Any]] = OrderedDict()
        self._layout_generation = engine.layout_generation

    def _tensors_of(self, pieces: list[TensorPiece]) -> list[torch.Tensor]:
        """What the inner optimizer holds for ``pieces``: their tensors (the stand-in for none,
        where the user passed a list of tensors)."""
        tensors = [piece.tensor for piece in pieces]
        return tensors if tensors or not self._as_tensors else [self._stand_in]

    def _pieces_of_inner_groups(self, requested: list[list[TensorPiece]]) -> list[list[TensorPiece]]:
        """The class's param groups, tensor by tensor, as the pieces they are: a class given a
        list of tensors may group them its own way (Muon by shape)."""
        by_tensor = {id(piece.tensor): piece for pieces in requested for piece in pieces}
        grouped = []
        for index, group in enumerate(self.inner.param_groups):
            pieces = []
            for tensor in group["params"]:
                if tensor is self._stand_in:
                    continue
                if id(tensor) not in by_tensor:
                    raise ValueError(
                        f"{self.class_name} put a tensor of shape {tuple(tensor.shape)} into its param group {index} "
                        "that it was not given; shardpar can only step the tensors it hands the optimizer"
                    )
                pieces.append(by_tensor[id(tensor)])
            grouped.append(pieces)
        return grouped

    def _names_of_inner_groups(self, request: ParamRequest, requested: list[list[TensorPiece]]) -> list[list[str]]:
        """Per inner group, the parameters whose pieces it holds: what it fetches again after a
        bucket rebuild ([Note: optimizers follow the layout]).

        At stage 0 the pieces are whole parameters, one per parameter on every rank, so the
        class may group them as it likes and each group keeps its own. At stages 1-3 a rank's
        pieces are 1-D slices that another rank, or a rebuild, cuts otherwise: a grouping made
        from them (by shape, by size) would differ between ranks and from the grouping of the
        whole parameters, so the class must keep the groups it was given -- unless it is handed
        whole tensors, each on the rank that owns it for good ([Note: whole-tensor ownership]
        in core/layout.py): then a class grouping a list by shape, as nanochat's Muon does,
        groups each rank's own matrices as it would group them all."""
        if self.engine.stage == 0 or (self.whole_tensors and request.as_tensors):
            return [[piece.name for piece in pieces] for pieces in self.group_tensors]
        given = [[piece.name for piece in pieces] for pieces in requested]
        if [[piece.name for piece in pieces] for pieces in self.group_tensors] != given:
            what = "list of tensors" if request.as_tensors else f"{len(given)} param groups"
            raise ValueError(
                f"{self.class_name} regrouped the {what} it was given into {len(self.group_tensors)} param groups of "
                f"its own, but at stage {self.engine.stage} it is given 1-D pieces of the parameters, cut differently "
                "on each rank, so its grouping would differ between ranks and from that of the whole parameters. "
                "Use stage=0, where it gets the whole parameters, or pass its param groups as dicts that it keeps"
            )
        return [list(group["names"]) for group in request.groups]

    # Live views of the inner optimizer, so schedulers that set group["lr"] reach it.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.inner.param_groups = value

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    _step_supports_amp_scaling = True
    """Makes ``torch.amp.GradScaler.step`` call :meth:`step` (with ``found_inf`` and
    ``grad_scale`` set on this object) instead of failing on the gradients it cannot see, so
    that :meth:`step` can refuse it by name; see ``_refuse_torch_grad_scaler``."""

    def _refuse_torch_grad_scaler(self) -> None:
        if "found_inf" in self.__dict__ or "grad_scale" in self.__dict__:
            for attribute in ("found_inf", "grad_scale"):  # set by torch's scaler for this call only
                self.__dict__.pop(attribute, None)
            raise TypeError(
                "torch.amp.GradScaler cannot step a shardpar optimizer: the optimizer takes its gradients from "
                "the engine's buffers, which torch's scaler can neither unscale nor check for overflow (and at "
                "stages 1-3 each rank holds only its slices, so a check per rank would disagree between ranks). "
                "Use scaler = shardpar.GradScaler(model) instead (same calls: scale, unscale_, step, update), "
                "which agrees on overflow across ranks. Nothing was changed"
            )

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self._refuse_torch_grad_scaler()
        for hook in list(self._optimizer_step_pre_hooks.values()):
            hook(self, (), {})
        self._follow_layout()
        self.engine.count_optimizer_step()
        if closure is not None:
            loss = self._step_with_closure(closure)
        else:
            loss = None
            # No backward reduced gradients since zero_grad(): as torch does when every .grad is
            # None, the step changes nothing (no weight decay, no moment update). Gradients that
            # zero_grad(set_to_none=False) kept are zeros torch would step with.
            if self.engine.reducer.ledger.any_gradient:
                self.engine.storage.before_optimizer_step(self._names)
                self._attach_grads()
                self.inner.step()
                self.engine.storage.after_optimizer_step(self._names)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, (), {})
        return loss

    # [Note: closures]
    # ``opt.step(closure)`` hands the inner optimizer a closure of its own, as torch hands it
    # the user's: the inner optimizer decides when and how often to call it (SGD and Adam
    # once, first; LBFGS once per evaluation of its line search, up to ``max_eval`` times).
    # Each call runs the user's closure (zero_grad, forward, a backward that reduces as any
    # backward does), then makes its reduced gradients the ones the inner optimizer reads,
    # and returns the closure's loss averaged over the ranks. That mean is what one process
    # returns on the concatenated batch (equal batches, a mean loss: what averaging the
    # gradients already assumes), and it is the same on every rank: LBFGS compares losses to
    # stop and its strong-Wolfe line search chooses its step from them, so a rank's own loss
    # would make ranks call the closure a different number of times and part (torch DDP has
    # that hazard). Before every call after the first, the values the inner optimizer changed
    # since (masters under mixed precision, master shards at stages 1-2) are made the ones
    # the closure's forward computes with, as after a step.
    # At stages 1-3 a closure works with every optimizer that updates element by element
    # (checked at construction). LBFGS is not one: it keeps its history and takes its step
    # sizes over the one vector of all its parameters (dot products, a norm), which on a rank
    # would be this rank's pieces only, and shardpar does not reach inside an optimizer to
    # sum them across ranks. The elementwise check runs a class whose step needs a closure
    # with one (see _not_elementwise), finds this, and refuses LBFGS at stages 1-3 by name.

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        """See [Note: closures]."""
        self.engine.storage.before_optimizer_step(self._names)  # the inner step may change values before the closure
        if self.engine.reducer.ledger.any_gradient:  # an optimizer may read gradients of a backward before the step
            self._attach_grads()
        calls = 0

        def reduced_closure() -> Any:
            nonlocal calls
            if calls:
                self.engine.storage.after_optimizer_step(self._names)
            calls += 1
            with torch.enable_grad():
                loss = closure()
            self.engine.storage.before_optimizer_step(self._names)
            if self.engine.reducer.ledger.any_gradient:
                self._attach_grads()
            else:
                self._detach_grads()
            return self._mean_over_ranks(loss)

        loss = self.inner.step(reduced_closure)
        self.engine.storage.after_optimizer_step(self._names)
        return loss

    def _mean_over_ranks(self, loss: Any) -> Any:
        """The closure's loss averaged over the ranks (a tensor stays a detached tensor of its
        dtype and device, a number a float; anything else is returned as it is)."""
        engine = self.engine
        if engine.world_size == 1 or not isinstance(loss, (torch.Tensor, int, float)) or isinstance(loss, bool):
            return loss
        if isinstance(loss, torch.Tensor):
            mean = loss.detach().clone()
        else:
            mean = torch.tensor(float(loss), dtype=torch.float64, device=engine.device)
        C.all_reduce(mean, group=engine.group, stats=engine.comm, kind="closure_loss")
        mean.div_(engine.world_size)
        return mean if isinstance(loss, torch.Tensor) else mean.item()

    def _attach_grads(self) -> None:
        """Point each tensor at its reduced gradient, or at None where no rank's backward used
        the parameter since ``zero_grad`` (torch then skips it: no decay, no moment update).
        Pieces that are the parameters themselves (stage 0) carry their own ``.grad``."""
        skipped: set[str] | None = None  # asked once per step, not once per piece, and only if needed
        for tensors in self.group_tensors:
            for piece in tensors:
                if piece.grad is not None:
                    if skipped is None:
                        skipped = self.engine.without_gradient()
                    piece.tensor.grad = None if piece.name in skipped else piece.grad

    def _detach_grads(self) -> None:
        """No gradient since ``zero_grad`` (a closure without backward): as torch's, every
        ``.grad`` None (the parameters themselves at stage 0 are left as ``zero_grad`` left them)."""
        for tensors in self.group_tensors:
            for piece in tensors:
                if piece.grad is not None:
                    piece.tensor.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients of this optimizer's parameters only, as torch's ``zero_grad``
        (another optimizer over other parameters of the model keeps its own); with
        ``set_to_none=False`` zero those that exist and keep them, as torch does."""
        self.engine.zero_grad(self._names, set_to_none)

    # ------------------------------------------------------------------ bucket rebuild

    # [Note: optimizers follow the layout]
    # The engine rebuilds its buckets at most once, at the end of the first synchronising
    # backward ([Note: bucket rebuild] in core/rebuild.py), and counts it in
    # ``layout_generation``. It does not reach into the optimizers built over it: each notices
    # the new generation on its next use (a step, a checkpoint, a state_dict) and fetches its
    # pieces again; its state moves with them. Where the masters are sharded (stages 1-2) a
    # rank's pieces change, so their state crosses ranks: one object all-gather (what state
    # each rank holds) and the all-gathers that move it, run by every rank at that use, as
    # every rank steps, saves and loads alike. An optimizer that is never used again (garbage
    # on some rank) never follows and costs nothing.

    def _follow_layout(self) -> None:
        if self._layout_generation == self.engine.layout_generation:
            return
        states = {}
        for tensors in self.group_tensors:
            for piece in tensors:
                state = self.inner.state.get(piece.tensor)
                if state:
                    states[piece.name] = (piece.tensor, state)
        moved = self.engine.carry_optimizer_state(states)
        self.group_tensors = [
            self.engine.storage.optimizer_pieces(names, self.engine.strategy) for names in self._group_names
        ]
        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for group, tensors in zip(self.inner.param_groups, self.group_tensors):
            group["params"] = self._tensors_of(tensors)  # the same group dicts: schedulers keep theirs
            for piece in tensors:
                if moved.get(piece.name):
                    new_state[piece.tensor] = moved[piece.name]
        self.inner.state = new_state
        self._layout_generation = self.engine.layout_generation

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "shardpar optimizers are built once over the wrapped model; pass every param group "
            "to shardpar.optimizer(...)"
        )

    # ------------------------------------------------------------------ state as pieces
    # Checkpoints store optimizer state per parameter piece ([Note: optimizer state in pieces]
    # in checkpoint/save.py), never by reaching into the inner optimizer: these methods are
    # the whole interface between the two.

    @property
    def class_name(self) -> str:
        """The wrapped optimizer class, qualified (``torch.optim.adamw.AdamW``)."""
        return f"{self.optimizer_class.__module__}.{self.optimizer_class.__qualname__}"

    def pieces(self) -> list[list[TensorPiece]]:
        """Per param group, the pieces of parameters this rank's optimizer updates: as one
        group where the class regrouped the list of tensors it was given with the same options
        (nanochat's Muon, by shape): that grouping depends on which tensors a rank owns, so a
        checkpoint keeps the list as the user gave it."""
        self._follow_layout()
        if self._regrouped_list():
            return [[piece for pieces in self.group_tensors for piece in pieces]]
        return self.group_tensors

    def _regrouped_list(self) -> bool:
        """Whether the class split the one list of tensors it was given into groups of the same options."""
        if not self._as_tensors or len(self.inner.param_groups) < 2:
            return False
        first, *others = self.group_options_of_inner()
        return all(_same_options(first, other) for other in others)

    def group_options_of_inner(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.inner.param_groups]

    def state_of(self, piece: TensorPiece) -> dict[str, Any]:
        """The inner optimizer's state of one piece (empty before its first step)."""
        return dict(self.inner.state.get(piece.tensor, {}))

    def group_options(self) -> list[dict[str, Any]]:
        """Every param group's options but ``params`` (lr, betas, weight_decay, ...), per group
        of :meth:`pieces`."""
        options = self.group_options_of_inner()
        return options[:1] if self._regrouped_list() else options

    def load_state_pieces(self, states: list[list[dict[str, Any]]], options: list[dict[str, Any]]) -> None:
        """Replace the state: ``states[g][i]`` is for ``pieces()[g][i]`` (empty: no state),
        ``options[g]`` the options of group ``g``. Tensor-valued options are filled in place
        (a scheduler may hold them), tuples stay tuples."""
        self._follow_layout()
        if self._regrouped_list():  # one group in the checkpoint: see pieces()
            sizes = [len(pieces) for pieces in self.group_tensors]
            flat_states = iter(states[0])
            states = [[next(flat_states) for _ in range(size)] for size in sizes]
            options = options * len(sizes)
        new_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
        for tensors, group_states in zip(self.group_tensors, states):
            for piece, state in zip(tensors, group_states):
                if state:
                    new_state[piece.tensor] = state
        self.inner.state = new_state
        for group, saved in zip(self.inner.param_groups, options):
            for key, value in saved.items():
                current = group.get(key)
                if isinstance(current, torch.Tensor) and not isinstance(value, list):
                    current.fill_(value.item() if isinstance(value, torch.Tensor) else value)
                elif isinstance(current, tuple) and isinstance(value, list):
                    group[key] = tuple(value)
                else:
                    group[key] = value

    def state_bytes(self) -> int:
        """Bytes of optimizer state tensors held on this rank."""
        return sum(
            value.numel() * value.element_size()
            for per_tensor in self.inner.state.values()
            for value in per_tensor.values()
            if isinstance(value, torch.Tensor)
        )

    # [Note: optimizer state_dict across ranks]
    # ``state_dict()`` is the inner optimizer's, plus under ``"shardpar"`` what it covers: the
    # stage and, per param group, the pieces (parameter name and range) of its tensors. It
    # loads wherever an optimizer at the same stage covers the same pieces: their state is the
    # same there. At stage 0 every rank's optimizer updates the whole parameters with the same
    # averaged gradients, so every rank holds the same state, whatever its rank and the world
    # size, as under DDP: rank 0's file loads on every rank (DDP's resume idiom: rank 0 saves
    # ``opt.state_dict()``, every rank loads it), also in a job of another size. At stages 1-3
    # a rank's state covers only its pieces of the parameters, which the world size and the
    # rank decide, so such a state_dict loads only on a rank holding the same pieces: the one
    # that saved it, in a job of the same layout. Checkpoints (``shardpar.save_checkpoint``)
    # move state between any two layouts.

    def _layout(self) -> dict[str, Any]:
        """What this rank's optimizer state covers (see the Note above)."""
        return {
            "stage": self.engine.stage,
            "world_size": self.engine.world_size,
            "rank": self.engine.rank,
            "tensors": [[[t.name, *t.param_range] for t in tensors] for tensors in self.group_tensors],
        }

    def _layout_mismatch(self, saved: Any) -> str | None:
        """Why a state_dict saved with layout ``saved`` cannot load here, or None when it can."""
        here = self._layout()
        if not isinstance(saved, dict):
            return "it has no 'shardpar' entry: it was not made by a shardpar optimizer's state_dict()"
        if saved.get("stage") != here["stage"]:
            return f"it was saved at stage {saved.get('stage')!r}, this optimizer is at stage {here['stage']}"
        if saved.get("tensors") == here["tensors"]:
            return None
        if here["stage"] != 0 and (saved.get("world_size"), saved.get("rank")) != (here["world_size"], here["rank"]):
            return (
                f"it was saved by rank {saved.get('rank')!r} of {saved.get('world_size')!r}, this is rank "
                f"{here['rank']} of {here['world_size']}: at stage {here['stage']} a rank's state covers only "
                "its own pieces of the parameters (only at stage 0 does every rank hold the same state)"
            )
        return "it holds the state of other parameters, param groups or pieces of them than this optimizer updates"

    def state_dict(self) -> dict[str, Any]:
        """The inner optimizer's state for this rank's tensors, plus what they are."""
        self._follow_layout()
        state = self.inner.state_dict()
        state["shardpar"] = self._layout()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of this layout; at stage 0 any rank's (see the Note above)."""
        self._follow_layout()
        state_dict = dict(state_dict)
        problem = self._layout_mismatch(state_dict.pop("shardpar", None))
        if problem is not None:
            raise ValueError(
                f"this optimizer state_dict was saved for another stage, world size, rank or set of parameters "
                f"({problem}); use shardpar.save_checkpoint / shardpar.load_checkpoint to move training state "
                "between layouts"
            )
        self.inner.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"ShardedOptimizer(stage={self.engine.stage}, {self.inner!r})"


_PROBE_SHAPE = (8, 16)
"""The probe's tensor: 128 values, each half 64, a whole number of vectors of any common SIMD width,
so that an elementwise update rounds its halves exactly as it rounds the whole."""

_PROBE_LR = 0.1
"""The learning rate every probe step uses, whatever the group's: a group may come at lr 0
(a warmup scheduler made before the optimizer was ported) or tiny, where every optimizer
would look elementwise."""


def _probe(
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    options: dict[str, Any] | None,
    values: torch.Tensor,
    shapes: list[tuple[int, ...]],
) -> list[tuple[nn.Parameter, torch.optim.Optimizer]]:
    """``values`` cut into consecutive tensors of ``shapes``, each with its own instance of the
    optimizer (as each rank has its own), handed a list of that one tensor (``options`` None:
    the user passed tensors) or one param group with ``options``, as the user's was."""
    built, start = [], 0
    for shape in shapes:
        numel = math.prod(shape)
        param = nn.Parameter(values[start : start + numel].clone().reshape(shape))
        start += numel
        handed: list[Any] = [param] if options is None else [{**options, "params": [param]}]
        built.append((param, _at_probe_lr(optimizer_class(handed, **defaults))))
    return built


def _at_probe_lr(probe: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``probe`` with every group at ``_PROBE_LR`` (see there)."""
    for group in probe.param_groups:
        lr = group.get("lr")
        if isinstance(lr, torch.Tensor):
            group["lr"] = torch.full_like(lr, _PROBE_LR)  # never fill the user's tensor
        elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
            group["lr"] = _PROBE_LR
    return probe


def _step_needs_closure(optimizer_class: type[torch.optim.Optimizer]) -> bool:
    """Whether the class's ``step`` takes a closure it cannot do without (LBFGS's)."""
    try:
        closure = inspect.signature(optimizer_class.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _probe_step(param: nn.Parameter, probe: torch.optim.Optimizer, grad: torch.Tensor, needs_closure: bool) -> None:
    """One step of ``probe`` with gradient ``grad``: set before the step, or by the closure
    that a step needing one calls (the gradient of the linear loss ``<grad, param>``)."""
    if not needs_closure:
        param.grad = grad
        probe.step()
        return

    def closure() -> torch.Tensor:
        param.grad = grad.clone()
        return torch.dot(param.detach().reshape(-1), grad.reshape(-1))

    probe.step(closure)  # type: ignore[arg-type]  # torch types closures as returning float, not a loss tensor


def _error_text(error: BaseException) -> str:
    """``Type: message`` of an error the probe caught; for one without a message (a bare
    ``assert``, as nanochat's Muon has on a matrix's dimensions) where it was raised and that
    line of source, so the refusal does not show an empty ``AssertionError:``."""
    if str(error):
        return f"{type(error).__name__}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return f"{type(error).__name__}, with no message"
    last = frames[-1]
    source = f": {last.line.strip()}" if last.line else ""
    return f"{type(error).__name__}, with no message, at {Path(last.filename).name}:{last.lineno}{source}"


class _CannotProbe(Exception):
    """The elementwise check could not build the class at all: it cannot tell."""


def _not_elementwise(
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    device: torch.device,
    options: dict[str, Any] | None = None,
) -> str | None:
    """Why ``optimizer_class`` (with ``defaults``, and ``options`` as one param group's, or
    None where it is handed a list of tensors) cannot run on the pieces of parameters that
    stages 1-3 give it, or None when it updates element by element (then a piece gets exactly
    what it would as part of the whole parameter).

    Found by running it (two steps) three ways: on an 8x16 tensor, on the same 128 values as
    a 1-D tensor, and on the two 1-D halves of them with one instance each, as two ranks step
    their pieces. The first two must agree bit for bit, the halves with the whole within
    rounding. This catches factored statistics (Adafactor), whole-matrix updates (Muon), and
    anything computed over a whole parameter or over all of them: the norms of LAMB's and
    LARS's trust ratios, a clipping by the global norm inside the optimizer, LBFGS's history
    and step sizes over the vector of all its parameters (a class whose step needs a closure
    gets one). Torch's or anyone's, without a list of names. The halves differ in scale,
    values one way and gradients the other, so that a norm of either half is far from the
    whole's. On the model's device, where options such as ``fused=True`` or
    ``capturable=True`` are meant to run. A class it cannot build is not taken for
    elementwise: it raises ``_CannotProbe`` with the class's own error."""
    options = None if options is None else {k: v for k, v in options.items() if k != "params"}
    needs_closure = _step_needs_closure(optimizer_class)
    generator = torch.Generator().manual_seed(0)
    numel = math.prod(_PROBE_SHAPE)
    first_half = torch.arange(numel) < numel // 2
    values = (torch.randn(numel, generator=generator) * torch.where(first_half, 1.0, 8.0)).to(device)
    grads = [(torch.randn(numel, generator=generator) * torch.where(first_half, 8.0, 1.0)).to(device) for _ in range(2)]
    results: list[torch.Tensor] = []
    layouts: tuple[list[tuple[int, ...]], ...] = ([_PROBE_SHAPE], [(numel,)], [(numel // 2,), (numel // 2,)])
    for shapes in layouts:
        try:
            built = _probe(optimizer_class, defaults, options, values, shapes)
        except Exception as error:
            if not results:
                what = "a list of one" if options is None else "one param group of one"
                raise _CannotProbe(
                    f"it could not be built over {what} {'x'.join(map(str, _PROBE_SHAPE))} tensor "
                    f"({_error_text(error)})"
                ) from error
            return f"it refuses a 1-D tensor ({_error_text(error)})"
        try:
            for grad in grads:
                start = 0
                for param, probe in built:
                    piece = grad[start : start + param.numel()].clone().reshape(param.shape)
                    start += param.numel()
                    _probe_step(param, probe, piece, needs_closure)
        except Exception as error:
            shape = "x".join(map(str, shapes[0]))
            return f"a step on a {shape} tensor failed ({_error_text(error)})"
        results.append(torch.cat([param.detach().reshape(-1) for param, _ in built]))
    whole_2d, whole, halves = results
    if not torch.equal(whole_2d, whole):
        return (
            f"its update of a {'x'.join(map(str, _PROBE_SHAPE))} tensor differs from its update of the same "
            f"{numel} values as a 1-D tensor"
        )
    # The halves round as the whole (see _PROBE_SHAPE); the tolerance only keeps a kernel that
    # rounds by position (a vector width that does not divide 64) from being refused. What
    # this looks for changes the result by percents.
    if not torch.allclose(halves, whole, rtol=1e-5, atol=0.0):
        return (
            "its update of a tensor's two halves, each stepped by its own instance as two ranks step their "
            "pieces, differs from its update of the whole tensor: it computes something over a whole parameter "
            "(a norm, such as LAMB's or LARS's trust ratio) or over all of them (such as a clipping by their "
            "global norm, or LBFGS's history and step sizes over the vector of all parameters), which on a rank "
            "would cover only that rank's pieces"
        )
    return None


def _same_options(first: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether two param groups' options are equal (tensor-valued ones by value)."""
    if first.keys() != other.keys():
        return False
    for key, value in first.items():
        theirs = other[key]
        if isinstance(value, torch.Tensor) or isinstance(theirs, torch.Tensor):
            if not (
                isinstance(value, torch.Tensor) and isinstance(theirs, torch.Tensor) and torch.equal(value, theirs)
            ):
                return False
        elif value != theirs:
            return False
    return True


WHOLE_TENSORS_ATTRIBUTE = "shardpar_whole_tensors"
"""A class attribute by which an optimizer class says how it updates (True: it reads whole
tensors, each on its own; False: element by element), so that the check need not run it."""


def _whole_tensor_names(
    optimizer_class: type[torch.optim.Optimizer],
    request: ParamRequest,
    defaults: dict[str, Any],
    engine: Engine,
    whole_tensors: bool | None,
) -> tuple[frozenset[str], str | None]:
    """Stages 1-3: the parameters the class must update whole ([Note: whole-tensor ownership]
    in core/layout.py), and the refusal to raise once building it for real has not failed with
    the class's own error (where the check could not build it).

    ``whole_tensors`` (else the class's ``shardpar_whole_tensors``) says it; None runs the
    check per distinct set of group options (an optimizer may take whole-parameter norms only
    where weight decay is on, as timm's LARS): a class that updates element by element gets
    1-D slices, one that reads whole tensors gets them whole, and one whose update couples
    tensors (LBFGS's history over all of them) is refused by name."""
    declared = whole_tensors if whole_tensors is not None else getattr(optimizer_class, WHOLE_TENSORS_ATTRIBUTE, None)
    if declared is not None:
        return (frozenset(n for g in request.groups for n in g["names"]) if declared else frozenset()), None
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    verdicts: dict[str, str | None] = {}
    whole: set[str] = set()
    for index, group in enumerate(request.groups):
        options = (
            None if request.as_tensors else {k: v for k, v in group.items() if k not in ("names", "param_names")}
        )  # labels, not options
        key = repr(None if options is None else sorted(options.items(), key=lambda item: item[0]))
        which = f" with the options of param group {index}" if len(request.groups) > 1 else ""
        if key not in verdicts:
            try:
                verdicts[key] = _not_elementwise(optimizer_class, defaults, engine.device, options)
            except _CannotProbe as error:
                return frozenset(), (
                    f"{name}{which} could not be checked for how it updates parameters ({error}), which at stage "
                    f"{engine.stage} decides what each rank is handed: 1-D slices of the parameters where it updates "
                    "element by element, whole tensors where it reads them. Say which: shardpar.optimizer(..., "
                    f"whole_tensors=True or False), or set {WHOLE_TENSORS_ATTRIBUTE} on the class; or use stage=0"
                )
            if verdicts[key] is not None:
                coupling = _couples_tensors(optimizer_class, defaults, engine.device, options)
                if coupling is not None:
                    raise ValueError(
                        f"{name}{which} does not update parameters element by element ({verdicts[key]}), nor each "
                        f"tensor on its own ({coupling}): at stage {engine.stage} each rank updates only the slices "
                        "or whole tensors it owns, where it would compute something else than over all of them. "
                        "LBFGS is such an optimizer. Use stage=0, where every rank updates every parameter"
                    )
        if verdicts[key] is not None:
            whole.update(group["names"])
    return frozenset(whole), None


def _couples_tensors(
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    device: torch.device,
    options: dict[str, Any] | None,
) -> str | None:
    """Why the class's update of a tensor depends on the other tensors it is given, or None
    where each tensor's update is its own (Muon, Adafactor, LAMB): two tensors stepped by one
    instance against each by an instance of its own, as two ranks owning one each step them.
    Within rounding: a class batching same-shaped matrices (nanochat's Muon) may round one
    batch otherwise than two; what this looks for changes the result by percents."""
    needs_closure = _step_needs_closure(optimizer_class)
    generator = torch.Generator().manual_seed(1)
    numel = math.prod(_PROBE_SHAPE)
    values = (
        torch.randn(2 * numel, generator=generator) * torch.repeat_interleave(torch.tensor([1.0, 8.0]), numel)
    ).to(device)
    grads = [
        (torch.randn(2 * numel, generator=generator) * torch.repeat_interleave(torch.tensor([8.0, 1.0]), numel)).to(
            device
        )
        for _ in range(2)
    ]
    try:
        together = _probe_together(optimizer_class, defaults, options, values, grads, needs_closure)
        alone = torch.cat(
            [
                _probe_together(
                    optimizer_class,
                    defaults,
                    options,
                    values[i * numel : (i + 1) * numel],
                    [grad[i * numel : (i + 1) * numel] for grad in grads],
                    needs_closure,
                )
                for i in range(2)
            ]
        )
    except Exception as error:
        return f"stepping two {'x'.join(map(str, _PROBE_SHAPE))} tensors failed ({_error_text(error)})"
    if torch.allclose(together, alone, rtol=1e-4, atol=0.0):
        return None
    return (
        "its update of two tensors stepped together differs from that of each stepped by an instance of its own: it "
        "computes something over all the tensors it is given"
    )


def _probe_together(
    optimizer_class: type[torch.optim.Optimizer],
    defaults: dict[str, Any],
    options: dict[str, Any] | None,
    values: torch.Tensor,
    grads: list[torch.Tensor],
    needs_closure: bool,
) -> torch.Tensor:
    """``values`` cut into tensors of ``_PROBE_SHAPE``, all given to one instance, stepped once
    per gradient of ``grads``; their values after, concatenated."""
    numel = math.prod(_PROBE_SHAPE)
    params = [
        nn.Parameter(values[i : i + numel].clone().reshape(_PROBE_SHAPE)) for i in range(0, values.numel(), numel)
    ]
    handed: list[Any] = list(params) if options is None else [{**options, "params": list(params)}]
    probe = _at_probe_lr(optimizer_class(handed, **defaults))
    for grad in grads:
        pieces = [grad[i * numel : (i + 1) * numel].clone().reshape(_PROBE_SHAPE) for i in range(len(params))]
        if needs_closure:

            def closure(pieces: list[torch.Tensor] = pieces) -> torch.Tensor:
                for param, piece in zip(params, pieces):
                    param.grad = piece.clone()
                return sum(torch.dot(p.detach().reshape(-1), g.reshape(-1)) for p, g in zip(params, pieces))  # type: ignore[return-value]

            probe.step(closure)  # type: ignore[arg-type]  # torch types closures as returning float
        else:
            for param, piece in zip(params, pieces):
                param.grad = piece
            probe.step()
    return torch.cat([param.detach().reshape(-1) for param in params])


def _on_every_rank(engine: Engine, build: Callable[[], ShardedOptimizer]) -> ShardedOptimizer:
    """``build()``, or its error raised on every rank: at stages 1-3 the class is built over
    each rank's own pieces, so it may fail on some ranks only (a grouping by size that only some
    ranks' pieces break), and the others must not go on to wait for them in the first backward.
    One small all-gather, once, when the optimizer is built."""
    problem: Exception | None = None
    try:
        built = build()
    except Exception as error:
        problem = error
    verdict = None if problem is None else (type(problem).__name__, str(problem))
    verdicts = C.all_gather_objects(verdict, group=engine.group, device=engine.device)
    if problem is not None:
        raise problem
    for rank, other in enumerate(verdicts):
        if other is not None:
            kind = {"TypeError": TypeError, "ValueError": ValueError}.get(other[0], RuntimeError)
            raise kind(f"shardpar.optimizer failed on rank {rank}: {other[1]}")
    return built


def optimizer(
    model: ShardedModule,
    optimizer_class: type[torch.optim.Optimizer],
    params: Iterable[Any] | None = None,
    *,
    whole_tensors: bool | None = None,
    **defaults: Any,
) -> ShardedOptimizer:
    """Build ``optimizer_class`` over the wrapped model, sharded as the model's stage says.

    ``params`` takes what torch optimizers take (tensors, or dicts with per-group options),
    and the class is handed the same kind: a list of tensors (whole parameters at stage 0, this
    rank's pieces of them at stages 1-3), or one dict per group with its options. None means
    every trainable parameter, as a list of tensors (what ``model.parameters()`` gives torch).

    At stages 1-3 a class that updates element by element (AdamW, SGD, ...) gets this rank's
    1-D slices; one whose update reads whole tensors (Muon, Adafactor, LAMB, Shampoo) gets
    whole tensors, each owned by one rank ([Note: whole-tensor ownership] in core/layout.py).
    A check that runs the class decides; ``whole_tensors`` (True or False) says it instead, as
    a ``shardpar_whole_tensors`` attribute on the class does.
    """
    model = sharded_module_of(model, "shardpar.optimizer")  # or a torch.compile wrapper of it
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as torch.optim.AdamW, "
            f"got {optimizer_class!r}"
        )
    engine = model.engine
    request = _resolve_param_groups(engine, params)

    def build() -> ShardedOptimizer:
        return ShardedOptimizer(engine, optimizer_class, request, defaults, whole_tensors)

    # A class that reads whole tensors may move tensors to their owners: the optimizers built
    # before follow the layout they know first, so each is one layout behind at most ([Note:
    # optimizers follow the layout]).
    for built_before in model.attached_optimizers():
        built_before.pieces()

    # At stage 0 the class gets whole parameters, alike on every rank: it builds or fails alike everywhere.
    built = build() if engine.stage == 0 else _on_every_rank(engine, build)
    model.attach_optimizer(built)
    return built
