"""The model's parameters as every stage sees them: unique names, tied aliases, trainable
and frozen, the dtypes they were built with, and the signature ranks compare at wrap."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .element_order import ElementOrder, dense_order, is_dense, row_major_strides
from .param_guard import metadata_only


def tied_names(module: nn.Module) -> dict[str, str]:
    """``alias -> canonical name`` for every parameter reachable under more than one name."""
    canonical: dict[nn.Parameter, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if param in canonical:
            aliases[name] = canonical[param]
        else:
            canonical[param] = name
    return aliases


def module_device(module: nn.Module) -> torch.device:
    """The single device every parameter and buffer is on; raise naming two that differ."""
    first: tuple[str, torch.device] | None = None
    for name, tensor in list(module.named_parameters()) + list(module.named_buffers()):
        if first is None:
            first = (name, tensor.device)
        elif tensor.device != first[1]:
            raise ValueError(
                f"shardpar.wrap needs every parameter and buffer on one device, but "
                f"'{first[0]}' is on {first[1]} and '{name}' is on {tensor.device}; "
                "move the model with model.to(device) before wrapping"
            )
    return first[1] if first is not None else torch.device("cpu")


class ParamInventory:
    """Parameters of one module, each once under its first name (as ``named_parameters()``)."""

    def __init__(self, module: nn.Module) -> None:
        self.named = list(module.named_parameters())
        self.by_name = dict(self.named)
        self.name_of: dict[nn.Parameter, str] = {p: n for n, p in self.named}
        self.trainable = [(n, p) for n, p in self.named if p.requires_grad]
        self.frozen = [(n, p) for n, p in self.named if not p.requires_grad]
        self.aliases = tied_names(module)
        self.original_dtypes = {n: p.dtype for n, p in self.named}
        """Parameter dtypes as built: what checkpoints and full state dicts hold."""
        self.shapes = {n: p.shape for n, p in self.named}
        self._strides = {n: tuple(p.stride()) for n, p in self.named}
        """Strides as wrapped: the memory format every stage keeps ([Note: element order])."""
        self._requires_grad = [p.requires_grad for _, p in self.named]

    def order(self, name: str) -> ElementOrder:
        """The element order parameter ``name`` keeps in a flat buffer; a ValueError naming it
        when it is not dense (see ``dense_order``)."""
        return dense_order(name, self.shapes[name], self._strides[name])

    def kept_order(self, name: str) -> ElementOrder | None:
        """The element order of a parameter that stays the module's own tensor (frozen, stages
        0-2); None where it is not dense (it is then saved row-major and cannot be loaded in place)."""
        shape, strides = self.shapes[name], self._strides[name]
        return ElementOrder.of(shape, strides) if is_dense(shape, strides) else None

    @property
    def trainable_numel(self) -> int:
        return sum(p.numel() for _, p in self.trainable)

    def changed_requires_grad(self) -> str | None:
        """The first parameter whose ``requires_grad`` differs from wrap time, if any."""
        with metadata_only():
            for (name, param), before in zip(self.named, self._requires_grad):
                if param.requires_grad != before:
                    return name
        return None


def check_supported_dtypes(inventory: ParamInventory) -> None:
    """Trainable parameters must be real floating point (checked at wrap, naming the first
    that is not); frozen ones may be anything (integer tables, masks)."""
    for name, param in inventory.trainable:
        if param.is_complex():
            raise ValueError(
                f"parameter '{name}' is complex ({param.dtype}); shardpar trains real floating-point "
                "parameters only: store it as a real view (torch.view_as_real) or freeze it"
            )
        if not param.is_floating_point():
            raise ValueError(
                f"parameter '{name}' has dtype {param.dtype} and requires_grad=True; only floating-point "
                "parameters can be trained (freeze it with requires_grad_(False))"
            )


def check_initialized(module: nn.Module) -> None:
    """A lazy module (``nn.LazyLinear``...) has no shapes until its first forward, and wrap must
    lay every tensor out: name the first uninitialized one (torch DDP refuses them too)."""
    from torch.nn.parameter import is_lazy

    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            if is_lazy(tensor):
                raise ValueError(
                    f"{kind} '{name}' is not initialized yet (a lazy module such as nn.LazyLinear learns its shape "
                    "in its first forward): run one forward with a sample batch before shardpar.wrap"
                )


def check_dense_gradients(module: nn.Module, inventory: ParamInventory) -> None:
    """Gradients are reduced in dense flat buffers: an embedding that makes sparse gradients
    is refused at wrap, naming it (the gradient hook names any other sparse gradient)."""
    trainable = {id(param) for _, param in inventory.trainable}
    for name, sub in module.named_modules():
        if isinstance(sub, (nn.Embedding, nn.EmbeddingBag)) and sub.sparse and id(sub.weight) in trainable:
            raise ValueError(
                f"module '{name}' ({type(sub).__name__}) has sparse=True, so its weight gets sparse gradients; "
                "shardpar reduces dense gradients only: build it with sparse=False (or freeze its weight)"
            )


def sparse_gradient_error(name: str, grad: torch.Tensor) -> ValueError:
    return ValueError(
        f"parameter '{name}' got a {grad.layout} gradient; shardpar reduces dense (strided) gradients only: "
        "make the operation that produces it give a dense gradient (e.g. nn.Embedding(sparse=False))"
    )


def group_by_dtype(named: Sequence[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    """Parameters grouped by dtype, groups in order of first appearance, members in order."""
    groups: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for name, param in named:
        groups.setdefault(param.dtype, []).append((name, param))
    return list(groups.values())


def model_signature(module: nn.Module, fingerprint: str) -> list[tuple[str, str]]:
    """What every rank must agree on, as comparable ``(what, value)`` rows."""
    rows = [("config", fingerprint)]
    for name, p in module.named_parameters():
        # Strides where they are not row-major: ranks must keep each parameter in the same
        # element order, or rank 0's values would be read in another order elsewhere.
        strides = tuple(p.stride())
        layout = "" if strides == row_major_strides(p.shape) else f" strides={strides}"
        rows.append(
            (f"parameter '{name}'", f"shape={tuple(p.shape)} dtype={p.dtype} requires_grad={p.requires_grad}{layout}")
        )
    for name, b in module.named_buffers():
        rows.append((f"buffer '{name}'", f"shape={tuple(b.shape)} dtype={b.dtype}"))
    return rows


def first_difference(reference: Sequence[tuple[str, str]], other: Sequence[tuple[str, str]]) -> str | None:
    for (what_a, value_a), (what_b, value_b) in zip(reference, other):
        if what_a != what_b:
            return f"{what_a} on rank 0 is {what_b} here (parameters/buffers differ in name or order)"
        if value_a != value_b:
            return f"{what_a} is {value_a} on rank 0 but {value_b} on rank {{rank}}"
    if len(reference) != len(other):
        longer, shorter = (reference, other) if len(reference) > len(other) else (other, reference)
        extra = longer[len(shorter)][0]
        owner = "rank 0" if longer is reference else "rank {rank}"
        return f"{extra} exists only on {owner} ({len(reference)} entries on rank 0, {len(other)} on rank {{rank}})"
    return None


def plain_state_entries(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module.state_dict(keep_vars=True)`` as torch builds it before any hook runs: every
    parameter and persistent buffer under each name it is reachable by, in torch's order.

    What shardpar's own machinery lists (checkpoints keyed by parameters, the wrap-time checks):
    a user's state-dict hooks may rename, split or drop entries ([Note: full values in the
    module] in facade/module_state.py), and at stage 3 they would read sharded parameters, so
    the hooks run only where the user asked for a state dict."""
    entries: dict[str, torch.Tensor] = {}

    def visit(sub: nn.Module, prefix: str) -> None:
        for name, param in sub._parameters.items():
            if param is not None:
                entries[prefix + name] = param
        for name, buffer in sub._buffers.items():
            if buffer is not None and name not in sub._non_persistent_buffers_set:
                entries[prefix + name] = buffer
        for name, child in sub._modules.items():
            if child is not None:
                visit(child, prefix + name + ".")

    visit(module, "")
    return entries


def state_dict_hook_modules(module: nn.Module, load: bool) -> list[str]:
    """The submodules whose state dicts torch's machinery changes beyond the parameters and
    buffers: the user's state-dict hooks (``load``: load pre- and post-hooks), or a class of
    their own saving (loading) its state another way. Where there are any, what a state dict
    holds is known only by running torch's own ``state_dict`` (``load_state_dict``) on full
    values; shardpar registers no such hooks itself."""
    if load:
        hooks, method = ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"), "_load_from_state_dict"
    else:
        hooks, method = ("_state_dict_pre_hooks", "_state_dict_hooks"), "_save_to_state_dict"
    return [
        name or "(the model)"
        for name, sub in module.named_modules()
        if any(getattr(sub, attr, None) for attr in hooks)
        or getattr(type(sub), method) is not getattr(nn.Module, method)
        or type(sub).get_extra_state is not nn.Module.get_extra_state
    ]
