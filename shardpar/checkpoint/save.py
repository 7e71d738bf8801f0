"""``save_checkpoint``: every rank writes its own pieces, in parallel, into one safetensors
file per rank; rank 0 writes the JSON manifest and makes the directory visible atomically.
What is on disk is :mod:`shardpar.checkpoint.format`; the steps are those of
docs/checkpoint-format.md, "Writing".

[Note: optimizer state in pieces]
The wrapped optimizer updates, per param group, a list of ``TensorPiece(name, tensor,
param_range)`` (``ShardedOptimizer.pieces()``; their state through ``state_of`` and
``load_state_pieces``, never the inner optimizer): whole parameters on every rank at
stage 0, this rank's pieces at stages 1-3. A state tensor of such a tensor with the same
number of elements (and at least one dimension, unless the parameter itself is 0-d) is
*elementwise* (``exp_avg``): it is stored like a parameter, each rank writing the slices
that its ``save_pieces()`` cover, so every element is written exactly once even where the
state is replicated (stage 0). Anything else (Adam's 0-d ``step``, Python numbers) is
*scalar* state: stored once per parameter in the manifest and given to every piece of that
parameter on load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.pieces import TensorPiece, is_elementwise
from ..engines import Engine
from ..errors import CheckpointError
from ..facade import ShardedModule
from ..optim import ShardedOptimizer
from .async_save import SaveHandle, Written, finish_pending, stage, start_in_background
from .dtypes import dtype_name, parse_dtype
from .files import commit_directory, make_temp_dir, remove_abandoned_temps, remove_stale_temps, sha256_file
from .format import (
    FileRecord,
    StoredItem,
    assemble_manifest,
    check_replaceable,
    piece_key,
    rank_file_name,
    write_latest,
    write_manifest,
)
from .hf_config import hf_config_of
from .io import SafetensorsWriter
from .json_values import encode_value, to_json_text
from .protocol import Agree, agree, check_optimizer, collective_phase, flat, in_param_space, model_tensors
from .reorder import MemoryPiece, to_row_major

TEST_CRASH_ENV = "SHARDPAR_CHECKPOINT_TEST_CRASH"
"""Test hook: ``"<rank>:write"`` makes that rank SIGKILL itself halfway through writing its
file; ``"0:commit"`` makes rank 0 do so after the manifest is written, before the rename.
Only the crash-safety tests set it."""


def _crash_point(rank: int, phase: str) -> None:
    if os.environ.get(TEST_CRASH_ENV) == f"{rank}:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)


def _stored_item(ref: tuple[str, ...], start: int, end: int, dtype: torch.dtype) -> StoredItem:
    return StoredItem(ref, piece_key(ref, start, end), start, end, dtype_name(dtype))


def _items_to_write(
    engine: Engine, optimizer: ShardedOptimizer | None
) -> tuple[list[Written], list[MemoryPiece], dict[str, dict[str, Any]], list[list[str]], WholeShapes]:
    """What this rank writes: ``(item, 1-D tensor)`` pairs; the pieces of tensors kept in
    another element order, which :func:`_row_major_items` turns into items (ranges in memory
    order, see [Note: reordered pieces] in reorder.py); the scalar optimizer state it knows;
    the parameter names of each param group it holds; the shapes of the whole state it writes
    (see ``OptimizerRecord.whole_state``)."""
    items: list[Written] = []
    reordered: list[MemoryPiece] = []
    orders = engine.element_orders()

    def add(ref: tuple[str, ...], tensor: torch.Tensor, start: int, end: int) -> None:
        if orders[ref[1]].reorders:
            reordered.append(MemoryPiece(ref, start, end, tensor))
        else:
            items.append((_stored_item(ref, start, end, tensor.dtype), tensor))

    saved: dict[str, list[TensorPiece]] = defaultdict(list)
    for piece in engine.save_pieces():
        saved[piece.name].append(piece)
        add(("model", piece.name), piece.tensor, *piece.param_range)
    if engine.rank == 0:
        for name, kind, tensor in model_tensors(engine)[0]:
            if kind == "buffer":
                items.append((_stored_item(("model", name), 0, tensor.numel(), tensor.dtype), flat(tensor)))

    scalar: dict[str, dict[str, Any]] = {}
    group_names: list[list[str]] = []
    whole_shapes: WholeShapes = {}
    if optimizer is not None:
        for tensors in optimizer.pieces():
            group_names.append([t.name for t in tensors])
            for owner in tensors:
                for key, value in optimizer.state_of(owner).items():
                    where = f"optimizer state '{key}' of parameter '{owner.name}'"
                    if _kept_whole(key, value, owner, engine, optimizer):
                        if engine.stage > 0 or engine.rank == 0:  # its owner; at stage 0 every rank holds it
                            ref = ("whole_state", owner.name, key)
                            items.append((_stored_item(ref, 0, value.numel(), value.dtype), flat(value.contiguous())))
                            whole_shapes.setdefault(owner.name, {})[key] = list(value.shape)
                        continue
                    if not is_elementwise(key, value, owner.tensor):
                        scalar.setdefault(owner.name, {})[key] = encode_value(value, where)
                        continue
                    values = in_param_space(value, orders[owner.name])
                    offset, owner_end = owner.param_range
                    for piece in saved[owner.name]:  # the slices this rank writes of the parameter
                        start, end = max(piece.param_range[0], offset), min(piece.param_range[1], owner_end)
                        if start < end:
                            add(("state", owner.name, key), values[start - offset : end - offset], start, end)
    return items, reordered, scalar, group_names, whole_shapes


WholeShapes = dict[str, dict[str, list[int]]]
"""Parameter name -> state key -> shape of a state tensor kept whole."""


def _kept_whole(key: str, value: Any, owner: TensorPiece, engine: Engine, optimizer: ShardedOptimizer) -> bool:
    """Whether a state value is a tensor of another shape than its parameter's (Adafactor's
    ``row_var``, Shampoo's preconditioners) held for the whole parameter, where the whole
    parameter is updated on one rank (stages 1-3, whole-tensor ownership) or on every rank
    (stage 0): stored whole, as it is ([Note: optimizer state in pieces])."""
    if not isinstance(value, torch.Tensor) or value.dim() == 0 or is_elementwise(key, value, owner.tensor):
        return False
    whole_piece = owner.param_range == (0, owner.tensor.numel())
    return whole_piece and (engine.stage == 0 or optimizer.whole_tensors)


def _held(pieces: list[MemoryPiece]) -> list[tuple[tuple[str, ...], int, int]]:
    """What every rank must know of this rank's reordered pieces to plan the transfers."""
    return [(p.ref, p.start, p.end) for p in pieces]


def _row_major_items(pieces: list[MemoryPiece], held: list[Any], engine: Engine) -> list[Written]:
    """The items this rank writes of reordered tensors (a collective; see [Note: reordered
    pieces]): values made when written, one piece at a time."""
    return [
        (_stored_item(p.ref, p.start, p.end, p.dtype), p.values)
        for p in to_row_major(pieces, held, engine.element_orders(), engine.rank, engine.group)
    ]


def _write_rank_file(path: Path, items: list[Written], rank: int, world_size: int) -> FileRecord:
    writer = SafetensorsWriter(
        path,
        [(item.key, parse_dtype(item.dtype), (item.end - item.start,)) for item, _ in items],
        {"shardpar_format": "1", "rank": str(rank), "world_size": str(world_size)},
    )
    try:
        for index, (_, tensor) in enumerate(items):
            if index == len(items) // 2:
                _crash_point(rank, "write")
            writer.write(tensor() if callable(tensor) else tensor)
        size, digest = writer.close()
    except BaseException:
        writer.abort()
        raise
    return FileRecord(path.name, size, digest, rank)


def _hyperparameters(optimizer: ShardedOptimizer) -> list[dict[str, Any]]:
    """Every param group's options but ``params``, as JSON (TypeError if one is not)."""
    return [
        {k: encode_value(v, f"param group {index} option '{k}'") for k, v in group.items()}
        for index, group in enumerate(optimizer.group_options())
    ]


@dataclass
class _ManifestInputs:
    """What rank 0 puts in the manifest besides the ranks' reports, taken at the call: an
    asynchronous save assembles the manifest later, while training goes on."""

    stage: int
    world_size: int
    model: list[tuple[str, str, str, list[int]]]  # (name, kind, dtype, shape) in state-dict order
    aliases: dict[str, str]
    optimizer_class: str | None
    hyperparameters: list[dict[str, Any]] | None
    order: list[str]  # parameter names, in the order the manifest lists them
    extra: Any
    layout: Any  # the bucket or unit layout, for information only: loading never needs it
    hf_config: dict[str, dict[str, Any]] | None

    @classmethod
    def of(
        cls,
        model: ShardedModule,
        optimizer: ShardedOptimizer | None,
        hyperparameters: list[dict[str, Any]] | None,
        extra: Any,
    ) -> _ManifestInputs:
        engine = model.engine
        inventory, aliases = model_tensors(engine)
        return cls(
            engine.stage,
            engine.world_size,
            [(n, kind, dtype_name(t.dtype), list(t.shape)) for n, kind, t in inventory],
            aliases,
            None if optimizer is None else optimizer.class_name,
            hyperparameters,
            [n for n, _ in engine.named_params],
            extra,
            engine.storage.layout_summary(),
            hf_config_of(model.module),
        )

    def optimizer_section(self, reports: list[_RankReport]) -> dict[str, Any] | None:
        """The manifest's ``optimizer`` object (elementwise state is added from the pieces)."""
        if self.optimizer_class is None:
            return None
        assert self.hyperparameters is not None  # taken with the class, from the same optimizer
        position = {name: i for i, name in enumerate(self.order)}
        groups = []
        for index, hyper in enumerate(self.hyperparameters):  # a rank lists only the names it holds pieces of
            names = sorted({n for report in reports for n in report.group_names[index]}, key=position.__getitem__)
            groups.append({"params": names, "hyperparameters": hyper})
        scalar: dict[str, dict[str, Any]] = {}
        whole_shapes: WholeShapes = {}
        for report in reports:  # lowest rank first; equal on every rank holding a piece
            for name, values in report.scalar_state.items():
                scalar.setdefault(name, values)
            for name, shapes in report.whole_shapes.items():
                whole_shapes.setdefault(name, shapes)
        return {
            "class": self.optimizer_class,
            "param_groups": groups,
            "scalar_state": {n: scalar[n] for n in sorted(scalar, key=position.__getitem__)},
            **({"whole_state_shapes": whole_shapes} if whole_shapes else {}),
        }


@dataclass
class _RankReport:
    """What one rank tells rank 0 after writing its file (as JSON: an asynchronous save
    sends it through the store)."""

    file: FileRecord
    items: list[StoredItem]
    scalar_state: dict[str, dict[str, Any]]
    group_names: list[list[str]]
    whole_shapes: WholeShapes

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> _RankReport:
        items = [StoredItem(**{**item, "ref": tuple(item["ref"])}) for item in raw["items"]]
        return cls(FileRecord(**raw["file"]), items, raw["scalar_state"], raw["group_names"], raw["whole_shapes"])


@dataclass
class _SavePlan:
    """One save after its first phase: where it writes, and this rank's items."""

    target: Path
    tmp: Path
    rank: int
    world_size: int
    items: list[Written]
    scalar_state: dict[str, dict[str, Any]]
    group_names: list[list[str]]
    whole_shapes: WholeShapes
    manifest: _ManifestInputs | None
    """Rank 0's (None elsewhere): rank 0 also owns the temporary directory."""

    def discard(self) -> None:
        """A failed save leaves nothing behind (rank 0 removes the temporary directory)."""
        if self.manifest is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def save_checkpoint(
    path: str | os.PathLike[str],
    model: ShardedModule,
    optimizer: ShardedOptimizer | None = None,
    extra: Any = None,
    *,
    async_save: bool = False,
) -> SaveHandle:
    """Save the model (and optimizer) into the directory ``path``, every rank in parallel.

    Every rank calls it. Each writes ``rank-0000r-of-0000N.safetensors`` with its pieces;
    rank 0 verifies the files and writes ``shardpar.json`` (``extra`` must be JSON; a
    Hugging Face model's config goes in too, for exports); the directory appears atomically
    (replacing an existing checkpoint only once complete) and ``<parent>/latest`` names it.
    The steps are those of docs/checkpoint-format.md, "Writing". Rank 0 first removes
    abandoned temporaries of other checkpoints in the parent: [Note: sweeping temporaries]
    in :mod:`.files`.

    Returns a handle (``wait()``, ``done()``). Synchronous (the default): on every rank once
    the checkpoint is visible; the handle is done. ``async_save=True``: once every rank has
    copied what it writes into host memory; the files are written, verified and committed
    in the background while training goes on, every guarantee kept ([Note: asynchronous
    saves] in :mod:`.async_save`); ``handle.wait()`` returns once the checkpoint is visible
    or raises its error, on every rank. A save started while one of this process is still
    writing waits for it first, and raises its error if nothing did yet.
    """
    finish_pending()
    return _save(path, model, optimizer, extra, async_save)


@collective_phase("save_checkpoint")
def _save(
    path: str | os.PathLike[str], model: ShardedModule, optimizer: ShardedOptimizer | None, extra: Any, async_save: bool
) -> SaveHandle:
    engine = model.engine
    plan = _prepare(Path(path).absolute(), model, optimizer, extra)
    if not async_save:

        def agree_in_group(problem: BaseException | None, what: str, payload: Any = None) -> list[Any]:
            return agree(problem, what, engine.group, payload)

        _write_and_commit(plan, agree_in_group)
        return SaveHandle.finished(plan.target)
    problem: BaseException | None = None
    try:
        plan.items = stage(plan.items, engine.device)
    except Exception as error:  # out of (pinned) memory, say: no rank starts the background alone
        problem = error
    try:
        agree(problem, "save_checkpoint (copying to host memory)", engine.group)
    except Exception:
        plan.discard()
        raise
    return start_in_background(
        plan.target,
        engine.rank,
        engine.world_size,
        engine.config.timeout_s,
        f"shardpar/async-save/{plan.tmp.name}",
        lambda agree_: _write_and_commit(plan, agree_),
    )


def _prepare(target: Path, model: ShardedModule, optimizer: ShardedOptimizer | None, extra: Any) -> _SavePlan:
    """The save's first phase, on every rank in the call: check the arguments, list what this
    rank writes, let rank 0 make the temporary directory, agree, and move the pieces of
    reordered tensors to their writers (collectives of the model's group)."""
    engine = model.engine
    rank, world_size, group = engine.rank, engine.world_size, engine.group
    problem: BaseException | None = None
    tmp_name = None
    inputs = None
    items: list[Written] = []
    reordered: list[MemoryPiece] = []
    scalar: dict[str, dict[str, Any]] = {}
    group_names: list[list[str]] = []
    whole_shapes: WholeShapes = {}
    try:
        check_optimizer(optimizer, engine)
        extra = json.loads(to_json_text(extra, "extra"))  # a copy: the script may change its own
        hyperparameters = None if optimizer is None else _hyperparameters(optimizer)
        engine.storage.wait_for_params()
        with torch.no_grad():
            items, reordered, scalar, group_names, whole_shapes = _items_to_write(engine, optimizer)
        if rank == 0:
            inputs = _ManifestInputs.of(model, optimizer, hyperparameters, extra)
            check_replaceable(target)
            remove_stale_temps(target)
            remove_abandoned_temps(target.parent)
            tmp_name = make_temp_dir(target).name
    except Exception as error:
        problem = error
    try:
        agreed = agree(problem, "save_checkpoint", group, (tmp_name, _held(reordered)))
        items += _row_major_items(reordered, [held for _, held in agreed], engine)
    except Exception:
        if tmp_name is not None:  # rank 0: a failed save leaves nothing behind
            shutil.rmtree(target.parent / tmp_name, ignore_errors=True)
        raise
    return _SavePlan(
        target, target.parent / agreed[0][0], rank, world_size, items, scalar, group_names, whole_shapes, inputs
    )


def _write_and_commit(plan: _SavePlan, agree_: Agree) -> None:
    """The rest of a save, over any channel ``agree_`` (the model's group in the call, the
    store in the background): every rank writes its file, the ranks verify each other's,
    rank 0 writes the manifest and commits. Any rank's failure raises on every rank."""
    rank = plan.rank
    problem: BaseException | None = None
    try:
        try:
            record = _write_rank_file(
                plan.tmp / rank_file_name(rank, plan.world_size), plan.items, rank, plan.world_size
            )
            report = _RankReport(
                record, [item for item, _ in plan.items], plan.scalar_state, plan.group_names, plan.whole_shapes
            )
        except Exception as error:
            problem, report = error, None
        reports = [
            _RankReport.from_json(r)
            for r in agree_(problem, "save_checkpoint (writing files)", report and report.to_json())
        ]

        try:
            _verify_written(plan.tmp, reports, rank)
        except Exception as error:
            problem = error
        agree_(problem, "save_checkpoint (verifying files)", None)

        try:
            if plan.manifest is not None:
                _commit(plan, reports)
        except Exception as error:
            problem = error
        agree_(problem, "save_checkpoint (commit)", None)
    except Exception:
        plan.discard()
        raise


def _commit(plan: _SavePlan, reports: list[_RankReport]) -> None:
    """Rank 0: the manifest, then the one rename that makes the checkpoint visible, then ``latest``."""
    inputs = plan.manifest
    assert inputs is not None  # only rank 0 commits, and it holds the manifest's inputs
    manifest = assemble_manifest(
        stage=inputs.stage,
        world_size=inputs.world_size,
        model=inputs.model,
        aliases=inputs.aliases,
        files=[r.file for r in reports],
        items={r.file.name: r.items for r in reports},
        optimizer=inputs.optimizer_section(reports),
        extra=inputs.extra,
        layout=inputs.layout,
        hf_config=inputs.hf_config,
    )
    write_manifest(plan.tmp, manifest)
    _crash_point(plan.rank, "commit")
    commit_directory(plan.tmp, plan.target)
    write_latest(plan.target)


def _verify_written(tmp: Path, reports: list[_RankReport], rank: int) -> None:
    """Rank r re-reads the file of rank r+1 (in parallel; on a shared file system also a check
    that another node sees the bytes); rank 0 checks that every file exists with its size."""
    other = reports[(rank + 1) % len(reports)].file
    digest, size = sha256_file(tmp / other.name)
    if (digest, size) != (other.sha256, other.bytes):
        raise CheckpointError(
            f"{tmp / other.name} reads back as {size} bytes, sha256 {digest}; rank "
            f"{other.rank} wrote {other.bytes} bytes, sha256 {other.sha256}"
        )
    if rank == 0:
        for report in reports:
            file = tmp / report.file.name
            if not file.is_file() or file.stat().st_size != report.file.bytes:
                raise CheckpointError(f"{file} is missing or has the wrong size after the save")
