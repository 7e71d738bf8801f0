"""Checkpoint work without a process group: consolidate to the Hugging Face layout, reshard
to another world size, verify and summarise. Used by ``tools/``; every tensor is streamed
through one bounded buffer (:data:`~shardpar.checkpoint.host_bytes.CHUNK_BYTES`), so no step ever
holds a whole model, or even a whole tensor.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from tqdm import tqdm

from ..sizes import parse_bytes
from .dtypes import dtype_name, parse_dtype
from .files import commit_directory, make_temp_dir, remove_stale_temps
from .format import (
    FileRecord,
    Manifest,
    StoredItem,
    TensorEntry,
    assemble_manifest,
    check_replaceable,
    piece_key,
    rank_file_name,
    read_manifest,
    write_manifest,
)
from .hf import HFLayoutWriter, export_directory
from .hf_config import config_files, floating_dtype
from .io import SafetensorsWriter
from .reader import CheckpointReader


def _bar(total: int, desc: str, enabled: bool) -> tqdm:
    """A byte progress bar on stderr, shown only on a terminal (None: tqdm's TTY check)."""
    return tqdm(
        total=total,
        desc=desc,
        unit="B",
        unit_scale=True,
        unit_divisor=1000,
        disable=None if enabled else True,
        leave=False,
    )


def consolidate(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
) -> list[str]:
    """Sharded checkpoint -> Hugging Face layout (``model.safetensors`` or numbered shards +
    index), model tensors only, tied weights once; ``dtype`` casts floating-point tensors.
    The model's ``config.json`` (and ``generation_config.json``) go beside the weights when
    the checkpoint carries them. ``out_dir`` appears whole or not at all (a failure leaves
    it exactly as it was); files in it that are not part of an export are kept."""
    manifest = read_manifest(ckpt_dir)
    max_bytes = parse_bytes(max_shard_size, "max_shard_size")
    cast = None if dtype is None else (dtype if isinstance(dtype, torch.dtype) else parse_dtype(dtype))
    if export_directory(out_dir) == Path(os.path.realpath(manifest.directory)):
        raise ValueError("the output directory must differ from the input checkpoint")

    def out_dtype(entry: TensorEntry) -> torch.dtype:
        return cast if cast is not None and entry.dtype.is_floating_point else entry.dtype

    entries = list(manifest.tensors.values())
    layout = [(e.name, out_dtype(e), e.shape) for e in entries]
    json_files = config_files(manifest.hf_config, floating_dtype([stored for _, stored, _ in layout]))
    with CheckpointReader(manifest) as reader, _bar(sum(e.nbytes for e in entries), "consolidate", progress) as bar:
        writer = HFLayoutWriter(Path(out_dir), layout, max_bytes, json_files)
        try:
            for entry in entries:
                for chunk in reader.iter_range(entry, 0, entry.numel):
                    writer.write(chunk)
                    bar.update(chunk.numel() * chunk.element_size())
        except BaseException:
            writer.abort()
            raise
        return writer.close()


def even_split(numels: list[int], world_size: int) -> list[list[tuple[int, int, int]]]:
    """Cut the concatenation of tensors into ``world_size`` contiguous, near-equal ranges:
    per rank, ``(tensor index, start, end)`` in param space."""
    total = sum(numels)
    bounds = [total * r // world_size for r in range(world_size + 1)]
    out: list[list[tuple[int, int, int]]] = [[] for _ in range(world_size)]
    offset = 0
    for index, numel in enumerate(numels):
        for rank in range(world_size):
            start, end = max(offset, bounds[rank]), min(offset + numel, bounds[rank + 1])
            if start < end:
                out[rank].append((index, start - offset, end - offset))
        offset += numel
    return out


def reshard(
    ckpt_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    world_size: int,
    stage: int | None = None,
    progress: bool = True,
) -> Path:
    """Rewrite a checkpoint into ``world_size`` rank files (offline; any world size/stage loads
    either one). Parameters -- and frozen ones too at stage 3 -- are cut into ``world_size``
    near-equal contiguous ranges of their concatenation (the layout of a single unpadded
    bucket); each optimizer state follows its parameter; buffers, and frozen parameters at
    stages 0-2, go to rank 0 as the engines do. The output is written and committed
    atomically like a saved checkpoint (``latest`` is not touched); a failure leaves
    ``out_dir`` as it was and no temporary behind."""
    if world_size < 1:
        raise ValueError(f"--world-size must be at least 1, got {world_size}")
    manifest = read_manifest(ckpt_dir)
    stage = manifest.stage if stage is None else stage
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"--stage must be 0, 1, 2 or 3, got {stage}")
    target = Path(out_dir).absolute()
    if target == manifest.directory.absolute():
        raise ValueError("the output directory must differ from the input checkpoint")
    check_replaceable(target)

    spread = [e for e in manifest.tensors.values() if e.kind == "param" or (e.kind == "frozen" and stage == 3)]
    plan: list[list[tuple[tuple[str, ...], TensorEntry, int, int]]] = [[] for _ in range(world_size)]
    state = manifest.optimizer.state if manifest.optimizer is not None else {}
    for rank, ranges in enumerate(even_split([e.numel for e in spread], world_size)):
        for index, start, end in ranges:
            entry = spread[index]
            plan[rank].append((("model", entry.name), entry, start, end))
            for key, state_entry in state.get(entry.name, {}).items():
                plan[rank].append((("state", entry.name, key), state_entry, start, end))
    spread_names = {e.name for e in spread}
    for entry in manifest.tensors.values():
        if entry.name not in spread_names and entry.numel:
            plan[0].append((("model", entry.name), entry, 0, entry.numel))
            for key, state_entry in state.get(entry.name, {}).items():
                plan[0].append((("state", entry.name, key), state_entry, 0, entry.numel))
    whole = manifest.optimizer.whole_state if manifest.optimizer is not None else {}
    for name, per_key in whole.items():  # kept whole: one rank's, as its owner wrote it
        for key, state_entry in per_key.items():
            plan[0].append((("whole_state", name, key), state_entry, 0, state_entry.numel))

    remove_stale_temps(target)
    tmp = make_temp_dir(target)
    try:
        _write_resharded(manifest, plan, tmp, stage, world_size, progress)
        commit_directory(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _write_resharded(
    manifest: Manifest,
    plan: list[list[tuple[tuple[str, ...], TensorEntry, int, int]]],
    tmp: Path,
    stage: int,
    world_size: int,
    progress: bool,
) -> None:
    """The rank files of ``plan`` and their manifest, into the directory ``tmp``."""
    files: list[FileRecord] = []
    items: dict[str, list[StoredItem]] = {}
    total = sum((end - start) * e.dtype.itemsize for ranks in plan for _, e, start, end in ranks)
    with CheckpointReader(manifest) as reader, _bar(total, "reshard", progress) as bar:
        for rank, pieces in enumerate(plan):
            name = rank_file_name(rank, world_size)
            stored = [
                StoredItem(ref, piece_key(ref, s, e), s, e, dtype_name(entry.dtype)) for ref, entry, s, e in pieces
            ]
            writer = SafetensorsWriter(
                tmp / name,
                [(i.key, entry.dtype, (i.end - i.start,)) for i, (_, entry, _, _) in zip(stored, pieces)],
                {"shardpar_format": "1", "rank": str(rank), "world_size": str(world_size)},
            )
            try:
                for _, entry, start, end in pieces:
                    for chunk in reader.iter_range(entry, start, end):
                        writer.write(chunk)
                        bar.update(chunk.numel() * chunk.element_size())
                size, digest = writer.close()
            except BaseException:
                writer.abort()
                raise
            files.append(FileRecord(name, size, digest, rank))
            items[name] = stored
    optimizer = None
    if manifest.optimizer is not None:
        record = manifest.optimizer
        optimizer = {
            "class": record.class_name,
            "param_groups": record.param_groups,
            "scalar_state": record.scalar_state,
        }
        if record.whole_state:
            optimizer["whole_state_shapes"] = {
                name: {key: list(entry.shape) for key, entry in per_key.items()}
                for name, per_key in record.whole_state.items()
            }
    manifest_json = assemble_manifest(
        stage=stage,
        world_size=world_size,
        model=[(e.name, e.kind, dtype_name(e.dtype), list(e.shape)) for e in manifest.tensors.values()],
        aliases=manifest.aliases,
        files=files,
        items=items,
        optimizer=optimizer,
        extra=manifest.extra,
        layout={"even_split": {"world_size": world_size, "resharded_from": manifest.world_size}},
        torch_version=manifest.raw.get("torch_version"),
        hf_config=manifest.hf_config,
    )
    write_manifest(tmp, manifest_json)


def verify(manifest: Manifest, progress: bool = True) -> None:
    """Every file's size and sha256, every piece's presence, dtype and shape in its file
    (piece coverage was checked when the manifest was read). Raises CheckpointError."""
    total = sum(f.bytes for f in manifest.files.values())
    with _bar(total, "verify", progress) as bar:
        reader = CheckpointReader(manifest, progress=bar.update, max_open=1)
        with reader:
            for name in sorted(manifest.files):
                reader.file(name)  # size and sha256 first
                for entry in manifest.entries():
                    for piece in entry.pieces:
                        if piece.file == name:
                            reader.stored(entry, piece)


def summary(manifest: Manifest) -> list[tuple[str, str]]:
    """``(field, value)`` rows describing a checkpoint, for ``tools/inspect_ckpt.py``."""
    import json

    kinds = {kind: [e for e in manifest.tensors.values() if e.kind == kind] for kind in ("param", "frozen", "buffer")}
    rows = [
        ("checkpoint", str(manifest.directory)),
        ("format version", str(manifest.format_version)),
        ("saved with", f"torch {manifest.raw.get('torch_version')}, shardpar {manifest.raw.get('shardpar_version')}"),
        ("stage", str(manifest.stage)),
        ("world size", str(manifest.world_size)),
        ("files", f"{len(manifest.files)}, {sum(f.bytes for f in manifest.files.values()):,} bytes"),
    ]
    for kind, entries in kinds.items():
        rows.append(
            (
                f"{kind} tensors",
                f"{len(entries)}, {sum(e.numel for e in entries):,} elements, {sum(e.nbytes for e in entries):,} bytes",
            )
        )
    if manifest.aliases:
        rows.append(("aliases", ", ".join(f"{a} -> {c}" for a, c in manifest.aliases.items())))
    record = manifest.optimizer
    if record is None:
        rows.append(("optimizer", "none"))
    else:
        keys = sorted(
            {k for per in record.state.values() for k in per}
            | {k for per in record.scalar_state.values() for k in per}
            | {k for per in record.whole_state.values() for k in per}
        )
        state_bytes = sum(
            e.nbytes for section in (record.state, record.whole_state) for per in section.values() for e in per.values()
        )
        rows.append(("optimizer", f"{record.class_name}; state {', '.join(keys) or 'none'} ({state_bytes:,} bytes)"))
        for index, group in enumerate(record.param_groups):
            hyper = ", ".join(f"{k}={json.dumps(v)}" for k, v in group["hyperparameters"].items())
            rows.append((f"  param group {index}", f"{len(group['params'])} params; {hyper}"))
    rows.append(("extra", json.dumps(manifest.extra)))
    return rows


def format_table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
