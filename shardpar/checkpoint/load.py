"""``load_checkpoint``: every rank reads exactly the ranges it needs -- whole parameters at
stages 0-2, its shards at stage 3, its optimizer pieces -- whatever world size and stage the
checkpoint was written at, after checking each file it reads against the manifest's sha256.
Optimizer state comes back as [Note: optimizer state in pieces] in
:mod:`shardpar.checkpoint.save` describes.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from ..core.element_order import ElementOrder
from ..engines import Engine
from ..errors import CheckpointError
from ..facade import ShardedModule
from ..optim import ShardedOptimizer
from .async_save import finish_pending
from .format import Manifest, read_manifest
from .json_values import decode_value
from .protocol import (
    agree,
    buffer_target,
    check_optimizer,
    collective_phase,
    in_param_space,
    model_tensors,
    read_on_every_rank,
)
from .reader import CheckpointReader, PieceRead
from .reorder import ReorderedReads


def _model_mismatch(manifest: Manifest, engine: Engine) -> str | None:
    """Differences between the checkpoint's and the model's tensor names and shapes."""
    inventory, _ = model_tensors(engine)
    stored = manifest.tensors
    missing, unexpected, shapes = [], [], []
    wanted = set()
    for name, kind, tensor in inventory:
        source = name if name in stored else manifest.aliases.get(name)
        wanted.add(source)
        if source is None:
            missing.append(name)
        elif tuple(tensor.shape) != stored[source].shape:
            shapes.append(f"{name} (checkpoint {list(stored[source].shape)}, model {list(tensor.shape)})")
        elif (kind == "buffer") != (stored[source].kind == "buffer"):
            shapes.append(f"{name} (a {stored[source].kind} in the checkpoint, a {kind} in the model)")
    unexpected = [name for name in stored if name not in wanted]
    if not (missing or unexpected or shapes):
        return None
    parts = [
        f"{label}: {', '.join(names)}"
        for label, names in (
            ("missing in checkpoint", missing),
            ("unexpected in checkpoint", unexpected),
            ("shape mismatch", shapes),
        )
        if names
    ]
    return f"checkpoint {manifest.directory} does not match the model: " + "; ".join(parts)


def _check_optimizer_matches(manifest: Manifest, optimizer: ShardedOptimizer) -> None:
    record = manifest.optimizer
    if record is None:
        raise CheckpointError(f"checkpoint {manifest.directory} has no optimizer state (saved without an optimizer)")
    expected = optimizer.class_name
    if record.class_name != expected:
        raise CheckpointError(
            f"checkpoint {manifest.directory} holds state of optimizer {record.class_name}, not of {expected}"
        )
    if len(record.param_groups) != len(optimizer.pieces()):
        raise CheckpointError(
            f"checkpoint {manifest.directory} has {len(record.param_groups)} optimizer param "
            f"groups, the optimizer {len(optimizer.pieces())}"
        )
    group_of = {n: i for i, g in enumerate(record.param_groups) for n in g["params"]}
    for index, tensors in enumerate(optimizer.pieces()):
        for piece in tensors:
            if group_of.get(piece.name, index) != index:
                raise CheckpointError(
                    f"parameter '{piece.name}' is in optimizer param group {index}, but in group "
                    f"{group_of[piece.name]} in checkpoint {manifest.directory}"
                )


def _state_device(group: dict[str, Any], owner: torch.Tensor) -> torch.device:
    """torch keeps ``step`` on the CPU unless the optimizer is capturable or fused."""
    return owner.device if group.get("capturable") or group.get("fused") else torch.device("cpu")


def _plan_optimizer(
    reader: CheckpointReader,
    manifest: Manifest,
    optimizer: ShardedOptimizer,
    orders: dict[str, ElementOrder],
    reordered: ReorderedReads,
) -> tuple[list[list[dict[str, Any]]], list[PieceRead]]:
    """Fresh state for every piece this rank's optimizer updates (``states[g][i]`` for
    ``optimizer.pieces()[g][i]``), and the reads that fill its tensors (those of reordered
    tensors go to ``reordered``). State of a whole parameter (stage 0) has its strides, as
    torch's ``zeros_like(param)`` gives."""
    record = manifest.optimizer
    assert record is not None  # _check_optimizer_matches refused a checkpoint without one
    states: list[list[dict[str, Any]]] = []
    reads: list[PieceRead] = []
    for tensors, group in zip(optimizer.pieces(), optimizer.group_options()):
        states.append([])
        for owner in tensors:
            state: dict[str, Any] = {}
            start, end = owner.param_range
            for key, value in record.scalar_state.get(owner.name, {}).items():
                state[key] = decode_value(value, _state_device(group, owner.tensor))
            for key, entry in record.state.get(owner.name, {}).items():
                # As torch's Optimizer.load_state_dict: floating state takes the tensor's dtype.
                floating = entry.dtype.is_floating_point and owner.tensor.is_floating_point()
                dtype = owner.tensor.dtype if floating else entry.dtype
                order = orders[owner.name]
                if owner.tensor.dim() > 1:
                    tensor = order.empty(dtype, owner.tensor.device)
                else:
                    tensor = torch.empty(owner.tensor.shape, dtype=dtype, device=owner.tensor.device)
                reads += reordered.reads_for(
                    order, start, end, in_param_space(tensor, order), functools.partial(reader.plan, entry)
                )
                state[key] = tensor
            for key, entry in record.whole_state.get(owner.name, {}).items():
                if (start, end) != (0, owner.tensor.numel()):
                    raise CheckpointError(
                        f"optimizer state '{key}' of parameter '{owner.name}' in checkpoint {manifest.directory} is a "
                        f"tensor of shape {list(entry.shape)} kept for the whole parameter, but this rank's optimizer "
                        f"updates elements [{start}, {end}) of it: load it with an optimizer that updates whole tensors "
                        "(at stages 1-3, shardpar.optimizer(..., whole_tensors=True) or a class the check finds so)"
                    )
                floating = entry.dtype.is_floating_point and owner.tensor.is_floating_point()
                tensor = torch.empty(
                    entry.shape, dtype=owner.tensor.dtype if floating else entry.dtype, device=owner.tensor.device
                )
                reads += reader.plan(entry, 0, entry.numel, tensor.view(-1))
                state[key] = tensor
            states[-1].append(state)
    return states, reads


@collective_phase("load_checkpoint")
def load_checkpoint(
    path: str | os.PathLike[str], model: ShardedModule, optimizer: ShardedOptimizer | None = None
) -> Any:
    """Load a checkpoint saved at any world size and stage; return its ``extra``.

    Every rank calls it and reads only the ranges it needs (full parameters at stages 0-2,
    its shards at stage 3, its optimizer pieces), checking each file it reads against the
    manifest's sha256 first. Any problem is a :class:`CheckpointError` raised on every rank
    (if data was already being copied when it happened, the model is partially loaded).
    A save of this process still writing is waited for first (it may be the one loaded).
    """
    finish_pending(raise_error=False)  # its error stays for the next wait(), save or exit
    engine = model.engine
    group = engine.group
    problem: BaseException | None = None
    reader: CheckpointReader | None = None
    try:
        try:
            check_optimizer(optimizer, engine)
            manifest = read_manifest(path)
            mismatch = _model_mismatch(manifest, engine)
            if mismatch is not None:
                raise CheckpointError(mismatch)
            if optimizer is not None:
                _check_optimizer_matches(manifest, optimizer)
            engine.storage.wait_for_params()
            reader = CheckpointReader(manifest)
            inventory, _ = model_tensors(engine)
            source = {
                name: manifest.tensors[name if name in manifest.tensors else manifest.aliases[name]]
                for name, _, _ in inventory
            }
            orders = engine.element_orders()
            reads: list[PieceRead] = []
            reordered = ReorderedReads()  # pieces of tensors kept in another element order
            for piece in engine.storage.load_pieces():
                reads += reordered.reads_for(
                    orders[piece.name],
                    *piece.param_range,
                    piece.tensor,
                    functools.partial(reader.plan, source[piece.name]),
                )
            staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # buffers that cannot be read into in place
            for name, kind, tensor in inventory:
                if kind == "buffer":
                    reads += reader.plan(source[name], 0, tensor.numel(), buffer_target(tensor, staged))
            new_states: list[list[dict[str, Any]]] = []
            if optimizer is not None:
                new_states, optimizer_reads = _plan_optimizer(reader, manifest, optimizer, orders, reordered)
                reads += optimizer_reads
            # Every checksum before any byte is copied.
            reader.verify_files(read.file for read in reads + reordered.reads)
        except Exception as error:
            problem = error
        agree(problem, "load_checkpoint", group)
        assert reader is not None  # agree raised on every rank if any could not plan its reads

        def read_all() -> None:
            reader.run(reads)
            reordered.run(reader.run)

        read_on_every_rank(read_all, staged, "load_checkpoint", group)
    finally:
        if reader is not None:
            reader.close()
    engine.storage.after_load()
    if optimizer is not None:
        assert manifest.optimizer is not None  # _check_optimizer_matches refused a checkpoint without one
        options = [
            {k: decode_value(v) for k, v in saved["hyperparameters"].items()}
            for saved in manifest.optimizer.param_groups
        ]
        optimizer.load_state_pieces(new_states, options)
    return manifest.extra
