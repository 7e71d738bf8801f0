"""What a shardpar checkpoint is: the manifest (``shardpar.json``) that says where every
piece of every tensor lives -- its assembly, signature and validation --, the names of its
files, and ``latest``. Specified in ``docs/checkpoint-format.md``. Reading any range of any
tensor through the manifest is :mod:`shardpar.checkpoint.reader`; the files themselves are
written and read by :mod:`shardpar.checkpoint.io`.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from ..errors import CheckpointError
from ..version import __version__
from .dtypes import TensorSize, dtype_name, parse_dtype
from .files import check_file_name, read_regular_file, write_text_atomic, write_text_synced
from .json_values import decode_value, to_json_text

FORMAT_NAME = "shardpar-checkpoint"
FORMAT_VERSION = 1
"""Newest manifest version this code reads (and the one it writes)."""
MANIFEST = "shardpar.json"
MANIFEST_DIGEST = "manifest_sha256"
"""Manifest field holding the sha256 of the rest of the manifest; see :func:`manifest_digest`."""
LATEST = "latest"
KINDS = ("param", "frozen", "buffer")
HF_CONFIG_KEYS = ("config", "generation_config")
"""Keys of the manifest's ``hf_config``: the JSON of ``config.json`` and ``generation_config.json``."""

MAX_MANIFEST_BYTES = 256 * 2**20
"""The largest manifest read (and written). A manifest grows with the number of pieces:
about 200 bytes each (with long names and the indentation shardpar writes), and a
checkpoint has roughly (tensors + ranks x buckets or units) x (1 + optimizer states) of
them. 256 MiB is about a million pieces -- a thousand ranks saving a hundred stage-3 units
with Adam state uses a third of it -- while still bounding what a damaged or hostile file
can make a restart read. Only the manifest itself knows the number of pieces, so the bound
is fixed rather than proportional; a save that would exceed it fails, before anything is
made visible."""
MAX_LATEST_BYTES = 2**20
"""The largest ``latest`` read: it holds one directory name (at most 255 bytes on common
file systems)."""


# --------------------------------------------------------------------------- names


def rank_file_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def piece_key(ref: tuple[str, ...], start: int, end: int) -> str:
    """Key of one stored piece: ``emb.weight[0:64]`` or ``optimizer/exp_avg/emb.weight[0:64]``."""
    if ref[0] == "model":
        return f"{ref[1]}[{start}:{end}]"
    return f"optimizer/{ref[2]}/{ref[1]}[{start}:{end}]"


def check_replaceable(target: Path) -> None:
    """Refuse to replace something that is not a checkpoint (it might be anything)."""
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{target} is not a directory; refusing to replace it with a checkpoint")
    if target.exists() and not ((target / MANIFEST).is_file() or not any(target.iterdir())):
        raise CheckpointError(
            f"{target} exists and is not a shardpar checkpoint (no {MANIFEST}); refusing to replace it"
        )


def write_latest(target: Path) -> None:
    """Point ``<parent>/latest`` at the checkpoint directory ``target`` (its name)."""
    write_text_atomic(target.parent / LATEST, target.name + "\n")


# --------------------------------------------------------------------------- the manifest


@dataclass(frozen=True)
class FileRecord:
    name: str
    bytes: int
    sha256: str
    rank: int | None = None


@dataclass(frozen=True)
class StoredPiece:
    """Elements ``[start, end)`` of a tensor flattened to 1-D, stored under ``key`` in ``file``
    as a 1-D tensor of ``end - start`` elements."""

    file: str
    key: str
    start: int
    end: int


@dataclass
class TensorEntry(TensorSize):
    """One stored tensor (a model tensor, or one optimizer state of one parameter)."""

    name: str
    """Model tensors: the state-dict name. Optimizer state: ``"<param> <state key>"``."""
    kind: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    pieces: list[StoredPiece] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind} if self.kind else {}
        out.update(
            dtype=dtype_name(self.dtype),
            shape=list(self.shape),
            pieces=[{"file": p.file, "key": p.key, "start": p.start, "end": p.end} for p in self.pieces],
        )
        return out

    def overlapping(self, start: int, end: int) -> Iterator[tuple[StoredPiece, int, int]]:
        """Pieces holding part of ``[start, end)``, with the overlap (param space)."""
        for piece in self.pieces:
            a, b = max(start, piece.start), min(end, piece.end)
            if a < b:
                yield piece, a, b


def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_entry(name: str, raw: Any, kind: str, files: dict[str, FileRecord], where: str) -> TensorEntry:
    _expect(isinstance(raw, dict), f"{where}: tensor '{name}' is not an object")
    dtype = parse_dtype(raw.get("dtype"), f"{where}: tensor '{name}': ")
    shape = raw.get("shape")
    _expect(
        isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape),
        f"{where}: tensor '{name}' has an invalid shape {shape!r}",
    )
    entry = TensorEntry(name, kind, dtype, tuple(shape))
    pieces = raw.get("pieces")
    _expect(isinstance(pieces, list), f"{where}: tensor '{name}' has no list of pieces")
    for p in pieces:
        _expect(
            isinstance(p, dict) and isinstance(p.get("key"), str) and _is_int(p.get("start")) and _is_int(p.get("end")),
            f"{where}: tensor '{name}' has a malformed piece {p!r}",
        )
        _expect(
            isinstance(p.get("file"), str) and p["file"] in files,
            f"{where}: tensor '{name}' has a piece in file {p.get('file')!r}, "
            "which the manifest's file table does not list",
        )
        entry.pieces.append(StoredPiece(p["file"], p["key"], p["start"], p["end"]))
    check_coverage(entry, where)
    return entry


def check_coverage(entry: TensorEntry, where: str) -> None:
    """Pieces must tile ``[0, numel)`` exactly: no gap, no overlap, nothing outside."""
    position = 0
    for piece in sorted(entry.pieces, key=lambda p: (p.start, p.end)):
        _expect(
            piece.start < piece.end,
            f"{where}: tensor '{entry.name}' has an empty or reversed piece "
            f"[{piece.start}, {piece.end}) in {piece.file}",
        )
        _expect(
            piece.start <= position,
            f"{where}: piece coverage of tensor '{entry.name}' does not add up: "
            f"elements [{position}, {piece.start}) are in no piece",
        )
        _expect(
            piece.start >= position,
            f"{where}: piece coverage of tensor '{entry.name}' does not add up: "
            f"elements [{piece.start}, {min(position, piece.end)}) are stored twice",
        )
        position = piece.end
    if position != entry.numel:
        raise CheckpointError(
            f"{where}: piece coverage of tensor '{entry.name}' does not add up: the pieces "
            f"cover elements [0, {position}), the tensor has {entry.numel}"
        )


@dataclass
class OptimizerRecord:
    class_name: str
    param_groups: list[dict[str, Any]]
    """``{"params": [names], "hyperparameters": {...}}`` per group, in order."""
    state: dict[str, dict[str, TensorEntry]]
    """Elementwise state: parameter name -> state key -> entry (the parameter's shape)."""
    scalar_state: dict[str, dict[str, Any]]
    """Per-parameter scalar state: parameter name -> state key -> encoded value."""
    whole_state: dict[str, dict[str, TensorEntry]] = field(default_factory=dict)
    """State tensors of other shapes than the parameter's (Adafactor's factored moments,
    Shampoo's preconditioners), kept whole: parameter name -> state key -> entry (its own
    shape). Written once, by the rank that updates the parameter whole ([Note: whole-tensor
    ownership] in core/layout.py); read back whole by the rank that does in the new layout."""


@dataclass
class Manifest:
    directory: Path
    raw: dict[str, Any]
    format_version: int
    stage: int
    world_size: int
    files: dict[str, FileRecord]
    tensors: dict[str, TensorEntry]
    """Model tensors in state-dict order, aliases excluded."""
    aliases: dict[str, str]
    optimizer: OptimizerRecord | None
    extra: Any
    hf_config: dict[str, dict[str, Any]] | None = None
    """The Hugging Face ``config.json`` (and ``generation_config.json``) of the model, if it has one."""

    @property
    def path(self) -> Path:
        return self.directory / MANIFEST

    def entries(self) -> Iterator[TensorEntry]:
        """Every stored tensor: the model's, then the optimizer's."""
        yield from self.tensors.values()
        if self.optimizer is not None:
            for section in (self.optimizer.state, self.optimizer.whole_state):
                for per_key in section.values():
                    yield from per_key.values()


def parse_manifest(raw: Any, directory: Path) -> Manifest:
    """Validate a manifest's JSON object; every problem is a CheckpointError naming it."""
    where = f"manifest {directory / MANIFEST}"
    _expect(isinstance(raw, dict), f"{where} is not a JSON object")
    _expect(
        raw.get("format") == FORMAT_NAME,
        f"{where} is not a shardpar checkpoint manifest (format {raw.get('format')!r}, expected {FORMAT_NAME!r})",
    )
    version = raw.get("format_version")
    _expect(_is_int(version) and version >= 1, f"{where} has an invalid format_version {version!r}")
    _expect(
        version <= FORMAT_VERSION,
        f"{where} has format_version {version}, newer than {FORMAT_VERSION}, the "
        "newest this shardpar reads; upgrade shardpar to load it",
    )
    check_manifest_digest(raw, where)
    for key in ("stage", "world_size"):
        _expect(_is_int(raw.get(key)), f"{where}: '{key}' is missing or not an integer")

    files_raw = raw.get("files")
    _expect(isinstance(files_raw, dict), f"{where}: 'files' is missing or not an object")
    files: dict[str, FileRecord] = {}
    for name, record in files_raw.items():
        check_file_name(name, where, reserved=(MANIFEST,))
        _expect(
            isinstance(record, dict) and _is_int(record.get("bytes")) and isinstance(record.get("sha256"), str),
            f"{where}: file '{name}' needs integer 'bytes' and string 'sha256'",
        )
        files[name] = FileRecord(name, record["bytes"], record["sha256"], record.get("rank"))

    tensors_raw = raw.get("tensors")
    _expect(isinstance(tensors_raw, dict), f"{where}: 'tensors' is missing or not an object")
    tensors = {}
    for name, entry in tensors_raw.items():
        kind = entry.get("kind") if isinstance(entry, dict) else None
        _expect(kind in KINDS, f"{where}: tensor '{name}' has kind {kind!r}, expected one of {KINDS}")
        tensors[name] = _parse_entry(name, entry, cast(str, kind), files, where)  # _expect: one of KINDS

    aliases = raw.get("aliases", {})
    _expect(
        isinstance(aliases, dict) and all(isinstance(v, str) and v in tensors for v in aliases.values()),
        f"{where}: 'aliases' must map names to stored tensors",
    )

    optimizer = None
    opt_raw = raw.get("optimizer")
    if opt_raw is not None:
        _expect(
            isinstance(opt_raw, dict)
            and isinstance(opt_raw.get("class"), str)
            and isinstance(opt_raw.get("param_groups"), list),
            f"{where}: 'optimizer' needs 'class' and 'param_groups'",
        )
        for index, group in enumerate(opt_raw["param_groups"]):
            _expect(
                isinstance(group, dict)
                and isinstance(group.get("params"), list)
                and all(isinstance(name, str) for name in group["params"])
                and isinstance(group.get("hyperparameters"), dict),
                f"{where}: optimizer param group {index} needs 'params' (names) and 'hyperparameters'",
            )
            for key, value in group["hyperparameters"].items():
                decode_value(value, where=f"{where}: optimizer param group {index} hyperparameter '{key}'")
        state: dict[str, dict[str, TensorEntry]] = {}
        state_raw = opt_raw.get("state") or {}
        _expect(isinstance(state_raw, dict), f"{where}: optimizer 'state' must be an object")
        for param, per_key in state_raw.items():
            _expect(
                param in tensors and isinstance(per_key, dict), f"{where}: optimizer state for unknown tensor '{param}'"
            )
            state[param] = {}
            for key, entry in per_key.items():
                parsed = _parse_entry(f"{param} {key}", entry, "", files, where)
                _expect(
                    parsed.shape == tensors[param].shape,
                    f"{where}: optimizer state '{key}' of '{param}' has shape {list(parsed.shape)}, "
                    f"the parameter {list(tensors[param].shape)}",
                )
                state[param][key] = parsed
        scalar = opt_raw.get("scalar_state") or {}
        _expect(
            isinstance(scalar, dict) and all(isinstance(v, dict) for v in scalar.values()),
            f"{where}: 'scalar_state' must map parameter names to objects",
        )
        for param, per_key in scalar.items():
            for key, value in per_key.items():
                decode_value(value, where=f"{where}: optimizer scalar state '{key}' of '{param}'")
        whole: dict[str, dict[str, TensorEntry]] = {}
        whole_raw = opt_raw.get("whole_state") or {}
        _expect(isinstance(whole_raw, dict), f"{where}: optimizer 'whole_state' must be an object")
        for param, per_key in whole_raw.items():
            _expect(
                param in tensors and isinstance(per_key, dict),
                f"{where}: optimizer whole state for unknown tensor '{param}'",
            )
            whole[param] = {
                key: _parse_entry(f"{param} {key}", entry, "", files, where) for key, entry in per_key.items()
            }
        optimizer = OptimizerRecord(opt_raw["class"], opt_raw["param_groups"], state, scalar, whole)

    hf_config = raw.get("hf_config")
    _expect(
        hf_config is None
        or (
            isinstance(hf_config, dict)
            and isinstance(hf_config.get("config"), dict)
            and set(hf_config) <= set(HF_CONFIG_KEYS)
            and all(isinstance(v, dict) for v in hf_config.values())
        ),
        f"{where}: 'hf_config' must be null or an object with a 'config' object and optionally a "
        "'generation_config' object",
    )

    return Manifest(
        directory,
        raw,
        version,
        raw["stage"],
        raw["world_size"],
        files,
        tensors,
        dict(aliases),
        optimizer,
        raw.get("extra"),
        hf_config,
    )


def manifest_digest(raw: dict[str, Any]) -> str:
    """sha256 (hex) of the manifest without its ``manifest_sha256`` field, serialised
    canonically: ``json.dumps(..., sort_keys=True, separators=(",", ":"), ensure_ascii=True)``,
    UTF-8. Whitespace and key order of the file do not matter; every value does."""
    body = {key: value for key, value in raw.items() if key != MANIFEST_DIGEST}
    try:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError) as error:  # NaN/Infinity, or a float that overflowed to inf
        raise CheckpointError(f"the manifest is not standard JSON: {error}") from None
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def check_manifest_digest(raw: dict[str, Any], where: str) -> None:
    """A manifest with a ``manifest_sha256`` must match it: the shard files are checked by the
    sha256s the manifest lists, and this covers the manifest itself, so a flipped digit in a
    learning rate, a piece offset or ``extra`` is refused instead of loaded. (Optional within
    format version 1: manifests written before it was introduced carry none.)"""
    if MANIFEST_DIGEST not in raw:
        return
    recorded = raw[MANIFEST_DIGEST]
    actual = manifest_digest(raw)
    _expect(
        recorded == actual,
        f"{where} does not match its checksum (sha256 {actual}, '{MANIFEST_DIGEST}' says "
        f"{recorded!r}): the manifest was modified or is corrupted",
    )


def check_is_directory(directory: Path, what: str) -> None:
    """A missing directory and a file where one is expected are different mistakes; say which."""
    if not directory.exists():
        raise CheckpointError(f"{what} {directory} does not exist")
    if not directory.is_dir():
        raise CheckpointError(f"{what} {directory} is not a directory")


def read_manifest(directory: str | os.PathLike[str]) -> Manifest:
    """Read and validate ``<directory>/shardpar.json`` (at most :data:`MAX_MANIFEST_BYTES`)."""
    directory = Path(directory)
    check_is_directory(directory, "checkpoint directory")
    path = directory / MANIFEST
    try:
        text = read_regular_file(path, "manifest", MAX_MANIFEST_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} has no manifest {MANIFEST}: not a shardpar checkpoint (or an interrupted save)"
        ) from None
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"cannot read manifest {path}: {error}") from None
    try:
        raw = json.loads(text)
    except ValueError as error:
        raise CheckpointError(f"manifest {path} is not valid JSON: {error}") from None
    return parse_manifest(raw, directory)


def is_valid_checkpoint(directory: Path) -> bool:
    """Cheap validity: the manifest parses and every file exists with its recorded size."""
    try:
        manifest = read_manifest(directory)
        return all(
            stat.S_ISREG((info := (directory / f.name).stat()).st_mode) and info.st_size == f.bytes
            for f in manifest.files.values()
        )
    except (CheckpointError, OSError):
        return False


def _read_latest(root: Path) -> str | None:
    """The name ``root/latest`` holds, or None. A pointer that is not a regular file or is
    oversized is not something a save writes: it is ignored with a warning, as a damaged one
    is ignored silently, so a restart still finds the newest valid checkpoint."""
    try:
        return read_regular_file(root / LATEST, "latest pointer", MAX_LATEST_BYTES).decode("utf-8").strip()
    except CheckpointError as error:
        warnings.warn(f"{error}; latest_checkpoint takes the newest valid checkpoint instead", stacklevel=3)
    except (OSError, UnicodeDecodeError):
        pass
    return None


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest valid checkpoint under ``root``: the one ``root/latest`` names if valid,
    else the valid checkpoint directory with the newest manifest (``created_unix``). None
    if ``root`` does not exist (yet); a CheckpointError if it is not a directory."""
    root = Path(root)
    if not root.exists():
        return None
    check_is_directory(root, "checkpoint root")
    try:
        name = _read_latest(root)
        if name is not None:
            check_file_name(name, "latest", reserved=(MANIFEST,))
            if is_valid_checkpoint(root / name):
                return root / name
    except CheckpointError:
        pass
    best: tuple[float, str] | None = None
    for candidate in root.iterdir():
        if candidate.name.startswith(".") or not candidate.is_dir() or not is_valid_checkpoint(candidate):
            continue
        created = read_manifest(candidate).raw.get("created_unix")
        key = (float(created) if isinstance(created, (int, float)) else candidate.stat().st_mtime, candidate.name)
        best = key if best is None or key > best else best
    return root / best[1] if best is not None else None


# --------------------------------------------------------------------------- manifest assembly


@dataclass(frozen=True)
class StoredItem:
    """One piece a writer put in a file: what it is (``("model", name)`` or
    ``("state", name, key)``), its key, its range and dtype."""

    ref: tuple[str, ...]
    key: str
    start: int
    end: int
    dtype: str


def assemble_manifest(
    *,
    stage: int,
    world_size: int,
    model: list[tuple[str, str, str, list[int]]],
    aliases: dict[str, str],
    files: list[FileRecord],
    items: dict[str, list[StoredItem]],
    optimizer: dict[str, Any] | None,
    extra: Any,
    layout: Any = None,
    torch_version: str | None = None,
    hf_config: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The manifest JSON object from what every file holds; validated before it is returned.

    ``model``: ``(name, kind, dtype, shape)`` in state-dict order (dtype is used when a tensor
    has no pieces); ``optimizer``: ``{"class", "param_groups", "scalar_state"}`` and, where
    whole state was written, ``"whole_state_shapes"`` (name -> key -> shape); the elementwise
    and whole state entries are built here from ``items``.
    """
    tensors: dict[str, dict[str, Any]] = {
        name: {"kind": kind, "dtype": dtype, "shape": list(shape), "pieces": []} for name, kind, dtype, shape in model
    }
    shapes = {name: list(shape) for name, _, _, shape in model}
    state: dict[str, dict[str, dict[str, Any]]] = {}
    whole: dict[str, dict[str, dict[str, Any]]] = {}
    optimizer = None if optimizer is None else dict(optimizer)
    whole_shapes = {} if optimizer is None else optimizer.pop("whole_state_shapes", {})
    for record in files:
        for item in items.get(record.name, []):
            if item.ref[0] == "model":
                entry = tensors[item.ref[1]]
            elif item.ref[0] == "whole_state":
                _, name, key = item.ref
                entry = whole.setdefault(name, {}).setdefault(
                    key, {"dtype": item.dtype, "shape": whole_shapes[name][key], "pieces": []}
                )
            else:
                _, name, key = item.ref
                entry = state.setdefault(name, {}).setdefault(
                    key, {"dtype": item.dtype, "shape": shapes[name], "pieces": []}
                )
            if entry["pieces"] and entry["dtype"] != item.dtype:
                raise CheckpointError(
                    f"pieces of {item.ref[1:]} have different dtypes ({entry['dtype']}, {item.dtype})"
                )
            entry["dtype"] = item.dtype
            entry["pieces"].append({"file": record.name, "key": item.key, "start": item.start, "end": item.end})
    stored_state = [e for section in (state, whole) for per in section.values() for e in per.values()]
    for entry in list(tensors.values()) + stored_state:
        entry["pieces"].sort(key=lambda p: p["start"])
    manifest: dict[str, Any] = {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_unix": time.time(),
        "torch_version": torch_version or torch.__version__,
        "shardpar_version": __version__,
        "stage": stage,
        "world_size": world_size,
        "files": {
            f.name: {"bytes": f.bytes, "sha256": f.sha256, **({"rank": f.rank} if f.rank is not None else {})}
            for f in files
        },
        "tensors": tensors,
        "aliases": aliases,
        "layout": layout,
        "optimizer": None
        if optimizer is None
        else {**optimizer, "state": state, **({"whole_state": whole} if whole else {})},
        "extra": extra,
        "hf_config": hf_config,
    }
    parse_manifest(json.loads(to_json_text(manifest, "the manifest")), Path("."))  # self-check
    return manifest


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Sign and write the manifest; one a reader would refuse for its size is refused here."""
    path = directory / MANIFEST
    manifest = {**manifest, MANIFEST_DIGEST: manifest_digest(manifest)}
    text = to_json_text(manifest, "the manifest")
    size = len(text.encode("utf-8"))
    if size > MAX_MANIFEST_BYTES:
        raise CheckpointError(
            f"the manifest of {directory} would be {size} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} bytes a reader accepts (MAX_MANIFEST_BYTES)"
        )
    write_text_synced(path, text)
