"""The whole-model view of a wrapped module: full state dicts out and in, and what the
module's own ``state_dict``, ``load_state_dict`` and ``_apply`` do once it is wrapped.

Every stage keeps the parameters somewhere other than where plain torch looks (buffers and
slices, fp32 masters behind bf16 compute copies, shards): this is where a full, exact,
full-precision picture of them is assembled (:meth:`ModuleState.full_state_dict`), written
back (:meth:`ModuleState.load_full_state_dict`), and where the module's own torch methods are
pointed at those so that scripts written for plain torch or DDP neither lose values nor break
the storage (see the hooks the engine installs with them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
from torch import nn

from ..comm import collectives as C
from ..comm import compat, watch
from ..core.param_guard import allow, metadata_only
from ..core.pieces import TensorPiece

if TYPE_CHECKING:
    from .engine import Engine


STATE_DICT_OPERATION = ("full_state_dict (gathering every parameter for a state dict: model.state_dict(), "
                        "full_state_dict(), save_pretrained, a copy of the module)")
"""What a rank gathering a full state dict is doing, in reports."""


def _refuse_assign(what: str) -> None:
    raise ValueError(
        f"load_state_dict(assign=True){what} is not supported on a model wrapped by shardpar: the parameters live "
        "in shardpar's buffers and shards, so values are always copied in (use assign=False)"
    )


class ModuleState:
    """One engine's full state dicts and the module-level methods built on them."""

    def __init__(self, engine: "Engine") -> None:
        self.engine = engine
        self._internal_state = False
        """Set while the engine itself lists the module's state-dict entries (hooks stand aside)."""
        self._collecting_state = False

    def install_state_dict_hooks(self, values: Callable[[], dict[str, torch.Tensor]]) -> list[Any]:
        """``module.state_dict()`` (nanoGPT's ``raw_model.state_dict()``, Hugging Face's
        ``save_pretrained``) returns ``values()`` instead of what the parameters hold: at stage 3
        full tensors, like ``full_state_dict()`` (a collective: call it on every rank); at stage 0
        under mixed precision the full-precision masters every rank holds (no collective), not
        the low-precision compute copies. With ``keep_vars=True`` it returns the Parameter
        objects, as torch does. At stages 1-2 under mixed precision the masters are sharded, so
        there it is ``full_state_dict()`` too (a collective), as at stage 3. Returns the hooks'
        handles."""

        def pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            if not keep_vars and not self._internal_state:
                self._collecting_state = True
                self._allow_detach = allow("detach")
                self._allow_detach.__enter__()

        def post(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
            if not self._collecting_state:
                return
            self._collecting_state = False
            self._allow_detach.__exit__(None, None, None)
            for key, value in values().items():
                state[prefix + key] = value

        module = self.engine.module
        return [module.register_state_dict_pre_hook(pre), compat.register_state_dict_post_hook(module, post)]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor of ``module.state_dict()``, full, detached and in full precision (the
        master values), on every rank. Tied aliases map to the same tensor.

        A collective that scripts written for plain torch call on rank 0 alone (``if
        master_process: torch.save(model.state_dict(), ...)``): the ranks first meet through the
        store, so that its all-reduces never pair with another rank's training collectives, and
        a rank that came alone is named as gathering a state dict ([Note: stalled waits])."""
        with watch.operation(STATE_DICT_OPERATION):
            watch.meet(self.engine.group, "full_state_dict")
            return self._full_state_dict()

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        self.engine.wait_for_params()
        params = self.gather_full_params()
        out = {}
        for key, value in self.module_entries(keep_vars=True).items():
            canonical = self.engine.aliases.get(key, key)
            if canonical in params:
                out[key] = params[canonical]
            else:  # a buffer: back in the dtype the model was built with
                out[key] = value.detach().to(self.engine.original_buffer_dtypes.get(canonical, value.dtype), copy=True)
        return out

    def refuse_moves(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """``to()``, ``double()``, ``cuda()``, ``half()``... of the wrapped model after wrap (they
        all run ``_apply(fn)``): one that would leave every tensor as it is (``model.to(device)``
        on the device it is on) does nothing; one that would move or cast a tensor is refused,
        since the parameters are views of the engine's buffers and shards and a new tensor
        would silently leave them."""
        for name, tensor in [*self.engine.module.named_parameters(remove_duplicate=False),
                             *self.engine.module.named_buffers(remove_duplicate=False)]:
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

    def load_module_state(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """``load_state_dict`` of the ShardedModule, and of the wrapped module where its parameters
        are not the stored values (mixed precision, stage 3): the values reach the masters and
        shards (see :meth:`load_full_state_dict`), not just the compute copies."""
        if assign:
            _refuse_assign("")
        missing, unexpected = self.load_full_state_dict(dict(state_dict), strict=strict)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def install_submodule_load_hooks(self) -> list[Any]:
        """``model.module.encoder.load_state_dict(sd)`` -- a submodule's own load, where the
        parameters are not the stored values (mixed precision, stage 3) -- loads the masters and
        shards like the module's (:meth:`load_module_state`), instead of writing compute copies
        the next step overwrites, or placeholders that hold nothing. A pre-hook on each
        submodule acts only where the load started (``prefix`` empty: a load of the whole module
        is taken over before torch recurses); it loads the keys it recognises through
        :meth:`load_full_state_dict` and takes them out of torch's way, and the matching
        post-hook takes them off torch's missing keys. Keys torch would call missing or
        unexpected stay so. A collective wherever loading the whole module is: call it on
        every rank. Returns the hooks' handles."""
        handled: dict[int, list[str]] = {}

        def pre(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                missing_keys: list, unexpected_keys: list, error_msgs: list, qualified: str = "") -> None:
            if prefix:
                return  # one module of a larger load, which the load's own top module handles
            if local_metadata.get("assign_to_params_buffers"):
                _refuse_assign(f" of '{qualified}'")
            entries = self.module_entries(keep_vars=True)
            ours = [key for key in state_dict if f"{qualified}.{key}" in entries]
            self.load_full_state_dict({f"{qualified}.{key}": state_dict[key] for key in ours}, strict=False)
            for key in ours:
                del state_dict[key]
            handled[id(module)] = ours

        def post(module: nn.Module, incompatible: Any) -> None:
            loaded = set(handled.pop(id(module), ()))
            incompatible.missing_keys[:] = [key for key in incompatible.missing_keys if key not in loaded]

        handles = []
        for qualified, submodule in self.engine.module.named_modules():
            if qualified:
                handles.append(compat.register_load_state_dict_pre_hook(
                    submodule, lambda *args, qualified=qualified: pre(*args, qualified=qualified)))
                handles.append(submodule.register_load_state_dict_post_hook(post))
        return handles

    def replicated_master_state(self) -> dict[str, torch.Tensor]:
        """Stage 0 under mixed precision: the module's state-dict entries with the master values
        (and buffers in the dtype they were built with), from what this rank holds in full."""
        storage = self.engine.storage
        masters = {name: buf.layout.view(buf.values, name) for buf in storage.buffers for name in buf.params}
        masters.update(storage.frozen_values())
        out = {}
        for key, value in self.module_entries(keep_vars=True).items():
            canonical = self.engine.aliases.get(key, key)
            if canonical in masters:
                out[key] = masters[canonical].detach()
            else:  # a buffer: in the dtype the model was built with
                out[key] = value.detach().to(self.engine.original_buffer_dtypes.get(canonical, value.dtype))
        return out

    def module_entries(self, keep_vars: bool) -> dict[str, Any]:
        """The module's state-dict entries without touching parameter values."""
        previous, self._internal_state = self._internal_state, True
        try:
            return self.engine.module.state_dict(keep_vars=keep_vars)
        finally:
            self._internal_state = previous

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """``name -> full tensor`` of every parameter, assembled on every rank from all ranks'
        save pieces (each element is written by exactly one rank, so one all-reduce per dtype
        of the zero-filled rest reproduces the values exactly)."""
        by_dtype: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
        for name, param in self.engine.named_params:
            by_dtype.setdefault(self.engine.original_dtypes[name], []).append((name, param))
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

    def load_full_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> tuple[list[str], list[str]]:
        """Inverse of :meth:`full_state_dict` (every rank passes the same full tensors).

        Values go through :meth:`load_pieces`, so master copies and stage-3 shards get the
        full-precision values, not a low-precision compute copy. As ``nn.Module`` does,
        ``strict=False`` loads the keys that are there, keeps the current values of the rest
        and returns ``(missing, unexpected)``; a wrong shape is an error either way. A tied
        parameter takes its value from whichever of its keys is present.
        """
        self.engine.wait_for_params()
        expected = {name: tuple(t.shape) for name, t in self.module_entries(keep_vars=True).items()}
        missing = [name for name in expected if name not in state]  # torch's orders: the module's, the input's
        unexpected = [name for name in state if name not in expected]
        wrong_shape = [
            f"{name}: {tuple(state[name].shape)} vs model {shape}"
            for name, shape in expected.items()
            if name in state and tuple(state[name].shape) != shape
        ]
        problems = [("shape", wrong_shape)] + ([("missing", sorted(missing)), ("unexpected", sorted(unexpected))]
                                               if strict else [])
        if any(items for _, items in problems):
            raise ValueError(
                "state dict does not match the model: "
                + "; ".join(f"{label}: {', '.join(items)}" for label, items in problems if items)
                + ("" if not strict or wrong_shape else " (strict=False loads only the keys present)")
            )
        # Each canonical name's value: its own key, or any tied alias's.
        source = {self.engine.aliases.get(key, key): value for key, value in state.items() if key in expected}
        orders = self.engine.element_orders()
        with torch.no_grad():
            for piece in self.engine.load_pieces():
                if piece.name in source:
                    start, end = piece.param_range  # in the parameter's memory order
                    piece.tensor.copy_(orders[piece.name].flatten(source[piece.name])[start:end])
            for name, buffer in self.engine.module.named_buffers():
                if name in state:
                    buffer.copy_(state[name])
            self.engine.after_load()
        return missing, unexpected
