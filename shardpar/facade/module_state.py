"""The whole-model view of a wrapped module: its full values for torch's own ``state_dict``,
``load_state_dict`` and any code that reads or writes weights outside forward, and what its
``_apply`` does once it is wrapped.

[Note: full values in the module]
Every stage keeps the parameters somewhere other than where plain torch looks (buffers and
slices, fp32 masters behind bf16 compute copies, stage-3 placeholders). Rather than rebuild
torch's state-dict machinery beside it (key matching, prefixes, strictness, and every
state-dict hook a user's module registers: torchtitan's fused QKV splits ``wqkv`` into
``wq``/``wk``/``wv`` in a post-hook and fuses them back in a load pre-hook), shardpar runs
torch's own ``state_dict`` and ``load_state_dict`` on the real module while its parameters
hold their full, full-precision values, and writes back what a load changed:

- :meth:`ModuleState.full_values` (``model.gathered()``) points every parameter in scope at
  its full value (``param.data``, so the Parameter objects stay the user's): the parameters
  themselves at stage 0, the masters at stage 0 under mixed precision, values assembled from
  every rank's shards at stages 1-3 (a collective: the ranks first meet, [Note: stalled
  waits]); buffers are shown in the dtype the model was built with. On exit every parameter
  points at its storage again (stage 3: its placeholder, guarded), and with ``writeback``
  what the parameters then hold -- written in place or re-assigned through ``.data`` -- goes
  to the masters and shards (:meth:`Engine.load_pieces`) and from there to the compute
  copies (:meth:`Engine.after_load`).
- ``state_dict``/``load_state_dict`` of the module and of every submodule (instance
  attributes set by the surface) run torch's own, of the module's class, inside that context.
  So hooks run on full tensors with torch's prefixes, missing and unexpected keys are torch's,
  a load that matches a key copies into a tensor that is written back, and a key that reaches
  no tensor is never reported as loaded.
- shardpar's own checkpoints are keyed by parameters (:func:`plain_state_entries`): they need
  no hook to reload and load into a hooked model at any stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import watch
from ..core.masters import FullMaster
from ..core.param_guard import Guard, guard, guard_of, metadata_only, unguard
from ..core.pieces import FullValues, TensorPiece
from ..core.replicated import ReplicatedStorage
from ..core.training_state import Phase

if TYPE_CHECKING:
    from ..engines import Engine


STATE_DICT_OPERATION = (
    "full_state_dict (gathering every parameter for a state dict: model.state_dict(), "
    "full_state_dict(), save_pretrained, a copy of the module, model.gathered())"
)
"""What a rank gathering full values is doing, in reports."""


def _refuse_assign(what: str) -> None:
    raise ValueError(
        f"load_state_dict(assign=True){what} is not supported on a model wrapped by shardpar: the parameters live "
        "in shardpar's buffers and shards, so values are always copied in (use assign=False)"
    )


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same values in the same memory (``param.data`` is a new
    tensor object at every read, so identity cannot tell)."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


@dataclass
class _Shown:
    """What :meth:`ModuleState.full_values` changed, to undo it."""

    params: list[tuple[str, nn.Parameter, torch.Tensor, torch.Tensor, Guard | None]]
    """``(name, parameter, its storage's tensor, the full value shown, its guard or None)``."""
    buffers: list[tuple[str, nn.Module, str, torch.Tensor, torch.Tensor]]
    """``(name, owner module, attribute, the buffer object, its own data)`` of each buffer shown."""
    fresh: bool
    """Whether the values shown are copies (gathered), so that a read may keep them."""
    writeback: bool


class ModuleState:
    """One engine's full values in the module, and the module-level methods built on them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._shown: _Shown | None = None
        """The context of :meth:`full_values` in force, if any (it is entered once: inner uses
        of it, such as torch's recursion into submodules' ``state_dict``, find it shown)."""

    # ------------------------------------------------------------------ full values

    @contextlib.contextmanager
    def full_values(
        self, scope: nn.Module | None = None, writeback: bool = True, copies: bool = False
    ) -> Iterator[None]:
        """See [Note: full values in the module]. ``scope``: the module (the wrapped one, or one
        of its submodules) whose parameters and buffers are shown; None: all of them.
        ``copies``: the values shown are copies at every stage (not the live parameters or
        masters of stage 0), so that what is not written back is lost: with ``writeback`` they
        are written back only if the block returns normally (a load that raises changes
        nothing). A collective at stages 1-3: enter it on every rank."""
        if self._shown is not None:  # nested: the outer context shows the values already
            self._shown.writeback |= writeback
            yield
            return
        engine = self.engine
        kind = engine.storage.full_values
        if kind is not FullValues.IN_PARAMS and engine.state.phase is not Phase.IDLE:
            raise RuntimeError(
                f"full parameter values were asked for during {engine.state.phase.value} (model.gathered(), a state "
                "dict or a load): they are for use between steps, outside forward and backward"
            )
        root = engine.module
        scope = root if scope is None else scope
        in_scope = {id(p) for p in scope.parameters()}
        named = [(name, param) for name, param in engine.named_params if id(param) in in_scope]
        engine.storage.wait_for_params()
        if kind is FullValues.GATHERED:
            with watch.operation(STATE_DICT_OPERATION):
                watch.meet(engine.group, "full_state_dict")
                values = self.gather_full_params({name for name, _ in named})
        elif kind is FullValues.IN_MASTERS:
            values = self.replicated_masters()
        else:
            values = {}
        if copies and kind is not FullValues.GATHERED:
            with metadata_only():
                values = {name: values.get(name, param.data).clone() for name, param in named}
        shown = _Shown([], [], fresh=copies or kind is FullValues.GATHERED, writeback=writeback)
        with metadata_only():  # a sharded stage-3 parameter's data (no storage) is taken, not read
            for name, param in named:
                own = param.data
                value = values.get(name, own)
                held_guard = guard_of(param)
                shown.params.append((name, param, own, value, held_guard))
        for _, param, _, value, _ in shown.params:
            unguard(param)
            param.data = value
        module_names = {id(m): n for n, m in root.named_modules()}
        seen: set[int] = set()
        for sub in scope.modules():
            for attr, buffer in sub._buffers.items():
                if buffer is None or id(buffer) in seen:
                    continue
                seen.add(id(buffer))
                prefix = module_names.get(id(sub), "")
                qualified = f"{prefix}.{attr}" if prefix else attr
                built = engine.original_buffer_dtypes.get(qualified, buffer.dtype)
                own = buffer.data
                if built != buffer.dtype or copies:
                    buffer.data = own.to(built, copy=True)  # under mixed precision: as the model was built
                shown.buffers.append((qualified, sub, attr, buffer, own))
        self._shown = shown
        try:
            yield
        except BaseException:
            shown.writeback &= not copies
            raise
        finally:
            self._shown = None
            self._take_back(shown)

    def _take_back(self, shown: _Shown) -> None:
        """Point parameters and buffers at their storage again and, with ``writeback``, store
        what they hold now (written in place into a copy, or re-assigned through ``.data``)."""
        changed: dict[str, torch.Tensor] = {}
        problems: list[str] = []
        for name, param, own, value, held_guard in shown.params:
            current = param.data
            param.data = own
            if held_guard is not None:
                guard(param, held_guard)
            if shown.writeback and (shown.fresh or not _same_tensor(current, value)):
                if current.shape != own.shape:
                    problems.append(
                        f"parameter '{name}' was given shape {tuple(current.shape)}, not its {tuple(own.shape)}"
                    )
                changed[name] = current
        changed_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for qualified, sub, attr, buffer, own in shown.buffers:
            current_buffer = sub._buffers.get(attr)
            if current_buffer is not buffer:  # re-assigned (``self.cache = ...``): its values go into ours,
                sub._buffers[attr] = buffer  # whose object the engine keeps (broadcasts, casts)
            value = current_buffer if current_buffer is not None and current_buffer is not buffer else buffer.data
            buffer.data = own
            if shown.writeback and not _same_tensor(value, own):
                if value.shape != own.shape:
                    problems.append(
                        f"buffer '{qualified}' was given shape {tuple(value.shape)}, not its {tuple(own.shape)}"
                    )
                changed_buffers.append((own, value))
        if problems:
            raise ValueError(
                "inside model.gathered() or a load, " + "; ".join(problems) + ": a wrapped model's "
                "parameters and buffers keep their shapes (nothing was written back)"
            )
        if not shown.writeback:
            return
        orders = self.engine.element_orders()
        with torch.no_grad():
            for piece in self.engine.storage.load_pieces():
                if piece.name in changed:
                    start, end = piece.param_range  # in the parameter's memory order
                    piece.tensor.copy_(orders[piece.name].flatten(changed[piece.name])[start:end])
            for own, value in changed_buffers:
                own.copy_(value)
            self.engine.storage.after_load()

    def replicated_masters(self) -> dict[str, torch.Tensor]:
        """Stage 0 under mixed precision: every parameter's full-precision master (a view of
        what this rank holds, no collective), frozen ones included."""
        storage = self.engine.storage
        assert isinstance(storage, ReplicatedStorage) and isinstance(storage.master, FullMaster)  # IN_MASTERS: stage 0
        master = storage.master
        masters = {name: buf.layout.view(master.values(buf), name) for buf in storage.buffers for name in buf.params}
        masters.update(storage.frozen_values())
        return masters

    def gather_full_params(self, names: set[str] | None = None) -> dict[str, torch.Tensor]:
        """``name -> full tensor`` of every parameter (or those in ``names``), assembled on every
        rank from all ranks' save pieces (each element is written by exactly one rank, so one
        all-reduce per dtype of the zero-filled rest reproduces the values exactly). Every rank
        passes the same ``names``."""
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for name, param in self.engine.named_params:
            if names is None or name in names:
                by_dtype.setdefault(self.engine.inventory.original_dtypes[name], []).append((name, param))
        pieces: dict[str, list[TensorPiece]] = {}
        for piece in self.engine.save_pieces():
            pieces.setdefault(piece.name, []).append(piece)
        orders = self.engine.element_orders()  # pieces count in memory order; out keeps each one's strides
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for dtype, named in by_dtype.items():
                flat = torch.zeros(sum(p.numel() for _, p in named), dtype=dtype, device=self.engine.device)
                offset = 0
                for name, param in named:
                    full = flat[offset : offset + param.numel()]
                    for piece in pieces.get(name, []):
                        full[piece.param_range[0] : piece.param_range[1]].copy_(piece.tensor)
                    out[name] = orders[name].shaped(full)
                    offset += param.numel()
                if dtype == torch.bool:  # gloo sums no bools: gather the bytes as uint8
                    reduced = flat.view(torch.uint8)
                    C.all_reduce(reduced, group=self.engine.group, op="max")
                else:
                    C.all_reduce(flat, group=self.engine.group)
        return out

    # ------------------------------------------------------------------ torch's methods on full values

    def state_dict_of(self, module: nn.Module) -> Callable[..., Any]:
        """``module.state_dict`` while wrapped: torch's own (the module class's), on full values;
        with ``keep_vars=True`` the Parameter objects as they stand, as torch returns them."""
        own = type(module).state_dict

        def state_dict(*args: Any, **kwargs: Any) -> Any:
            keep_vars = kwargs.get("keep_vars", len(args) > 2 and args[2])
            if keep_vars or self._shown is not None:
                return own(module, *args, **kwargs)
            with self.full_values(scope=module, writeback=False):
                return own(module, *args, **kwargs)

        return state_dict

    def load_state_dict_of(self, module: nn.Module, atomic: bool = False) -> Callable[..., Any]:
        """``module.load_state_dict`` while wrapped: torch's own (the module class's) into the
        full values, which are then written back to the masters and shards. A collective
        wherever the values are gathered: call it on every rank. A load that raises (missing
        keys under ``strict``, a wrong shape) has loaded what matched, as torch's; with
        ``atomic`` (``ShardedModule.load_state_dict``) it changes nothing."""
        own = type(module).load_state_dict

        def load_state_dict(state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
            if assign:
                _refuse_assign("" if module is self.engine.module else f" of a submodule ({type(module).__name__})")
            with self.full_values(scope=module, writeback=True, copies=atomic):
                return own(module, state_dict, strict=strict)

        return load_state_dict

    def load_checked(self, state: dict[str, torch.Tensor], check: Callable[[Any], Any]) -> Any:
        """Torch's non-strict load of the whole module on full values, then ``check(result)``
        (which may raise: then nothing is written back, on any rank, as every rank checks the
        same keys); returns what ``check`` returns. For loaders with their own strictness
        (``load_pretrained`` of a model with load hooks)."""
        module = self.engine.module
        with self.full_values(writeback=True, copies=True):
            return check(type(module).load_state_dict(module, state, strict=False))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every entry of ``module.state_dict()`` (its hooks run), full, detached, in full
        precision (the master values) and the model's own buffer dtypes, on every rank; copies,
        with entries that share memory (tied weights) sharing one copy.

        A collective at stages 1-3 that scripts written for plain torch call on rank 0 alone
        (``if master_process: torch.save(model.state_dict(), ...)``): the ranks first meet
        through the store, so that its all-reduces never pair with another rank's training
        collectives, and a rank that came alone is named as gathering a state dict ([Note:
        stalled waits])."""
        module = self.engine.module
        with self.full_values(writeback=False):
            state = type(module).state_dict(module)
            shown = self._shown
            assert shown is not None
            # Entries in live memory (the parameters at stage 0, the masters, buffers) are copied;
            # gathered values and tensors the hooks made are copies already.
            live = {
                tensor.untyped_storage().data_ptr()
                for _, _, _, buffer, own in shown.buffers
                for tensor in (buffer, own)
            }
            if not shown.fresh:
                live |= {value.untyped_storage().data_ptr() for _, _, _, value, _ in shown.params}
            copies: dict[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype], torch.Tensor] = {}
            out: dict[str, Any] = {}
            for key, value in state.items():
                if isinstance(value, torch.Tensor):  # (a module's extra state stays as it is)
                    value = value.detach()
                    where = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
                    if where not in copies:  # tied entries: one tensor
                        copies[where] = value.clone() if value.untyped_storage().data_ptr() in live else value
                    value = copies[where]
                out[key] = value
            return out

    def refuse_moves(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``to()``, ``double()``, ``cuda()``, ``half()``... of the wrapped model after wrap (they
        all run ``_apply(fn)``): one that would leave every tensor as it is (``model.to(device)``
        on the device it is on) does nothing; one that would move or cast a tensor is refused,
        since the parameters are views of the engine's buffers and shards and a new tensor
        would silently leave them."""
        for name, tensor in [
            *self.engine.module.named_parameters(remove_duplicate=False),
            *self.engine.module.named_buffers(remove_duplicate=False),
        ]:
            with metadata_only():  # metadata only: a stage-3 parameter has no values to read
                shape, stride, dtype, device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device
            # fn on a one-element stand-in of the same dtype, device and shape shows what it
            # would do to the tensor without reading it: nothing (it returns the stand-in), or
            # a cast, a move, or a memory format that the tensor does not have already.
            probe = torch.empty((), dtype=dtype, device=device).expand(shape)
            try:
                out = fn(probe)
                unchanged = out is probe or (out.dtype == dtype and out.device == device and out.stride() == stride)
            except Exception:
                unchanged = False
            if not unchanged:
                raise ValueError(
                    f"this call would move or cast '{name}' ({tensor.dtype}, {tensor.device}) of a model wrapped by "
                    "shardpar, whose parameters live in the engine's buffers and shards; move or cast the module "
                    "before shardpar.wrap (model.to(device, dtype), then wrap), or use mixed_precision= for "
                    "low-precision compute"
                )
