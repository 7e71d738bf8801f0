"""Reading checkpoints in the Hugging Face safetensors layout by byte range, so that every
rank of a sharded model reads only the elements it keeps.

A checkpoint is ``model.safetensors``, or ``model.safetensors.index.json`` (``{"metadata":
{...}, "weight_map": {tensor: file}}``) plus the files it names. :func:`open_hf_checkpoint`
validates all of it up front, reading only the files' headers; :class:`HFCheckpoint` then
reads any element range of any tensor; :func:`match_keys` reports missing and unexpected
keys as ``transformers`` does. Every problem with the files is a
:class:`~shardpar.errors.CheckpointError` that names the file and, where there is one, the
tensor.

[Note: byte-range reading]
A safetensors file is an 8-byte little-endian header length, a JSON header giving every
tensor's dtype, shape and ``data_offsets`` (relative to the end of the header), then the
tensors' raw little-endian bytes, row-major. Elements ``[start, end)`` of the flattened
tensor are therefore the bytes ``[offset + start * itemsize, offset + end * itemsize)`` of
the file, and a rank that keeps a 1-D piece of a parameter (ZeRO stage 3, "param space")
reads exactly those bytes:

- When the destination has the stored dtype, the bytes are read straight into it: no
  temporary at all.
- Otherwise (bf16 on disk, fp32 parameters) they go through one reused buffer of at most
  ``chunk_bytes`` (:data:`~shardpar.checkpoint.io.CHUNK_BYTES`) in the stored dtype and are
  cast into the destination chunk by chunk, so a cast never holds a second full-size copy.
  Peak memory is the rank's own state plus one chunk.

Nothing is memory-mapped (``safe_open`` maps whole files, and the pages it touches stay
resident; see [Note: streaming safetensors] in :mod:`shardpar.checkpoint.io`) and nothing is
deserialised whole. Headers are validated as strictly as ``safetensors`` itself does --
every tensor's bytes inside the file and consistent with its shape and dtype, and the
tensors tiling the data area without gaps or overlaps -- so a file read here also opens
with ``safe_open``. Files are opened without blocking and refused unless they are regular
files: opening a FIFO for reading would otherwise wait forever for a writer. A file is
checked again (same inode, size and mtime) whenever it is reopened, so one replaced or
truncated after validation is an error, not a short read.

[Note: missing and unexpected keys]
:func:`match_keys` follows ``transformers`` 5.x ``from_pretrained`` (``core_model_loading``
and ``PreTrainedModel.tie_weights``/``_adjust_missing_and_unexpected_keys``), for a model
whose state-dict keys are the stored names (no ``base_model_prefix`` added or removed, no
key renaming):

- missing: state-dict keys that are not stored. Non-persistent buffers are not in the state
  dict, so they are never missing.
- tied weights: Hugging Face stores a tied group (``lm_head.weight`` and
  ``model.embed_tokens.weight``) once. Tying is symmetric while loading: if any member of
  a group is stored, no member is missing; if none is, all are.
- unexpected: stored names that are not state-dict keys (nor tied aliases). A stored
  non-persistent buffer is unexpected unless a pattern excuses it.
- patterns: ``transformers`` then drops missing keys matching the model's
  ``_keys_to_ignore_on_load_missing`` and unexpected keys matching
  ``_keys_to_ignore_on_load_unexpected``, plus ``rotary_emb.inv_freq`` and
  ``position_ids`` where the model has such buffers (they used to be persistent);
  :func:`hf_ignore_patterns` collects these from a ``transformers`` model.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Mapping, NamedTuple, Sequence

import torch
from torch import nn

from ..errors import CheckpointError
from .format import check_file_name
from .io import CHUNK_BYTES, dtype_name, parse_safetensors_dtype

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100_000_000
"""Largest safetensors header accepted (the limit ``safetensors`` itself enforces); the
header is read into memory, so a corrupt length must not become a huge allocation."""
MAX_INDEX_BYTES = 64 * 2**20
"""Largest index file accepted (real ones are well under a megabyte)."""
DEFAULT_MAX_OPEN = 32


# --------------------------------------------------------------------------- records

@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor lies: ``file`` (a name inside the checkpoint directory) holds its
    ``numel`` elements of ``dtype`` from byte ``offset`` on, flattened row-major."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of element 0 in the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

@dataclass(frozen=True)
class RangeRead:
    """Fill the 1-D ``dest`` (``end - start`` elements) with elements ``[start, end)`` of the
    flattened stored tensor ``name``."""

    name: str
    start: int
    end: int
    dest: torch.Tensor

@dataclass(frozen=True)
class _FileStamp:
    """Identity of a validated file, to detect it being replaced or changed afterwards."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> "_FileStamp":
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

# --------------------------------------------------------------------------- low-level file access

def _open_regular(path: Path, what: str) -> tuple[BinaryIO, os.stat_result]:
    """Open ``path`` for reading without ever blocking, and refuse it unless it is a regular
    file. A plain ``open`` of a FIFO waits for a writer forever; ``O_NONBLOCK`` makes the
    open return at once, and ``fstat`` on the descriptor we hold (not a ``stat`` of the path
    beforehand, which a rename could outdate) says what it is. Symlinks are followed: the
    Hugging Face cache links snapshot files to blobs."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise CheckpointError(f"{what} {path} is missing") from None
    except OSError as error:
        raise CheckpointError(f"cannot open {what} {path}: {error.strerror}") from None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise CheckpointError(f"{what} {path} is not a regular file ({_file_kind(status.st_mode)})")
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)  # a regular file never blocks; back to ordinary reads
        return os.fdopen(fd, "rb", buffering=0), status
    except BaseException:
        os.close(fd)
        raise

def _file_kind(mode: int) -> str:
    kinds = {stat.S_ISDIR: "a directory", stat.S_ISFIFO: "a FIFO", stat.S_ISSOCK: "a socket",
             stat.S_ISCHR: "a character device", stat.S_ISBLK: "a block device"}
    return next((kind for test, kind in kinds.items() if test(mode)), "not a plain file")

def _read_exact(file: BinaryIO, offset: int, view: memoryview, where: str) -> None:
    """Read exactly ``view.nbytes`` bytes at ``offset`` into ``view``. The one place this
    module reads file data: every byte read goes through here."""
    file.seek(offset)
    while view.nbytes:
        n = file.readinto(view)
        if not n:
            raise CheckpointError(f"{where} ends early: wanted bytes up to {offset + view.nbytes}, got EOF "
                                  "(was it truncated after the checkpoint was opened?)")
        offset += n
        view = view[n:]

def _read_bytes(file: BinaryIO, offset: int, n: int, where: str) -> bytes:
    buffer = bytearray(n)
    _read_exact(file, offset, memoryview(buffer), where)
    return bytes(buffer)

def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous, non-empty CPU tensor as a writable view (no copy). torch calls
    a one-element view with any stride contiguous (``dest[::2]`` of two elements), so the
    strides are set to 1 explicitly; ``as_strided`` keeps the storage offset."""
    dense = tensor.as_strided((tensor.numel(),), (1,))
    return memoryview(dense.view(torch.uint8).numpy()).cast("B")

def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a repeated key is an error (``json`` would keep the last one)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out

# --------------------------------------------------------------------------- headers

def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0

def _read_header(file: BinaryIO, size: int, where: str) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte where its data starts."""
    if size < 8:
        raise CheckpointError(f"{where} is truncated or not a safetensors file ({size} bytes)")
    length = int.from_bytes(_read_bytes(file, 0, 8, where), "little")
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(f"{where} has a header length of {length} bytes, over the {MAX_HEADER_BYTES} "
                              "bytes limit: not a safetensors file, or corrupted")
    if 8 + length > size:
        raise CheckpointError(f"{where} is truncated or not a safetensors file: its header of {length} bytes "
                              f"ends past the end of the file ({size} bytes)")
    try:
        header = json.loads(_read_bytes(file, 8, length, where), object_pairs_hook=_unique_keys)
    except ValueError as error:  # UnicodeDecodeError included
        raise CheckpointError(f"{where} has a header that is not valid JSON: {error}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{where} has a header that is not a JSON object")
    return header, 8 + length

def _check_metadata(metadata: Any, where: str) -> None:
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{where}: '__metadata__' must map names to strings, got {metadata!r}")

def _parse_entry(name: str, info: Any, file: str, data_start: int, data_size: int, where: str) -> StoredTensor:
    """One header entry, checked against the data area of ``data_size`` bytes."""
    at = f"{where}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{at} has a header entry that is not an object: {info!r}")
    dtype = parse_safetensors_dtype(info.get("dtype"), f"{at} has an ")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and all(_is_count(s) for s in shape)):
        raise CheckpointError(f"{at} has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(o) for o in offsets)):
        raise CheckpointError(f"{at} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if not begin <= end <= data_size:
        raise CheckpointError(f"{at} has data_offsets [{begin}, {end}) outside the file's {data_size} data bytes "
                              "(truncated or corrupted file)")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(f"{at} has data_offsets [{begin}, {end}) ({end - begin} bytes), but shape {shape} "
                              f"of {dtype_name(dtype)} needs {expected} bytes")
    return StoredTensor(name, file, dtype, tuple(shape), data_start + begin)

def _check_tiling(tensors: Iterable[StoredTensor], data_start: int, data_size: int, where: str) -> None:
    """The tensors' bytes must cover the data area exactly, one after another, as
    ``safetensors`` requires: a gap or an overlap means a corrupted header."""
    position = 0
    for tensor in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        begin = tensor.offset - data_start
        if begin != position:
            problem = ("overlaps the tensor before it" if begin < position
                       else f"leaves bytes [{position}, {begin}) unused")
            raise CheckpointError(f"{where}: the data of tensor {tensor.name!r} starts at byte {begin} and {problem} "
                                  "(tensors must tile the data area)")
        position = begin + tensor.nbytes
    if position != data_size:
        raise CheckpointError(f"{where} has {data_size - position} bytes after the last tensor's data "
                              "(the header does not describe the whole file)")

def _parse_file(path: Path, name: str) -> tuple[_FileStamp, dict[str, StoredTensor]]:
    """Open one safetensors file, validate its header, and close it again."""
    where = f"safetensors file {path}"
    file, status = _open_regular(path, "safetensors file")
    with file:
        header, data_start = _read_header(file, status.st_size, where)
    data_size = status.st_size - data_start
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            _check_metadata(info, where)
        else:
            tensors[key] = _parse_entry(key, info, name, data_start, data_size, where)
    _check_tiling(tensors.values(), data_start, data_size, where)
    return _FileStamp.of(status), tensors

# --------------------------------------------------------------------------- the index and the layout

def _read_index(path: Path) -> dict[str, str]:
    """The weight map of ``model.safetensors.index.json``: tensor name -> file name, every
    file name a plain name inside the checkpoint directory."""
    where = f"index {path}"
    file, status = _open_regular(path, "index")
    with file:
        if status.st_size > MAX_INDEX_BYTES:
            raise CheckpointError(f"{where} is {status.st_size} bytes, over the {MAX_INDEX_BYTES} bytes limit")
        raw = _read_bytes(file, 0, status.st_size, where)
    try:
        index = json.loads(raw, object_pairs_hook=_unique_keys)
    except ValueError as error:
        raise CheckpointError(f"{where} is not valid JSON: {error}") from None
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise CheckpointError(f"{where} is not a JSON object with a 'weight_map' object")
    if not isinstance(index.get("metadata", {}), dict):
        raise CheckpointError(f"{where}: 'metadata' is not an object")
    for tensor, file_name in index["weight_map"].items():
        check_file_name(file_name, f"{where}: tensor {tensor!r}")
    return index["weight_map"]

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

def _check_weight_map(weight_map: Mapping[str, str], tensors: Mapping[str, StoredTensor], directory: Path,
                      index: Path) -> None:
    for name, file in weight_map.items():
        held = tensors.get(name)
        if held is None or held.file != file:
            raise CheckpointError(f"index {index} lists tensor {name!r} in {directory / file}, which does not "
                                  "hold it")

def open_hf_checkpoint(path: str | os.PathLike[str], *, max_open: int = DEFAULT_MAX_OPEN,
                       chunk_bytes: int = CHUNK_BYTES) -> "HFCheckpoint":
    """Validate a Hugging Face safetensors checkpoint and open it for ranged reads.

    ``path``: a directory holding ``model.safetensors`` or ``model.safetensors.index.json``
    plus its files, a ``.safetensors`` file, or an index file. Reads every file's header and
    no tensor data. As in ``transformers``, every tensor in the listed files is part of the
    checkpoint; a tensor in two files, or one the index places in a file that lacks it, is
    an error. See [Note: byte-range reading].
    """
    directory, single, index = _locate(Path(path))
    weight_map = _read_index(index) if index is not None else None
    names = sorted(set(weight_map.values())) if weight_map is not None else [single.name]
    stamps: dict[str, _FileStamp] = {}
    tensors: dict[str, StoredTensor] = {}
    for name in names:
        stamps[name], held = _parse_file(directory / name, name)
        for key, tensor in held.items():
            if key in tensors:
                raise CheckpointError(f"tensor {key!r} is stored twice: in {directory / tensors[key].file} and in "
                                      f"{directory / name}")
            tensors[key] = tensor
    if weight_map is not None:
        _check_weight_map(weight_map, tensors, directory, index)
    return HFCheckpoint(directory, stamps, tensors, max_open=max_open, chunk_bytes=chunk_bytes)

# --------------------------------------------------------------------------- reading

class _OpenFiles:
    """At most ``max_open`` files of one checkpoint kept open, least recently used closed
    first; each checked against its validated stamp when (re)opened."""

    def __init__(self, directory: Path, stamps: Mapping[str, _FileStamp], max_open: int) -> None:
        if max_open < 1:
            raise ValueError(f"max_open must be at least 1, got {max_open}")
        self._directory = directory
        self._stamps = stamps
        self._max_open = max_open
        self._files: OrderedDict[str, BinaryIO] = OrderedDict()

    def __len__(self) -> int:
        return len(self._files)

    def get(self, name: str) -> BinaryIO:
        file = self._files.get(name)
        if file is None:
            file = self._open(name)
            self._files[name] = file
            while len(self._files) > self._max_open:
                self._files.popitem(last=False)[1].close()
        self._files.move_to_end(name)
        return file

    def _open(self, name: str) -> BinaryIO:
        path = self._directory / name
        file, status = _open_regular(path, "safetensors file")
        if _FileStamp.of(status) != self._stamps[name]:
            file.close()
            raise CheckpointError(f"safetensors file {path} changed after the checkpoint was opened")
        return file

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()

class HFCheckpoint:
    """A validated Hugging Face checkpoint, open for ranged reads (:func:`open_hf_checkpoint`).

    Use as a context manager, or call :meth:`close`, to release the open files.
    """

    def __init__(self, directory: Path, stamps: Mapping[str, _FileStamp], tensors: Mapping[str, StoredTensor],
                 *, max_open: int = DEFAULT_MAX_OPEN, chunk_bytes: int = CHUNK_BYTES) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        self.directory = directory
        self.files = sorted(stamps)
        """The checkpoint's file names."""
        self._stored = dict(tensors)
        self._open = _OpenFiles(directory, stamps, max_open)
        self._chunk_bytes = chunk_bytes
        self._closed = False

    def __enter__(self) -> "HFCheckpoint":
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
        checkpoint lacks are the caller's missing keys (:func:`match_keys`), not checked here."""
        wrong = [f"tensor {name!r} has shape {list(self._stored[name].shape)} in {self.path_of(name)}, "
                 f"the model expects {list(shape)}"
                 for name, shape in expected.items()
                 if name in self._stored and self._stored[name].shape != tuple(shape)]
        if wrong:
            raise CheckpointError("shape mismatch: " + "; ".join(wrong))

    def read_range(self, name: str, start: int, end: int, dest: torch.Tensor) -> None:
        """Fill the 1-D ``dest`` (``end - start`` elements, stored dtype or any floating dtype
        for a floating tensor) with elements ``[start, end)`` of the flattened stored tensor,
        reading only their bytes. See [Note: byte-range reading]."""
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
            self._read(stored, read.start, read.end, read.dest)

    def _check_read(self, stored: StoredTensor, read: RangeRead) -> None:
        if not 0 <= read.start <= read.end <= stored.numel:
            raise ValueError(f"range [{read.start}, {read.end}) is outside tensor {stored.name!r} "
                             f"({stored.numel} elements)")
        if read.dest.dim() != 1 or read.dest.numel() != read.end - read.start:
            raise ValueError(f"reading {stored.name!r}[{read.start}:{read.end}] needs a 1-D destination of "
                             f"{read.end - read.start} elements, got shape {list(read.dest.shape)}")
        if read.dest.dtype != stored.dtype and not (read.dest.is_floating_point() and stored.dtype.is_floating_point):
            raise CheckpointError(f"tensor {stored.name!r} in {self.directory / stored.file} is "
                                  f"{dtype_name(stored.dtype)}; it cannot be loaded into {read.dest.dtype} "
                                  "(only floating-point tensors are cast)")

    def _read(self, stored: StoredTensor, start: int, end: int, dest: torch.Tensor) -> None:
        if start == end:
            return
        dest = dest.detach()  # a parameter's storage, filled in place without autograd
        file = self._open.get(stored.file)
        where = f"safetensors file {self.directory / stored.file} (tensor {stored.name!r})"
        itemsize = stored.dtype.itemsize
        offset = stored.offset + start * itemsize
        if dest.dtype == stored.dtype and dest.device.type == "cpu" and dest.is_contiguous():
            _read_exact(file, offset, _writable_bytes(dest), where)  # straight into place, no temporary
            return
        step = max(1, self._chunk_bytes // itemsize)
        buffer = torch.empty(min(step, end - start), dtype=stored.dtype)  # the one bounded chunk
        for first in range(0, end - start, step):
            part = buffer[: min(step, end - start - first)]
            _read_exact(file, offset + first * itemsize, _writable_bytes(part), where)
            dest[first : first + part.numel()].copy_(part)

    def close(self) -> None:
        self._open.close()
        self._closed = True

# --------------------------------------------------------------------------- missing and unexpected keys

class KeyReport(NamedTuple):
    missing_keys: list[str]
    """Model state-dict keys the checkpoint does not provide, in the model's order."""
    unexpected_keys: list[str]
    """Stored names the model has no key for, in the checkpoint's order."""

def _tied_groups(aliases: Mapping[str, str]) -> dict[str, frozenset[str]]:
    """Each tied name -> every name tied with it (chains of aliases included)."""
    neighbours: dict[str, set[str]] = {}
    for alias, canonical in aliases.items():
        neighbours.setdefault(alias, set()).add(canonical)
        neighbours.setdefault(canonical, set()).add(alias)
    groups: dict[str, frozenset[str]] = {}
    for name in neighbours:
        if name in groups:
            continue
        group, frontier = {name}, [name]
        while frontier:
            for other in neighbours[frontier.pop()] - group:
                group.add(other)
                frontier.append(other)
        groups.update(dict.fromkeys(group, frozenset(group)))
    return groups

def _pattern(patterns: Iterable[str]) -> re.Pattern[str] | None:
    patterns = list(patterns)
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None

def match_keys(stored_names: Iterable[str], model_keys: Iterable[str], aliases: Mapping[str, str], *,
               ignore_missing: Iterable[str] = (), ignore_unexpected: Iterable[str] = ()) -> KeyReport:
    """Missing and unexpected keys as ``transformers``' ``from_pretrained`` reports them.

    ``model_keys``: the model's state-dict keys; ``aliases``: tied name -> the name it is
    tied to (either may be the one stored); ``ignore_missing``/``ignore_unexpected``: regular
    expressions, searched in each key (:func:`hf_ignore_patterns`). See [Note: missing and
    unexpected keys].
    """
    stored = list(dict.fromkeys(stored_names))
    model = list(dict.fromkeys(model_keys))
    groups = _tied_groups(aliases)
    provided = set(stored)
    provided.update(name for key in stored for name in groups.get(key, ()))
    known = set(model) | set(groups)
    missing = [key for key in model if key not in provided]
    unexpected = [key for key in stored if key not in known]
    skip_missing, skip_unexpected = _pattern(ignore_missing), _pattern(ignore_unexpected)
    return KeyReport(
        [key for key in missing if skip_missing is None or not skip_missing.search(key)],
        [key for key in unexpected if skip_unexpected is None or not skip_unexpected.search(key)],
    )

def hf_ignore_patterns(module: nn.Module) -> tuple[list[str], list[str]]:
    """``(ignore_missing, ignore_unexpected)`` patterns a ``transformers`` model applies when
    loading: its ``_keys_to_ignore_on_load_missing``/``_unexpected``, plus ``rotary_emb.inv_freq``
    and ``position_ids`` when it has buffers of those names (they were persistent in older
    checkpoints). Empty lists for a module that is not a ``transformers`` model."""
    if not hasattr(module, "_keys_to_ignore_on_load_unexpected"):
        return [], []
    missing = list(getattr(module, "_keys_to_ignore_on_load_missing", None) or [])
    unexpected = list(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or [])
    buffers = [name for name, _ in module.named_buffers()]
    if any(name.endswith("rotary_emb.inv_freq") for name in buffers):
        unexpected.append(r"rotary_emb\.inv_freq")
    if any(name.endswith("position_ids") for name in buffers):
        unexpected.append(r"(^|\.)position_ids$")
    return missing, unexpected
