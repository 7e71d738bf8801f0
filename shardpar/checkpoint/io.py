"""Safetensors files, written and read by byte range without any process group: the one
reader and writer of every ``.safetensors`` file shardpar touches -- a checkpoint's rank
files, an export's model files, and the Hugging Face files ``load_pretrained`` reads. What
a checkpoint's files mean (the manifest) is :mod:`shardpar.checkpoint.format`, the Hugging
Face layout around its files :mod:`shardpar.checkpoint.hf`; the file system under them
(regular files only, atomic commits) :mod:`shardpar.checkpoint.files`.

[Note: streaming safetensors]
Files are ordinary ``.safetensors`` files (8-byte little-endian header length, JSON header,
raw little-endian data), but this module writes and reads them itself instead of through
``safetensors.torch``, for memory:

- ``safetensors.torch.save_file`` wants every tensor as its own contiguous, non-overlapping
  tensor and builds the file in memory. :class:`SafetensorsWriter` writes the header first
  (from dtypes and shapes alone), then each tensor's bytes straight from its live storage --
  a 1-D piece of a flat buffer is written without a copy -- hashing as it goes.
- ``safe_open(...).get_slice(key)[a:b]`` (safetensors 0.8) maps the whole file with
  ``UntypedStorage.from_file``: every page read stays resident in the process (measured here:
  reading a 200 MB file slice by slice left RSS 194 MB higher, still after closing).
  :class:`SafetensorsReader` seeks to the byte range and ``readinto``\\ s the destination
  tensor itself; see [Note: byte-range reading].

The tests read our files back with ``safetensors.safe_open`` and ``load_file``.

[Note: byte-range reading]
The JSON header gives every tensor's dtype, shape and ``data_offsets`` (relative to the end
of the header); the data is row-major. Elements ``[start, end)`` of the flattened tensor are
therefore the bytes ``[offset + start * itemsize, offset + end * itemsize)`` of the file, and
a rank that keeps a 1-D piece of a parameter (ZeRO stage 3, "param space") reads exactly
those bytes:

- When the destination has the stored dtype, the bytes are read straight into it: no
  temporary at all (through two pinned buffers for a CUDA destination: [Note: checkpoint
  bytes and the GPU]).
- Otherwise (bf16 on disk, fp32 parameters) they go through one reused buffer of at most
  ``chunk_bytes`` (:data:`CHUNK_BYTES`) in the stored dtype and are cast into the destination
  chunk by chunk, so a cast never holds a second full-size copy. Peak memory is the rank's
  own state plus one chunk.

Nothing is memory-mapped and nothing is deserialised whole. Headers are validated as
strictly as ``safetensors`` itself does -- at most :data:`MAX_HEADER_BYTES`, every tensor's
bytes inside the file and consistent with its shape and dtype, the tensors tiling the data
area without gaps or overlaps, keys unique, ``__metadata__`` strings only -- so a file read
here also opens with ``safe_open``, and one refused here is refused there. Files are opened
through :func:`~shardpar.checkpoint.files.open_regular_file` ([Note: only regular files are
read]). A reader opened with the header read earlier checks that the file is still the one
it was read from (same inode, size and mtime), so a file replaced or truncated after
validation is an error, not a short read.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from io import FileIO
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .dtypes import TensorSize, dtype_name, parse_safetensors_dtype, safetensors_code
from .files import open_regular_file, sha256_file, write_failure
from .host_bytes import CHUNK_BYTES, PinnedBounce, bytes_of

MAX_HEADER_BYTES = 100_000_000
"""The largest safetensors header read or written. It is the limit of ``safetensors``
itself (``MAX_HEADER_SIZE`` in its Rust ``tensor.rs``, refused as ``HeaderTooLarge``), so:
a file with a longer header is one no other safetensors reader opens, and refusing it here
costs nothing; the header is read into memory whole, so a corrupt length must not become a
huge allocation; and the writer refuses to write what ``safe_open`` would refuse to read.
Our own headers stay far below it: an entry is about 150 bytes, so it is some 600,000
pieces in one rank file (a checkpoint's manifest is capped at a million pieces over all
files, ``MAX_MANIFEST_BYTES``)."""
MAX_OPEN_FILES = 32
"""Default of how many files one reader of many files keeps open at once."""


def chunks_of(tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """1-D slices of a flattened tensor, each at most ``chunk_bytes`` (at least 1 element)."""
    flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().flatten()
    step = max(1, chunk_bytes // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


# --------------------------------------------------------------------------- writing


class SafetensorsWriter:
    """Streams one ``.safetensors`` file: the header (every tensor's dtype, shape and offsets)
    first, then each tensor's bytes in header order, possibly in several ``write`` calls.

    Computes the sha256 while writing; :meth:`close` fsyncs and returns ``(bytes, sha256)``.
    See [Note: streaming safetensors].
    """

    def __init__(
        self,
        path: Path,
        entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        meta = {"format": "pt", **(metadata or {})}
        assert all(isinstance(v, str) for v in meta.values()), "safetensors metadata values are strings"
        header: dict[str, Any] = {"__metadata__": meta}
        self._sizes: list[tuple[str, int, torch.dtype]] = []
        offset = 0
        for key, dtype, shape in entries:
            if key in header:
                raise ValueError(f"tensor {key!r} appears twice in {path.name}")
            nbytes = math.prod(shape) * dtype.itemsize
            header[key] = {
                "dtype": safetensors_code(dtype),
                "shape": [int(s) for s in shape],
                "data_offsets": [offset, offset + nbytes],
            }
            self._sizes.append((key, nbytes, dtype))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        if len(raw) > MAX_HEADER_BYTES:
            raise CheckpointError(
                f"cannot write {path}: its safetensors header would be {len(raw)} bytes, more "
                f"than the {MAX_HEADER_BYTES} bytes a reader accepts (MAX_HEADER_BYTES)"
            )
        self.path = path
        try:
            self._file = open(path, "xb", buffering=0)
        except OSError as error:
            raise write_failure(path, error) from error
        self._digest = hashlib.sha256()
        self._written = 0
        self._entry = 0
        self._entry_left = self._sizes[0][1] if self._sizes else 0
        try:
            self._raw_write(struct.pack("<Q", len(raw)) + raw)
        except BaseException:
            self._file.close()
            raise
        self._skip_empty()

    def _raw_write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        self._digest.update(view)
        try:
            while view.nbytes:
                n = self._file.write(view)
                view = view[n:]
                self._written += n
        except OSError as error:
            raise write_failure(self.path, error) from error

    def _skip_empty(self) -> None:
        while self._entry < len(self._sizes) and self._entry_left == 0:
            self._entry += 1
            self._entry_left = self._sizes[self._entry][1] if self._entry < len(self._sizes) else 0

    @property
    def current_key(self) -> str | None:
        return self._sizes[self._entry][0] if self._entry < len(self._sizes) else None

    def write(self, tensor: torch.Tensor) -> None:
        """Append (part of) the current tensor's values; cast to its dtype if needed."""
        if tensor.numel() == 0:
            return
        key, _, dtype = self._sizes[self._entry] if self._entry < len(self._sizes) else (None, 0, None)
        nbytes = tensor.numel() * (dtype.itemsize if dtype is not None else 0)
        if key is None or nbytes > self._entry_left:
            raise ValueError(f"{self.path.name}: more data than the header announced for {key!r}")
        assert dtype is not None  # a row of _sizes gives key and dtype together
        if tensor.device.type == "cuda":
            on_device = tensor if tensor.dtype == dtype else tensor.to(dtype)
            PinnedBounce(dtype, tensor.device, tensor.numel()).to_host(on_device, self._raw_write)
        elif tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            for chunk in chunks_of(tensor):  # bounded temporaries
                self._raw_write(bytes_of(chunk.to("cpu", dtype).contiguous()))
        else:
            self._raw_write(bytes_of(tensor))
        self._entry_left -= nbytes
        self._skip_empty()

    def close(self) -> tuple[int, str]:
        if self._entry < len(self._sizes):
            raise ValueError(f"{self.path.name}: tensor {self._sizes[self._entry][0]!r} was not fully written")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())  # a full disk may only show here (delayed allocation, NFS)
            self._file.close()
        except OSError as error:
            self._file.close()
            raise write_failure(self.path, error) from error
        return self._written, self._digest.hexdigest()

    def abort(self) -> None:
        self._file.close()


# --------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class StoredTensor(TensorSize):
    """Where one tensor lies: ``file`` (a name inside its directory) holds its ``numel``
    elements of ``dtype`` from byte ``offset`` on, flattened row-major."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of element 0 in the file


@dataclass(frozen=True)
class FileStamp:
    """Identity of a validated file, to detect it being replaced or changed afterwards."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, status: os.stat_result) -> FileStamp:
        return cls(status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: the file it was read from and every tensor in it."""

    stamp: FileStamp
    tensors: dict[str, StoredTensor]


def _read_exact(file: FileIO, offset: int, view: memoryview, where: str) -> None:
    """Read exactly ``view.nbytes`` bytes at ``offset`` into ``view``. The one place this
    module reads file data: every byte read goes through here."""
    file.seek(offset)
    while view.nbytes:
        n = file.readinto(view)
        if not n:
            raise CheckpointError(
                f"{where} ends early: wanted bytes up to {offset + view.nbytes}, got EOF "
                "(was it truncated after it was opened?)"
            )
        offset += n
        view = view[n:]


def _read_bytes(file: FileIO, offset: int, n: int, where: str) -> bytes:
    buffer = bytearray(n)
    _read_exact(file, offset, memoryview(buffer), where)
    return bytes(buffer)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a repeated key is an error (``json`` would keep the last one)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} appears twice")
        out[key] = value
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_header(file: FileIO, size: int, where: str) -> tuple[dict[str, Any], int]:
    """The JSON header of a safetensors file and the byte where its data starts."""
    if size < 8:
        raise CheckpointError(f"{where} is truncated or not a safetensors file ({size} bytes)")
    length = int.from_bytes(_read_bytes(file, 0, 8, where), "little")
    if length > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"{where} has a header length of {length} bytes, over the {MAX_HEADER_BYTES} "
            "bytes limit: not a safetensors file, or corrupted"
        )
    if 8 + length > size:
        raise CheckpointError(
            f"{where} is truncated or not a safetensors file: its header of {length} bytes "
            f"ends past the end of the file ({size} bytes)"
        )
    try:
        header = json.loads(_read_bytes(file, 8, length, where), object_pairs_hook=unique_keys)
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
        raise CheckpointError(
            f"{at} has data_offsets [{begin}, {end}) outside the file's {data_size} data bytes "
            "(truncated or corrupted file)"
        )
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(
            f"{at} has data_offsets [{begin}, {end}) ({end - begin} bytes), but shape {shape} "
            f"of {dtype_name(dtype)} needs {expected} bytes"
        )
    return StoredTensor(name, file, dtype, tuple(shape), data_start + begin)


def _check_tiling(tensors: Iterable[StoredTensor], data_start: int, data_size: int, where: str) -> None:
    """The tensors' bytes must cover the data area exactly, one after another, as
    ``safetensors`` requires: a gap or an overlap means a corrupted header."""
    position = 0
    for tensor in sorted(tensors, key=lambda t: (t.offset, t.nbytes)):
        begin = tensor.offset - data_start
        if begin != position:
            problem = (
                "overlaps the tensor before it" if begin < position else f"leaves bytes [{position}, {begin}) unused"
            )
            raise CheckpointError(
                f"{where}: the data of tensor {tensor.name!r} starts at byte {begin} and {problem} "
                "(tensors must tile the data area)"
            )
        position = begin + tensor.nbytes
    if position != data_size:
        raise CheckpointError(
            f"{where} has {data_size - position} bytes after the last tensor's data "
            "(the header does not describe the whole file)"
        )


def _parse_header(file: FileIO, status: os.stat_result, name: str, where: str) -> SafetensorsHeader:
    header, data_start = _read_header(file, status.st_size, where)
    data_size = status.st_size - data_start
    tensors = {}
    for key, info in header.items():
        if key == "__metadata__":
            _check_metadata(info, where)
        else:
            tensors[key] = _parse_entry(key, info, name, data_start, data_size, where)
    _check_tiling(tensors.values(), data_start, data_size, where)
    return SafetensorsHeader(FileStamp.of(status), tensors)


class SafetensorsReader:
    """One ``.safetensors`` file open for ranged reads; see [Note: byte-range reading].
    ``what`` names the file in errors (``"shard file"``).

    Opened without ``header``, it validates the file's header before any data is read --
    after checking the file's size and sha256 against ``expected_bytes`` and
    ``expected_sha256`` (what the manifest records), where given. Opened with the
    ``header`` read earlier, it reads nothing until asked and refuses a file that is no
    longer the one that header was read from.
    """

    def __init__(
        self,
        path: Path,
        what: str = "safetensors file",
        *,
        header: SafetensorsHeader | None = None,
        expected_bytes: int | None = None,
        expected_sha256: str | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.path = path
        self.where = f"{what} {path}"
        try:
            self._file = open_regular_file(path, what)
        except FileNotFoundError:
            raise CheckpointError(f"{self.where} is missing") from None
        except OSError as error:
            raise CheckpointError(f"cannot open {self.where}: {error.strerror or error}") from None
        try:
            status = os.fstat(self._file.fileno())
            if header is not None:
                if FileStamp.of(status) != header.stamp:
                    raise CheckpointError(f"{self.where} changed after the checkpoint was opened")
                self.header = header
                return
            self._verify(status.st_size, expected_bytes, expected_sha256, progress)
            self.header = _parse_header(self._file, status, path.name, self.where)
        except BaseException:
            self._file.close()
            raise

    def _verify(
        self, size: int, expected_bytes: int | None, expected_sha256: str | None, progress: Callable[[int], None] | None
    ) -> None:
        if expected_bytes is not None and size != expected_bytes:
            state = "truncated" if size < expected_bytes else "longer than recorded"
            raise CheckpointError(f"{self.where} is {state}: {size} bytes, the manifest says {expected_bytes}")
        if expected_sha256 is not None:
            digest, _ = sha256_file(self.path, progress)
            if digest != expected_sha256:
                raise CheckpointError(
                    f"checksum mismatch in {self.where}: sha256 {digest}, the manifest says "
                    f"{expected_sha256} (the file is corrupted)"
                )

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def tensors(self) -> dict[str, StoredTensor]:
        return self.header.tensors

    def read_into(self, stored: StoredTensor, first: int, dest: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> None:
        """Elements ``[first, first + dest.numel())`` of the flattened tensor ``stored`` into
        the 1-D ``dest`` (the stored dtype, or any dtype it casts to), reading only their bytes."""
        if dest.numel() == 0:
            return
        dest = dest.detach()  # a parameter's storage, filled in place without autograd
        where = f"{self.where} (tensor {stored.name!r})"
        itemsize = stored.dtype.itemsize
        offset = stored.offset + first * itemsize
        if dest.dtype == stored.dtype and dest.device.type == "cpu" and dest.is_contiguous():
            _read_exact(self._file, offset, bytes_of(dest), where)  # straight into place, no temporary
            return
        if dest.dtype == stored.dtype and dest.device.type == "cuda" and dest.is_contiguous():
            PinnedBounce(stored.dtype, dest.device, dest.numel(), chunk_bytes).from_file(
                dest, lambda at, view: _read_exact(self._file, at, view, where), offset
            )
            return
        step = max(1, chunk_bytes // itemsize)
        buffer = torch.empty(min(step, dest.numel()), dtype=stored.dtype)  # the one bounded chunk
        for start in range(0, dest.numel(), step):
            part = buffer[: min(step, dest.numel() - start)]
            _read_exact(self._file, offset + start * itemsize, bytes_of(part), where)
            dest[start : start + part.numel()].copy_(part)

    def close(self) -> None:
        self._file.close()


def read_header(path: Path, what: str = "safetensors file") -> SafetensorsHeader:
    """Open one safetensors file, validate its header, and close it again."""
    with SafetensorsReader(path, what) as reader:
        return reader.header


class OpenFiles:
    """Readers of many files, at most ``max_open`` of them open at once, the least recently
    used closed first; ``open_file(name)`` opens one."""

    def __init__(self, open_file: Callable[[str], SafetensorsReader], max_open: int = MAX_OPEN_FILES) -> None:
        if max_open < 1:
            raise ValueError(f"max_open must be at least 1, got {max_open}")
        self._open_file = open_file
        self._max_open = max_open
        self._readers: OrderedDict[str, SafetensorsReader] = OrderedDict()

    def __len__(self) -> int:
        return len(self._readers)

    def get(self, name: str) -> SafetensorsReader:
        reader = self._readers.get(name)
        if reader is None:
            reader = self._open_file(name)
            self._readers[name] = reader
            while len(self._readers) > self._max_open:
                self._readers.popitem(last=False)[1].close()
        self._readers.move_to_end(name)
        return reader

    def close(self) -> None:
        while self._readers:
            self._readers.popitem()[1].close()
