"""Sharded checkpoints: every rank saves and loads its own pieces, in parallel.

``save_checkpoint`` writes one safetensors file per rank plus a JSON manifest and makes the
directory visible atomically; ``load_checkpoint`` reads, on each rank, exactly the ranges
that rank needs, whatever world size and stage the checkpoint was written at;
``save_full`` writes the Hugging Face layout from rank 0, one tensor at a time. What is
on disk is :mod:`shardpar.checkpoint.format`; reading and writing files is
:mod:`shardpar.checkpoint.io`.

[Note: every rank agrees before it moves on]
A rank that fails alone (a full disk, a corrupted file only it reads) must not leave the
others waiting in the next collective. Each phase therefore ends in :func:`_agree`: one
all-gather of every rank's verdict, after which *every* rank raises (the failing rank its
own exception, the others a CheckpointError naming that rank) or every rank goes on.

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

import functools
import os
import shutil
import signal
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..comm import collectives as C
from ..comm import watch
from .format import (
    CheckpointReader,
    FileRecord,
    Manifest,
    StoredItem,
    assemble_manifest,
    check_replaceable,
    decode_value,
    encode_value,
    latest_checkpoint,
    piece_key,
    rank_file_name,
    read_manifest,
    to_json_text,
    write_latest,
    write_manifest,
)
from .io import (
    CHUNK_BYTES,
    HFLayoutWriter,
    SafetensorsWriter,
    commit_directory,
    dtype_name,
    make_temp_dir,
    parse_dtype,
    remove_abandoned_temps,
    remove_stale_temps,
    sha256_file,
)
from ..sizes import parse_bytes
from .hf_config import config_files, floating_dtype, hf_config_of
from .reorder import MemoryPiece, ReorderedReads, row_major_range, to_row_major
from ..core.element_order import ElementOrder
from ..core.pieces import TensorPiece, is_elementwise
from ..engines import Engine
from ..errors import CheckpointError
from ..module import ShardedModule, sharded_module_of
from ..optim import ShardedOptimizer

__all__ = ["save_checkpoint", "load_checkpoint", "save_full", "latest_checkpoint"]

TEST_CRASH_ENV = "SHARDPAR_CHECKPOINT_TEST_CRASH"
"""Test hook: ``"<rank>:write"`` makes that rank SIGKILL itself halfway through writing its
file; ``"0:commit"`` makes rank 0 do so after the manifest is written, before the rename.
Only the crash-safety tests set it."""


# --------------------------------------------------------------------------- agreement


def _agree(problem: BaseException | None, what: str, group: Any, payload: Any = None) -> list[Any]:
    """See [Note: every rank agrees before it moves on]. Returns every rank's payload."""
    verdict = None if problem is None else (type(problem).__name__, str(problem))
    gathered = C.all_gather_objects((verdict, payload), group=group)
    for rank, (other, _) in enumerate(gathered):
        if other is not None:
            if problem is not None:
                raise problem
            kind = {"TypeError": TypeError, "ValueError": ValueError}.get(other[0], CheckpointError)
            raise kind(f"{what} failed on rank {rank}: {other[1]}")
    return [p for _, p in gathered]


def buffer_target(tensor: torch.Tensor, staged: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Where a buffer's values are read to: the buffer itself, or (not contiguous) a stand-in
    recorded in ``staged`` and copied back by :func:`read_on_every_rank`."""
    if tensor.is_contiguous():
        return tensor.data.view(-1)
    target = torch.empty(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    staged.append((tensor, target))
    return target


def read_on_every_rank(run_reads: Callable[[], None], staged: list[tuple[torch.Tensor, torch.Tensor]], what: str,
                       group: Any) -> None:
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
    _agree(problem, f"{what} (reading)", group)


def _crash_point(rank: int, phase: str) -> None:
    if os.environ.get(TEST_CRASH_ENV) == f"{rank}:{phase}":
        os.kill(os.getpid(), signal.SIGKILL)


def _check_optimizer(optimizer: Any, engine: Engine) -> None:
    if optimizer is not None and (not isinstance(optimizer, ShardedOptimizer) or optimizer.engine is not engine):
        raise TypeError("optimizer must be the shardpar.optimizer(...) built over this model")


# --------------------------------------------------------------------------- model inventory


def _model_tensors(engine: Engine) -> tuple[list[tuple[str, str, torch.Tensor]], dict[str, str]]:
    """``(name, kind, tensor)`` for every state-dict entry except aliases, in state-dict order,
    and ``alias -> canonical name`` (tied parameters, and buffers registered twice)."""
    aliases = dict(engine.aliases)
    params = dict(engine.named_params)
    out: list[tuple[str, str, torch.Tensor]] = []
    seen: dict[int, str] = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
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


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().contiguous().view(-1)


# --------------------------------------------------------------------------- save


Written = tuple[StoredItem, "torch.Tensor | Callable[[], torch.Tensor]"]
"""An item and its values (1-D), or what makes them when the file is written (reordered pieces)."""


def _stored_item(ref: tuple[str, ...], start: int, end: int, dtype: torch.dtype) -> StoredItem:
    return StoredItem(ref, piece_key(ref, start, end), start, end, dtype_name(dtype))


def _in_param_space(value: torch.Tensor, order: ElementOrder) -> torch.Tensor:
    """An elementwise optimizer state as 1-D in param space: a piece's (1-D) as it is, a
    whole parameter's (stage 0) in the parameter's memory order."""
    return order.flatten(value.detach()) if value.dim() > 1 else _flat(value)


def _items_to_write(
    engine: Engine, optimizer: ShardedOptimizer | None
) -> tuple[list[Written], list[MemoryPiece], dict[str, dict[str, Any]], list[list[str]]]:
    """What this rank writes: ``(item, 1-D tensor)`` pairs; the pieces of tensors kept in
    another element order, which :func:`_row_major_items` turns into items (ranges in memory
    order, see [Note: reordered pieces] in reorder.py); the scalar optimizer state it knows;
    the parameter names of each param group it holds."""
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
        for name, kind, tensor in _model_tensors(engine)[0]:
            if kind == "buffer":
                items.append((_stored_item(("model", name), 0, tensor.numel(), tensor.dtype), _flat(tensor)))

    scalar: dict[str, dict[str, Any]] = {}
    group_names: list[list[str]] = []
    if optimizer is not None:
        for index, tensors in enumerate(optimizer.pieces()):
            group_names.append([t.name for t in tensors])
            for owner in tensors:
                for key, value in optimizer.state_of(owner).items():
                    where = f"optimizer state '{key}' of parameter '{owner.name}'"
                    if not is_elementwise(key, value, owner.tensor):
                        scalar.setdefault(owner.name, {})[key] = encode_value(value, where)
                        continue
                    flat = _in_param_space(value, orders[owner.name])
                    offset, owner_end = owner.param_range
                    for piece in saved[owner.name]:  # the slices this rank writes of the parameter
                        start, end = max(piece.param_range[0], offset), min(piece.param_range[1], owner_end)
                        if start < end:
                            add(("state", owner.name, key), flat[start - offset : end - offset], start, end)
    return items, reordered, scalar, group_names


def _held(pieces: list[MemoryPiece]) -> list[tuple[tuple[str, ...], int, int]]:
    """What every rank must know of this rank's reordered pieces to plan the transfers."""
    return [(p.ref, p.start, p.end) for p in pieces]


def _row_major_items(pieces: list[MemoryPiece], held: list[Any], engine: Engine) -> list[Written]:
    """The items this rank writes of reordered tensors (a collective; see [Note: reordered
    pieces]): values made when written, one piece at a time."""
    return [(_stored_item(p.ref, p.start, p.end, p.dtype), p.values)
            for p in to_row_major(pieces, held, engine.element_orders(), engine.rank, engine.group)]


def _write_rank_file(path: Path, items: list[Written], rank: int, world_size: int) -> FileRecord:
    writer = SafetensorsWriter(
        path, [(item.key, parse_dtype(item.dtype), (item.end - item.start,)) for item, _ in items],
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
    return [{k: encode_value(v, f"param group {index} option '{k}'") for k, v in group.items()}
            for index, group in enumerate(optimizer.group_options())]


def _optimizer_section(optimizer: ShardedOptimizer, hyperparameters: list[dict[str, Any]], reports: list[tuple],
                       order: list[str]) -> dict[str, Any]:
    """The manifest's ``optimizer`` object (elementwise state is added from the pieces)."""
    position = {name: i for i, name in enumerate(order)}
    groups = []
    for index, hyper in enumerate(hyperparameters):  # a rank lists only the names it holds pieces of
        names = sorted({n for report in reports for n in report.group_names[index]}, key=position.__getitem__)
        groups.append({"params": names, "hyperparameters": hyper})
    scalar: dict[str, dict[str, Any]] = {}
    for report in reports:  # lowest rank first; equal on every rank holding a piece
        for name, values in report.scalar_state.items():
            scalar.setdefault(name, values)
    return {"class": optimizer.class_name, "param_groups": groups,
            "scalar_state": {n: scalar[n] for n in sorted(scalar, key=position.__getitem__)}}


def _layout(engine: Engine) -> Any:
    """The engine's bucket (stages 0-2) or unit (stage 3) layout, for information only:
    loading never needs it, the pieces say where everything is."""
    return engine.layout_summary()


@dataclass
class _RankReport:
    """What one rank tells rank 0 after writing its file."""

    file: FileRecord
    items: list[StoredItem]
    scalar_state: dict[str, dict[str, Any]]
    group_names: list[list[str]]


def _collective_phase(name: str) -> Callable:
    """Run a checkpoint function as a phase every rank enters together: the ranks first meet
    through the store, so a call on some ranks only is named instead of pairing its
    collectives with training's (see [Note: ranks out of step] in shardpar.comm.watch)."""
    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(path: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            model = sharded_module_of(model, f"shardpar.{name}")  # or a torch.compile wrapper of it
            group = model.engine.group
            with watch.operation(name):
                watch.meet(group, name)
                return fn(path, model, *args, **kwargs)
        return run
    return decorate


@_collective_phase("save_checkpoint")
def save_checkpoint(path: str | os.PathLike[str], model: ShardedModule, optimizer: ShardedOptimizer | None = None,
                    extra: Any = None) -> None:
    """Save the model (and optimizer) into the directory ``path``, every rank in parallel.

    Every rank calls it. Each writes ``rank-0000r-of-0000N.safetensors`` with its pieces;
    rank 0 verifies the files and writes ``shardpar.json`` (``extra`` must be JSON; a
    Hugging Face model's config goes in too, for exports); the directory appears atomically
    (replacing an existing checkpoint only once complete) and ``<parent>/latest`` names it.
    Returns on every rank once it is visible. The steps are those of
    docs/checkpoint-format.md, "Writing". Rank 0 first removes abandoned temporaries of other
    checkpoints in the parent: [Note: sweeping temporaries] in :mod:`.io`.
    """
    engine = model.engine
    rank, world_size, group = engine.rank, engine.world_size, engine.group
    target = Path(path).absolute()
    problem: BaseException | None = None
    tmp_name = None
    hf_config = None
    reordered: list[MemoryPiece] = []
    try:
        _check_optimizer(optimizer, engine)
        to_json_text(extra, "extra")
        hyperparameters = None if optimizer is None else _hyperparameters(optimizer)
        engine.wait_for_params()
        with torch.no_grad():
            items, reordered, scalar, group_names = _items_to_write(engine, optimizer)
        if rank == 0:
            hf_config = hf_config_of(model.module)
            check_replaceable(target)
            remove_stale_temps(target)
            remove_abandoned_temps(target.parent)
            tmp = make_temp_dir(target)
            tmp_name = tmp.name
    except Exception as error:
        problem = error
    try:
        agreed = _agree(problem, "save_checkpoint", group, (tmp_name, _held(reordered)))
        tmp = target.parent / agreed[0][0]

        items += _row_major_items(reordered, [held for _, held in agreed], engine)
        try:
            record = _write_rank_file(tmp / rank_file_name(rank, world_size), items, rank, world_size)
            report = _RankReport(record, [item for item, _ in items], scalar, group_names)
        except Exception as error:
            problem, report = error, None
        reports = _agree(problem, "save_checkpoint (writing files)", group, report)

        try:
            _verify_written(tmp, reports, rank)
        except Exception as error:
            problem = error
        _agree(problem, "save_checkpoint (verifying files)", group)

        try:
            if rank == 0:
                model_tensors, aliases = _model_tensors(engine)
                manifest = assemble_manifest(
                    stage=engine.stage, world_size=world_size,
                    model=[(n, kind, dtype_name(t.dtype), list(t.shape)) for n, kind, t in model_tensors],
                    aliases=aliases, files=[r.file for r in reports], items={r.file.name: r.items for r in reports},
                    optimizer=None if optimizer is None else _optimizer_section(
                        optimizer, hyperparameters, reports, [n for n, _ in engine.named_params]),
                    extra=extra, layout=_layout(engine), hf_config=hf_config,
                )
                write_manifest(tmp, manifest)
                _crash_point(rank, "commit")
                commit_directory(tmp, target)
                write_latest(target)
        except Exception as error:
            problem = error
        _agree(problem, "save_checkpoint (commit)", group)
    except Exception:
        if tmp_name is not None:  # rank 0: a failed save leaves nothing behind
            shutil.rmtree(target.parent / tmp_name, ignore_errors=True)
        raise


def _verify_written(tmp: Path, reports: list[_RankReport], rank: int) -> None:
    """Rank r re-reads the file of rank r+1 (in parallel; on a shared file system also a check
    that another node sees the bytes); rank 0 checks that every file exists with its size."""
    other = reports[(rank + 1) % len(reports)].file
    digest, size = sha256_file(tmp / other.name)
    if (digest, size) != (other.sha256, other.bytes):
        raise CheckpointError(f"{tmp / other.name} reads back as {size} bytes, sha256 {digest}; rank "
                              f"{other.rank} wrote {other.bytes} bytes, sha256 {other.sha256}")
    if rank == 0:
        for report in reports:
            file = tmp / report.file.name
            if not file.is_file() or file.stat().st_size != report.file.bytes:
                raise CheckpointError(f"{file} is missing or has the wrong size after the save")


# --------------------------------------------------------------------------- load


def _model_mismatch(manifest: Manifest, engine: Engine) -> str | None:
    """Differences between the checkpoint's and the model's tensor names and shapes."""
    model_tensors, _ = _model_tensors(engine)
    stored = manifest.tensors
    missing, unexpected, shapes = [], [], []
    wanted = set()
    for name, kind, tensor in model_tensors:
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
    parts = [f"{label}: {', '.join(names)}" for label, names in
             (("missing in checkpoint", missing), ("unexpected in checkpoint", unexpected), ("shape mismatch", shapes))
             if names]
    return f"checkpoint {manifest.directory} does not match the model: " + "; ".join(parts)


def _check_optimizer_matches(manifest: Manifest, optimizer: ShardedOptimizer) -> None:
    record = manifest.optimizer
    if record is None:
        raise CheckpointError(f"checkpoint {manifest.directory} has no optimizer state (saved without an optimizer)")
    expected = optimizer.class_name
    if record.class_name != expected:
        raise CheckpointError(f"checkpoint {manifest.directory} holds state of optimizer {record.class_name}, "
                              f"not of {expected}")
    if len(record.param_groups) != len(optimizer.pieces()):
        raise CheckpointError(f"checkpoint {manifest.directory} has {len(record.param_groups)} optimizer param "
                              f"groups, the optimizer {len(optimizer.pieces())}")
    group_of = {n: i for i, g in enumerate(record.param_groups) for n in g["params"]}
    for index, tensors in enumerate(optimizer.pieces()):
        for piece in tensors:
            if group_of.get(piece.name, index) != index:
                raise CheckpointError(f"parameter '{piece.name}' is in optimizer param group {index}, but in group "
                                      f"{group_of[piece.name]} in checkpoint {manifest.directory}")


def _state_device(group: dict[str, Any], owner: torch.Tensor) -> torch.device:
    """torch keeps ``step`` on the CPU unless the optimizer is capturable or fused."""
    return owner.device if group.get("capturable") or group.get("fused") else torch.device("cpu")


def _plan_optimizer(reader: CheckpointReader, manifest: Manifest, optimizer: ShardedOptimizer,
                    orders: dict[str, ElementOrder], reordered: ReorderedReads):
    """Fresh state for every piece this rank's optimizer updates (``states[g][i]`` for
    ``optimizer.pieces()[g][i]``), and the reads that fill its tensors (those of reordered
    tensors go to ``reordered``). State of a whole parameter (stage 0) has its strides, as
    torch's ``zeros_like(param)`` gives."""
    record = manifest.optimizer
    states: list[list[dict[str, Any]]] = []
    reads = []
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
                reads += reordered.reads_for(order, start, end, _in_param_space(tensor, order),
                                             functools.partial(reader.plan, entry))
                state[key] = tensor
            states[-1].append(state)
    return states, reads


@_collective_phase("load_checkpoint")
def load_checkpoint(path: str | os.PathLike[str], model: ShardedModule,
                    optimizer: ShardedOptimizer | None = None) -> Any:
    """Load a checkpoint saved at any world size and stage; return its ``extra``.

    Every rank calls it and reads only the ranges it needs (full parameters at stages 0-2,
    its shards at stage 3, its optimizer pieces), checking each file it reads against the
    manifest's sha256 first. Any problem is a :class:`CheckpointError` raised on every rank
    (if data was already being copied when it happened, the model is partially loaded).
    """
    engine = model.engine
    group = engine.group
    problem: BaseException | None = None
    reader: CheckpointReader | None = None
    try:
        try:
            _check_optimizer(optimizer, engine)
            manifest = read_manifest(path)
            mismatch = _model_mismatch(manifest, engine)
            if mismatch is not None:
                raise CheckpointError(mismatch)
            if optimizer is not None:
                _check_optimizer_matches(manifest, optimizer)
            engine.wait_for_params()
            reader = CheckpointReader(manifest)
            model_tensors, _ = _model_tensors(engine)
            source = {name: manifest.tensors[name if name in manifest.tensors else manifest.aliases[name]]
                      for name, _, _ in model_tensors}
            orders = engine.element_orders()
            reads = []
            reordered = ReorderedReads()  # pieces of tensors kept in another element order
            for piece in engine.load_pieces():
                reads += reordered.reads_for(orders[piece.name], *piece.param_range, piece.tensor,
                                             functools.partial(reader.plan, source[piece.name]))
            staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # buffers that cannot be read into in place
            for name, kind, tensor in model_tensors:
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
        _agree(problem, "load_checkpoint", group)
        read_on_every_rank(lambda: (reader.run(reads), reordered.run(reader.run)), staged, "load_checkpoint", group)
    finally:
        if reader is not None:
            reader.close()
    engine.after_load()
    if optimizer is not None:
        options = [{k: decode_value(v) for k, v in saved["hyperparameters"].items()}
                   for saved in manifest.optimizer.param_groups]
        optimizer.load_state_pieces(new_states, options)
    return manifest.extra


# --------------------------------------------------------------------------- full export


def _resolve_dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return parse_dtype(dtype)
    except CheckpointError as error:
        raise ValueError(str(error)) from None


def _chunk_ranges(start: int, end: int, element_size: int) -> Iterator[tuple[int, int]]:
    step = max(1, CHUNK_BYTES // element_size)
    for first in range(start, end, step):
        yield first, min(end, first + step)


@_collective_phase("save_full")
def save_full(path: str | os.PathLike[str], model: ShardedModule, max_shard_size: int | str = "5GB",
              dtype: torch.dtype | str | None = None) -> list[str]:
    """Write the whole model in the Hugging Face layout into the directory ``path``.

    Every rank calls it; rank 0 writes ``model.safetensors`` (or numbered shards plus
    ``model.safetensors.index.json``). Parameters come from the ranks' checkpoint pieces
    (master copies), sent to rank 0 piece by piece in chunks of at most
    :data:`~shardpar.checkpoint.io.CHUNK_BYTES`, so no rank ever holds more than its shard
    plus one chunk; tied weights are written once, under their first name. ``dtype`` casts
    floating-point tensors. A Hugging Face model (``model.module`` has a ``config``) gets its
    ``config.json`` and ``generation_config.json`` beside the weights. The directory appears
    whole or not at all. Returns the model files written (on every rank).
    """
    engine = model.engine
    rank, group = engine.rank, engine.group
    out_dir = Path(path).absolute()
    problem: BaseException | None = None
    mine: list[tuple[str, int, int, str]] = []
    try:
        max_bytes = parse_bytes(max_shard_size, "max_shard_size")
        out_dtype = _resolve_dtype(dtype)
        engine.wait_for_params()
        local = {(p.name, *p.param_range): p.tensor for p in engine.save_pieces()}
        mine = [(name, start, end, dtype_name(t.dtype)) for (name, start, end), t in local.items()]
    except Exception as error:
        problem = error
    everyone = _agree(problem, "save_full", group, mine)

    # Pieces of tensors kept in another element order become the row-major ranges their ranks
    # write ([Note: reordered pieces] in reorder.py): the same plan on every rank.
    orders = engine.element_orders()
    reordered = [MemoryPiece(("model", name), start, end, local.pop((name, start, end)))
                 for name, start, end, _ in mine if orders[name].reorders]
    held = [[(("model", name), start, end) for name, start, end, _ in listed if orders[name].reorders]
            for listed in everyone]
    for piece in to_row_major(reordered, held, orders, rank, group):
        local[(piece.ref[1], piece.start, piece.end)] = piece.values

    model_tensors, _ = _model_tensors(engine)
    pieces: dict[str, list[tuple[int, int, int, torch.dtype]]] = defaultdict(list)  # name -> (start, end, owner, dtype)
    for owner, listed in enumerate(everyone):
        for name, start, end, stored in listed:
            if orders[name].reorders:
                start, end = row_major_range(orders[name], start, end)
            if start < end:
                pieces[name].append((start, end, owner, parse_dtype(stored)))
    for listed in pieces.values():
        listed.sort()

    def stored_dtype(name: str, tensor: torch.Tensor) -> torch.dtype:
        return pieces[name][0][3] if pieces.get(name) else tensor.dtype

    def output_dtype(name: str, tensor: torch.Tensor) -> torch.dtype:
        native = stored_dtype(name, tensor)
        return out_dtype if out_dtype is not None and native.is_floating_point else native

    writer = None
    if rank == 0:
        try:
            entries = [(n, output_dtype(n, t), tuple(t.shape)) for n, _, t in model_tensors]
            json_files = config_files(hf_config_of(model.module), floating_dtype([d for _, d, _ in entries]))
            writer = HFLayoutWriter(out_dir, entries, max_bytes, json_files)
        except Exception as error:
            problem = error
    # Rank 0 keeps receiving after a write error so no sender is left blocked (the verdict
    # follows in the final agreement).
    with torch.no_grad():
        for name, kind, tensor in model_tensors:
            if kind == "buffer" or not pieces.get(name):
                if rank == 0:
                    problem = _write_chunk(writer, _flat(tensor), problem)
                continue
            for start, end, owner, stored in pieces[name]:
                values = local[(name, start, end)] if owner == rank else None
                values = values() if callable(values) else values  # a reordered piece: made now, one at a time
                for first, last in _chunk_ranges(start, end, stored.itemsize):
                    if owner == rank:
                        chunk = values[first - start : last - start]
                        if rank != 0:
                            C.send(chunk.contiguous(), 0, group=group)
                    elif rank == 0:
                        chunk = torch.empty(last - first, dtype=stored, device=engine.device)
                        C.recv(chunk, owner, group=group)
                    else:
                        continue
                    if rank == 0:
                        problem = _write_chunk(writer, chunk, problem)
    names: list[str] = []
    if rank == 0:
        try:
            if problem is None:
                names = writer.close()
            elif writer is not None:
                writer.abort()
        except Exception as error:
            problem = error
    return _agree(problem, "save_full", group, names)[0]


def _write_chunk(writer: HFLayoutWriter | None, chunk: torch.Tensor, problem: BaseException | None):
    if problem is None:
        try:
            writer.write(chunk)
        except Exception as error:
            return error
    return problem
