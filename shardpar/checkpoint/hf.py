"""The Hugging Face safetensors layout, read by byte range and written whole: a checkpoint is
``model.safetensors``, or ``model.safetensors.index.json`` (``{"metadata": {"total_size":
...}, "weight_map": {tensor: file}}``) plus the ``model-0000k-of-0000n.safetensors`` files it
names (5 digits, 1-based, as ``transformers`` writes them).

Reading: :func:`open_hf_checkpoint` validates all of it up front, reading only the files'
headers (:mod:`shardpar.checkpoint.io`, [Note: byte-range reading]); :class:`HFCheckpoint`
then reads any element range of any tensor, so every rank of a sharded model reads only the
elements it keeps. Every problem with the files is a :class:`~shardpar.errors.CheckpointError`
that names the file and, where there is one, the tensor. Which stored names a model lacks
or does not know is :mod:`shardpar.checkpoint.hf_keys`.

Writing: :class:`HFLayoutWriter` streams a state dict into that layout and commits the
directory with one rename ([Note: atomic commit] in :mod:`shardpar.checkpoint.files`), for
``save_full`` and ``tools/consolidate.py``.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from ..errors import CheckpointError
from .dtypes import dtype_name
from .files import (
    TEMP_NAME,
    check_file_name,
    commit_directory,
    make_temp_dir,
    read_regular_file,
    remove_stale_temps,
    write_text_synced,
)
from .host_bytes import CHUNK_BYTES
from .io import (
    MAX_OPEN_FILES,
    OpenFiles,
    SafetensorsHeader,
    SafetensorsReader,
    SafetensorsWriter,
    StoredTensor,
    read_header,
    unique_keys,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_INDEX_BYTES = 64 * 2**20
"""Largest index file accepted (real ones are well under a megabyte)."""
_EXPORT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""The files of a Hugging Face layout export: an export replaces every one of them."""


def shard_file_name(k: int, count: int) -> str:
    """The name of the ``k``-th of ``count`` model files (1-based)."""
    return SINGLE_FILE if count == 1 else f"model-{k:05d}-of-{count:05d}.safetensors"


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class RangeRead:
    """Fill the 1-D ``dest`` (``end - start`` elements) with elements ``[start, end)`` of the
    flattened stored tensor ``name``."""

    name: str
    start: int
    end: int
    dest: torch.Tensor


def _read_index(path: Path) -> dict[str, str]:
    """The weight map of ``model.safetensors.index.json``: tensor name -> file name, every
    file name a plain name inside the checkpoint directory."""
    where = f"index {path}"
    try:
        raw = read_regular_file(path, "index", MAX_INDEX_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{where} is missing") from None
    except OSError as error:
        raise CheckpointError(f"cannot open {where}: {error.strerror or error}") from None
    try:
        index = json.loads(raw, object_pairs_hook=unique_keys)
    except ValueError as error:
        raise CheckpointError(f"{where} is not valid JSON: {error}") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{where} is not a JSON object with a 'weight_map' object")
    if not isinstance(index.get("metadata", {}), dict):
        raise CheckpointError(f"{where}: 'metadata' is not an object")
    for tensor, file_name in index["weight_map"].items():
        check_file_name(file_name, f"{where}: tensor {tensor!r}")
    weight_map: dict[str, str] = index["weight_map"]  # checked above: an object of file names
    return weight_map


def _locate(path: Path) -> tuple[Path, Path | None, Path | None]:
    """``(directory, single file or None, index or None)`` for what the user pointed at. In a
    directory holding both, ``model.safetensors`` wins, as in ``transformers``."""
    if path.is_dir():
        # lexists: a dangling link named model.safetensors is reported as missing, not skipped
        if os.path.lexists(path / SINGLE_FILE):
            return path, path / SINGLE_FILE, None
        if os.path.lexists(path / INDEX_FILE):
            return path, None, path / INDEX_FILE
        raise CheckpointError(f"{path} holds neither {SINGLE_FILE} nor {INDEX_FILE}: not a Hugging Face checkpoint")
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if path.name.endswith(".json"):
        return path.parent, None, path
    return path.parent, path, None


def _check_weight_map(
    weight_map: Mapping[str, str], tensors: Mapping[str, StoredTensor], directory: Path, index: Path
) -> None:
    for name, file in weight_map.items():
        held = tensors.get(name)
        if held is None or held.file != file:
            raise CheckpointError(f"index {index} lists tensor {name!r} in {directory / file}, which does not hold it")


def open_hf_checkpoint(
    path: str | os.PathLike[str], *, max_open: int = MAX_OPEN_FILES, chunk_bytes: int = CHUNK_BYTES
) -> HFCheckpoint:
    """Validate a Hugging Face safetensors checkpoint and open it for ranged reads.

    ``path``: a directory holding ``model.safetensors`` or ``model.safetensors.index.json``
    plus its files, a ``.safetensors`` file, or an index file. Reads every file's header and
    no tensor data. As in ``transformers``, every tensor in the listed files is part of the
    checkpoint; a tensor in two files, or one the index places in a file that lacks it, is
    an error. See [Note: byte-range reading] in :mod:`shardpar.checkpoint.io`.
    """
    directory, single, index = _locate(Path(path))
    weight_map = _read_index(index) if index is not None else None
    # _locate gives a single file exactly when it gives no index
    names = sorted(set(weight_map.values())) if weight_map is not None else [cast(Path, single).name]
    headers: dict[str, SafetensorsHeader] = {}
    tensors: dict[str, StoredTensor] = {}
    for name in names:
        headers[name] = read_header(directory / name)
        for key, tensor in headers[name].tensors.items():
            if key in tensors:
                raise CheckpointError(
                    f"tensor {key!r} is stored twice: in {directory / tensors[key].file} and in {directory / name}"
                )
            tensors[key] = tensor
    if weight_map is not None:
        assert index is not None  # the weight map was read from it
        _check_weight_map(weight_map, tensors, directory, index)
    return HFCheckpoint(directory, headers, tensors, max_open=max_open, chunk_bytes=chunk_bytes)


class HFCheckpoint:
    """A validated Hugging Face checkpoint, open for ranged reads (:func:`open_hf_checkpoint`).

    Use as a context manager, or call :meth:`close`, to release the open files.
    """

    def __init__(
        self,
        directory: Path,
        headers: Mapping[str, SafetensorsHeader],
        tensors: Mapping[str, StoredTensor],
        *,
        max_open: int = MAX_OPEN_FILES,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.directory = directory
        self.files = sorted(headers)
        """The checkpoint's file names."""
        self._stored = dict(tensors)
        self._open = OpenFiles(lambda name: SafetensorsReader(directory / name, header=headers[name]), max_open)
        self._chunk_bytes = chunk_bytes
        self._closed = False

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Every stored tensor's dtype and shape (from the headers; no data is read)."""
        return {name: (t.dtype, t.shape) for name, t in self._stored.items()}

    @property
    def open_file_count(self) -> int:
        """How many files are open right now (at most ``max_open``)."""
        return len(self._open)

    def entry(self, name: str) -> StoredTensor:
        """Where tensor ``name`` lies; CheckpointError if the checkpoint has no such tensor."""
        try:
            return self._stored[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.directory} has no tensor {name!r}") from None

    def path_of(self, name: str) -> Path:
        """The file that holds tensor ``name``."""
        return self.directory / self.entry(name).file

    def check_shape(self, name: str, expected: Sequence[int]) -> None:
        """CheckpointError naming the tensor, both shapes and the file unless tensor ``name``
        is stored with shape ``expected`` (or naming the tensor if it is not stored)."""
        self.entry(name)
        self.check_shapes({name: expected})

    def check_shapes(self, expected: Mapping[str, Sequence[int]]) -> None:
        """:meth:`check_shape` for many tensors, reporting every mismatch at once. Names the
        checkpoint lacks are the caller's missing keys (:func:`~shardpar.checkpoint.hf_keys.match_keys`),
        not checked here."""
        wrong = [
            f"tensor {name!r} has shape {list(self._stored[name].shape)} in {self.path_of(name)}, "
            f"the model expects {list(shape)}"
            for name, shape in expected.items()
            if name in self._stored and self._stored[name].shape != tuple(shape)
        ]
        if wrong:
            raise CheckpointError("shape mismatch: " + "; ".join(wrong))

    def read_range(self, name: str, start: int, end: int, dest: torch.Tensor) -> None:
        """Fill the 1-D ``dest`` (``end - start`` elements, stored dtype or any floating dtype
        for a floating tensor) with elements ``[start, end)`` of the flattened stored tensor,
        reading only their bytes. See [Note: byte-range reading] in :mod:`shardpar.checkpoint.io`."""
        self.read_ranges([RangeRead(name, start, end, dest)])

    def read_ranges(self, reads: Iterable[RangeRead]) -> None:
        """Execute many :class:`RangeRead`\\ s: all are checked before any byte is read, then
        they run grouped by file in file order, with at most ``max_open`` files open."""
        if self._closed:
            raise ValueError(f"checkpoint {self.directory} is closed")
        planned = [(self.entry(read.name), read) for read in reads]
        for stored, read in planned:
            self._check_read(stored, read)
        planned.sort(key=lambda p: (p[0].file, p[0].offset + p[1].start * p[0].dtype.itemsize))
        for stored, read in planned:
            if read.start < read.end:
                self._open.get(stored.file).read_into(stored, read.start, read.dest, self._chunk_bytes)

    def _check_read(self, stored: StoredTensor, read: RangeRead) -> None:
        if not 0 <= read.start <= read.end <= stored.numel:
            raise ValueError(
                f"range [{read.start}, {read.end}) is outside tensor {stored.name!r} ({stored.numel} elements)"
            )
        if read.dest.dim() != 1 or read.dest.numel() != read.end - read.start:
            raise ValueError(
                f"reading {stored.name!r}[{read.start}:{read.end}] needs a 1-D destination of "
                f"{read.end - read.start} elements, got shape {list(read.dest.shape)}"
            )
        if read.dest.dtype != stored.dtype and not (read.dest.is_floating_point() and stored.dtype.is_floating_point):
            raise CheckpointError(
                f"tensor {stored.name!r} in {self.directory / stored.file} is "
                f"{dtype_name(stored.dtype)}; it cannot be loaded into {read.dest.dtype} "
                "(only floating-point tensors are cast)"
            )

    def close(self) -> None:
        self._open.close()
        self._closed = True


# --------------------------------------------------------------------------- writing


def export_directory(out_dir: str | os.PathLike[str]) -> Path:
    """The directory an export goes to, symlinks resolved (the exchange must swap the real
    directory, not a link to it); a file there is refused."""
    target = Path(os.path.realpath(out_dir))
    if target.exists() and not target.is_dir():
        raise CheckpointError(f"{out_dir} is not a directory; an export is a directory of files")
    return target


def _link_or_copy(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    try:
        os.link(source, destination, follow_symlinks=False)  # same file system: no copy
    except (OSError, NotImplementedError):  # another file system, or no linkat on this platform
        shutil.copy2(source, destination, follow_symlinks=False)


def _carry_over(old_dir: Path, new_dir: Path, replaced: Callable[[str], bool]) -> None:
    """Put what ``old_dir`` holds besides the export (a tokenizer, a README) into ``new_dir``,
    so replacing the directory keeps it."""
    if not old_dir.is_dir():
        return
    with os.scandir(old_dir) as entries:
        for entry in entries:
            if replaced(entry.name) or TEMP_NAME.fullmatch(entry.name):
                continue
            destination = new_dir / entry.name
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), destination)
            elif entry.is_dir():
                shutil.copytree(entry.path, destination, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(entry.path, destination)


class HFLayoutWriter:
    """Writes a state dict, tensor by tensor and chunk by chunk, in the Hugging Face layout:
    ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` when it exceeds ``max_shard_bytes``; and ``json_files``
    (``config.json``...) beside them.

    Shards are filled in the given order; a tensor larger than the limit gets a file of its
    own. Everything goes into a temporary directory next to ``out_dir``, which :meth:`close`
    commits with one rename (see [Note: atomic commit]): the export appears whole or not at
    all, and :meth:`abort` leaves ``out_dir`` exactly as it was. Model files of an earlier
    export in ``out_dir`` are replaced; other files there are kept.
    """

    def __init__(
        self,
        out_dir: Path,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        max_shard_bytes: int,
        json_files: dict[str, Any] | None = None,
    ) -> None:
        self.out_dir = export_directory(out_dir)
        shards: list[list[tuple[str, torch.dtype, Sequence[int]]]] = []
        current: list[tuple[str, torch.dtype, Sequence[int]]] = []
        current_bytes = 0
        for entry in entries:
            nbytes = math.prod(entry[2]) * entry[1].itemsize
            if current and current_bytes + nbytes > max_shard_bytes:
                shards.append(current)
                current, current_bytes = [], 0
            current.append(entry)
            current_bytes += nbytes
            if current_bytes > max_shard_bytes:  # a tensor larger than the limit: alone
                shards.append(current)
                current, current_bytes = [], 0
        if current or not shards:
            shards.append(current)
        count = len(shards)
        self.names = [shard_file_name(k, count) for k in range(1, count + 1)]
        self._shards = shards
        self.total_size = sum(math.prod(s) * d.itemsize for _, d, s in entries)
        self.weight_map = {name: file for file, shard in zip(self.names, shards) for name, _, _ in shard}
        self._json_files = dict(json_files or {})
        remove_stale_temps(self.out_dir)  # of exports to this directory that were killed
        self._dir = make_temp_dir(self.out_dir)
        self._index = -1
        self._writer: SafetensorsWriter | None = None
        try:
            self._next_file()
        except BaseException:
            self.abort()
            raise

    def _next_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._index += 1
        self._writer = None
        if self._index < len(self._shards):
            self._writer = SafetensorsWriter(self._dir / self.names[self._index], self._shards[self._index])
            if self._writer.current_key is None and self._index + 1 < len(self._shards):
                self._next_file()

    def write(self, chunk: torch.Tensor) -> None:
        """Next values of the current tensor (cast to its output dtype)."""
        assert self._writer is not None, "more data than tensors"
        self._writer.write(chunk)
        while self._writer is not None and self._writer.current_key is None and self._index + 1 < len(self._shards):
            self._next_file()

    def close(self) -> list[str]:
        """Finish the last file, write the index (if sharded) and the JSON files, commit."""
        try:
            while self._writer is not None:
                self._next_file()
            if len(self.names) > 1:
                write_text_synced(
                    self._dir / INDEX_FILE,
                    json.dumps({"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}, indent=2)
                    + "\n",
                )
            for name, content in self._json_files.items():
                write_text_synced(self._dir / name, json.dumps(content, indent=2, sort_keys=True) + "\n")
            _carry_over(
                self.out_dir, self._dir, lambda name: bool(_EXPORT_FILE.fullmatch(name)) or name in self._json_files
            )
            commit_directory(self._dir, self.out_dir)
        except BaseException:
            self.abort()
            raise
        return list(self.names)

    def abort(self) -> None:
        """Drop everything written so far; ``out_dir`` stays as it was."""
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        shutil.rmtree(self._dir, ignore_errors=True)
