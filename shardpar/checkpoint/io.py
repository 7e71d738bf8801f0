"""The files of a checkpoint or an export, written and read without any process group:
streaming safetensors files, ranged reads, checksums, atomic commits, the Hugging Face
layout. What the files mean (the manifest) is :mod:`shardpar.checkpoint.format`; the
format is specified in ``docs/checkpoint-format.md``.

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
  :class:`FileView` seeks to the byte range and ``readinto``\\ s the destination tensor
  itself, so loading allocates nothing when the dtypes match, and one bounded chunk
  (:data:`CHUNK_BYTES`) when a cast is needed.

The tests read our files back with ``safetensors.safe_open`` and ``load_file``.

[Note: atomic commit]
A checkpoint is written into a hidden temporary directory next to its target (a rename
across file systems fails), every file fsynced, the manifest written last, then one rename
makes it visible. Replacing an existing checkpoint uses ``renameat2(RENAME_EXCHANGE)`` on
Linux, which swaps the two directories atomically, so the old checkpoint stays intact
until the new one is complete; elsewhere the old one is renamed aside first (a crash
between the two renames leaves the target absent, and :func:`latest_checkpoint` falls
back to the newest other valid checkpoint). ``latest`` is replaced via a temporary file.
The protocol around it (who verifies what) is in :func:`shardpar.checkpoint.save_checkpoint`.
A Hugging Face export (:class:`HFLayoutWriter`) is committed the same way, so it too
appears whole or not at all.

[Note: only regular files are read]
Every file of a checkpoint is opened through :func:`open_regular_file`, which refuses
anything but a regular file *before* it could block or never end: opening a FIFO for
reading waits for a writer forever, and a symlink to ``/dev/zero`` never reaches its end.
It checks with ``stat`` first (so no device is even opened), then opens with
``O_NONBLOCK`` and checks again with ``fstat`` (a swap between the two still cannot block).
Small files read whole (the manifest, ``latest``) also have a size cap
(:func:`read_regular_file`).

[Note: sweeping temporaries]
A save killed mid-write leaves ``.<name>.tmp-<12 hex digits>`` next to its target (and
``write_text_atomic`` a ``.<file>.tmp-...`` file). A later save to the *same* target removes
them at once (:func:`remove_stale_temps`; one target is never written by two saves at a
time). When every step gets its own directory no later save has that target, so rank 0
also removes, at the start of every save, the temporaries of *other* targets in the same
parent (:func:`remove_abandoned_temps`), under two conditions: the name has exactly that
pattern (:data:`TEMP_NAME`), and nothing in it was modified for :data:`ABANDONED_AFTER_S`
(an hour). A save in progress keeps modifying its temporary while the ranks write; its
longest quiet stretch is the read-back verification plus one agreement, bounded by the
collective timeout (5 minutes by default). So a temporary untouched for an hour belongs to
no running save -- unless another job saves into the *same parent* with a collective
timeout above an hour: give such jobs a parent of their own. Symlinks are unlinked, never
followed.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import torch

from ..errors import CheckpointError

CHUNK_BYTES = 16 * 2**20
"""The bounded buffer: the most bytes copied through a temporary at once (casts, sends)."""
_HASH_CHUNK = 8 * 2**20
_MAX_HEADER_BYTES = 512 * 2**20

# manifest dtype name -> (torch dtype, safetensors dtype)
_DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "float64": (torch.float64, "F64"),
    "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"),
    "bfloat16": (torch.bfloat16, "BF16"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"),
    "int16": (torch.int16, "I16"),
    "int8": (torch.int8, "I8"),
    "uint64": (torch.uint64, "U64"),
    "uint32": (torch.uint32, "U32"),
    "uint16": (torch.uint16, "U16"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"),
    "complex64": (torch.complex64, "C64"),
}
_NAME_OF = {dtype: name for name, (dtype, _) in _DTYPES.items()}
_FROM_ST = {st: dtype for dtype, st in _DTYPES.values()}


# --------------------------------------------------------------------------- small helpers

def is_storable(dtype: torch.dtype) -> bool:
    """Whether a safetensors file can hold tensors of ``dtype``."""
    return dtype in _NAME_OF


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of ``dtype`` (``torch.float32`` -> ``"float32"``)."""
    try:
        return _NAME_OF[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in a safetensors file") from None

def parse_dtype(name: Any, where: str = "") -> torch.dtype:
    """Inverse of :func:`dtype_name`; accepts the shorthands ``bf16``, ``fp16``, ``fp32``."""
    shorthand = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}
    key = shorthand.get(str(name).lower().removeprefix("torch."), str(name).lower().removeprefix("torch."))
    if not isinstance(name, str) or key not in _DTYPES:
        raise CheckpointError(f"{where}unknown dtype {name!r} (known: {', '.join(_DTYPES)})")
    return _DTYPES[key][0]

def parse_safetensors_dtype(name: Any, where: str = "") -> torch.dtype:
    """The torch dtype of a safetensors header's dtype code (``"BF16"`` -> ``torch.bfloat16``)."""
    if not isinstance(name, str) or name not in _FROM_ST:
        raise CheckpointError(f"{where}unknown dtype {name!r} (known: {', '.join(_FROM_ST)})")
    return _FROM_ST[name]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: directories cannot be opened; rename durability is the OS's
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

def write_failure(path: Path, error: OSError) -> CheckpointError:
    """The error for a failed write to ``path``: the OSError of a ``write`` or ``fsync`` names
    no file, and "No space left on device" alone does not say which disk is full."""
    if error.errno == errno.ENOSPC:
        reason = "the disk is full (no space left on the device)"
    elif error.errno == getattr(errno, "EDQUOT", None):
        reason = "the disk quota is exhausted"
    else:
        reason = error.strerror or str(error)
    return CheckpointError(f"cannot write {path}: {reason}")

def write_text_synced(path: Path, text: str, name_in_errors: Path | None = None) -> None:
    """Create ``path`` (it must not exist) holding ``text``, fsynced; errors name
    ``name_in_errors`` (default ``path``)."""
    try:
        with open(path, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except OSError as error:
        raise write_failure(name_in_errors or path, error) from error

def write_text_atomic(path: Path, text: str) -> None:
    """Write ``path`` through a temporary file in the same directory and one ``os.replace``."""
    tmp = temp_sibling(path)
    try:
        write_text_synced(tmp, text, name_in_errors=path)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)

_FILE_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
               stat.S_IFDIR: "a directory", stat.S_IFSOCK: "a socket"}

def _check_regular(mode: int, path: Path, what: str) -> None:
    if not stat.S_ISREG(mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a file")
        raise CheckpointError(f"{what} {path} is not a regular file ({kind}); refusing to read it")

def open_regular_file(path: Path, what: str) -> BinaryIO:
    """``open(path, "rb", buffering=0)`` for a regular file only, refused before it could
    block; see [Note: only regular files are read]. ``what`` names the file in errors
    ("shard file"). A missing file raises FileNotFoundError."""
    _check_regular(os.stat(path).st_mode, path, what)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        _check_regular(os.fstat(fd).st_mode, path, what)
        if hasattr(os, "O_NONBLOCK"):
            os.set_blocking(fd, True)  # reads of a regular file wait for the disk, as usual
        return os.fdopen(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise

def read_regular_file(path: Path, what: str, max_bytes: int) -> bytes:
    """All bytes of a small regular file, refusing one larger than ``max_bytes`` before
    reading it (and one that grows past it while being read)."""
    with open_regular_file(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray()
        while size <= max_bytes and len(data) <= max_bytes:
            chunk = f.read(max_bytes + 1 - len(data))
            if not chunk:
                return bytes(data)
            data += chunk
    raise CheckpointError(f"{what} {path} is {max(size, len(data))} bytes, more than the {max_bytes} bytes "
                          f"a {what} may have; refusing to read it")

def _exchange_paths(a: Path, b: Path) -> bool:
    """Atomically swap two existing paths (Linux ``renameat2``); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))

TEMP_NAME = re.compile(r"\.(?P<target>.+)\.(?P<purpose>tmp|old)-[0-9a-f]{12}")
"""Every temporary shardpar makes (:func:`temp_sibling`); nothing else is ever swept."""
ABANDONED_AFTER_S = 3600.0
"""A temporary of another target untouched this long is abandoned; see [Note: sweeping temporaries]."""

def temp_sibling(target: Path, purpose: str = "tmp") -> Path:
    """A fresh hidden name next to ``target`` (same file system, so renames are atomic)."""
    return target.parent / f".{target.name}.{purpose}-{uuid.uuid4().hex[:12]}"

def make_temp_dir(target: Path) -> Path:
    """A fresh temporary directory next to ``target``, its parents created; a file where a
    parent should be is named (mkdir's error would name only the temporary)."""
    for ancestor in target.parents:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise CheckpointError(f"cannot create {target}: {ancestor} is not a directory")
            break
    tmp = temp_sibling(target)
    tmp.mkdir(parents=True)
    return tmp

def _temporaries(parent: Path) -> list[tuple[os.DirEntry, str]]:
    """``(entry, target name)`` of every temporary in ``parent``."""
    try:
        entries = list(os.scandir(parent))
    except OSError:  # missing, or not a directory: nothing to sweep
        return []
    return [(entry, match["target"]) for entry in entries if (match := TEMP_NAME.fullmatch(entry.name))]

def _remove_entry(entry: os.DirEntry) -> None:
    """A directory with its contents; anything else (a symlink included) is unlinked."""
    try:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
    except OSError:
        pass  # gone already, or not ours to remove: leave it

def _last_modified(entry: os.DirEntry) -> float:
    """Newest mtime of a temporary and (for a directory) of its entries; +inf if it changes
    under us (another saver is busy with it)."""
    try:
        newest = entry.stat(follow_symlinks=False).st_mtime
        if entry.is_dir(follow_symlinks=False):
            with os.scandir(entry.path) as children:
                for child in children:
                    newest = max(newest, child.stat(follow_symlinks=False).st_mtime)
        return newest
    except OSError:
        return math.inf

def remove_stale_temps(target: Path) -> None:
    """Leftovers of interrupted saves to ``target`` (never visible as checkpoints)."""
    for entry, name in _temporaries(target.parent):
        if name == target.name:
            _remove_entry(entry)

def remove_abandoned_temps(parent: Path, older_than_s: float = ABANDONED_AFTER_S) -> None:
    """Temporaries of *any* target in ``parent`` that nothing modified for ``older_than_s``;
    see [Note: sweeping temporaries]."""
    cutoff = time.time() - older_than_s
    for entry, _ in _temporaries(parent):
        if _last_modified(entry) < cutoff:
            _remove_entry(entry)

def commit_directory(tmp: Path, target: Path) -> None:
    """Make the complete directory ``tmp`` visible as ``target``; see [Note: atomic commit]."""
    fsync_dir(tmp)
    if target.exists() and _exchange_paths(tmp, target):
        fsync_dir(target.parent)
        shutil.rmtree(tmp)  # now holds the previous checkpoint
        return
    if target.exists():
        old = temp_sibling(target, "old")
        os.rename(target, old)
        os.rename(tmp, target)
        fsync_dir(target.parent)
        shutil.rmtree(old)
        return
    os.rename(tmp, target)
    fsync_dir(target.parent)

def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> tuple[str, int]:
    """Streaming sha256 (bounded memory) and size of a file."""
    digest = hashlib.sha256()
    size = 0
    buffer = bytearray(_HASH_CHUNK)
    view = memoryview(buffer)
    with open_regular_file(path, "file") as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            size += n
            if progress is not None:
                progress(n)
    return digest.hexdigest(), size

def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable view of its storage (no copy)."""
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")

def chunks_of(tensor: torch.Tensor, chunk_bytes: int = CHUNK_BYTES) -> Iterator[torch.Tensor]:
    """1-D slices of a flattened tensor, each at most ``chunk_bytes`` (at least 1 element)."""
    flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().flatten()
    step = max(1, chunk_bytes // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]

class _PinnedBounce:
    """[Note: checkpoint bytes and the GPU] Bytes of a CUDA tensor reach the file through two
    pinned host buffers taken in turn: chunk k+1 is copied without blocking while chunk k is
    written, and a buffer is reused only after the event behind its copy. Pageable memory
    would make every copy synchronous and stop the host for each. Reads take the same way
    back (file -> pinned buffer -> device, without blocking)."""

    def __init__(self, dtype: torch.dtype, device: torch.device, numel: int, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.step = max(1, min(numel, chunk_bytes // dtype.itemsize))  # a small tensor: small buffers
        on_gpu = device.type == "cuda"
        self.buffers = [torch.empty(self.step, dtype=dtype, pin_memory=on_gpu) for _ in range(2)]
        self.events: list[Any] = [None, None]
        self.device = device
        self._on_gpu = on_gpu
        """Else a CPU tensor (tests): the same turns, every copy done when it returns."""

    def _take(self, turn: int, numel: int) -> torch.Tensor:
        event = self.events[turn % 2]
        if event is not None:
            event.synchronize()  # its previous copy is done: the buffer may be reused
        return self.buffers[turn % 2][:numel]

    def _record(self, turn: int) -> None:
        if not self._on_gpu:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.events[turn % 2] = event

    def to_host(self, tensor: torch.Tensor, write: Callable[[memoryview], None]) -> None:
        """Write ``tensor``'s values (on the GPU, already in the buffers' dtype) through ``write``."""
        flat = tensor.detach().reshape(-1) if tensor.is_contiguous() else tensor.detach().flatten()
        pending: tuple[int, torch.Tensor] | None = None
        for turn, start in enumerate(range(0, flat.numel(), self.step)):
            part = flat[start : start + self.step]
            staged = self._take(turn, part.numel())
            staged.copy_(part, non_blocking=True)
            self._record(turn)
            if pending is not None:
                self._flush(*pending, write)
            pending = (turn, staged)
        if pending is not None:
            self._flush(*pending, write)

    def _flush(self, turn: int, staged: torch.Tensor, write: Callable[[memoryview], None]) -> None:
        if self.events[turn % 2] is not None:
            self.events[turn % 2].synchronize()
        write(_bytes_of(staged))

    def from_file(self, dest: torch.Tensor, readinto: Callable[[int, memoryview], None], offset: int) -> None:
        """Fill ``dest`` (on the GPU, in the buffers' dtype) from the bytes at ``offset``."""
        flat = dest.view(-1)
        itemsize = dest.element_size()
        for turn, start in enumerate(range(0, flat.numel(), self.step)):
            part = flat[start : start + self.step]
            staged = self._take(turn, part.numel())
            readinto(offset + start * itemsize, _bytes_of(staged))
            part.copy_(staged, non_blocking=True)
            self._record(turn)
        for event in self.events:
            if event is not None:
                event.synchronize()  # dest is complete when the load returns

# --------------------------------------------------------------------------- writing

class SafetensorsWriter:
    """Streams one ``.safetensors`` file: the header (every tensor's dtype, shape and offsets)
    first, then each tensor's bytes in header order, possibly in several ``write`` calls.

    Computes the sha256 while writing; :meth:`close` fsyncs and returns ``(bytes, sha256)``.
    See [Note: streaming safetensors].
    """

    def __init__(
        self, path: Path, entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
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
            header[key] = {"dtype": _DTYPES[dtype_name(dtype)][1], "shape": [int(s) for s in shape],
                           "data_offsets": [offset, offset + nbytes]}
            self._sizes.append((key, nbytes, dtype))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
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
        if tensor.device.type == "cuda":
            on_device = tensor if tensor.dtype == dtype else tensor.to(dtype)
            _PinnedBounce(dtype, tensor.device, tensor.numel()).to_host(on_device, self._raw_write)
        elif tensor.dtype != dtype or tensor.device.type != "cpu" or not tensor.is_contiguous():
            for chunk in chunks_of(tensor):  # bounded temporaries
                self._raw_write(_bytes_of(chunk.to("cpu", dtype).contiguous()))
        else:
            self._raw_write(_bytes_of(tensor))
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

def _expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckpointError(message)

@dataclass(frozen=True)
class _HeaderEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of element 0 in the file

class FileView:
    """One ``.safetensors`` file opened for ranged reads. Before any data is read, its size
    and sha256 are checked against the expected ones (where given) and its header against
    the file: every tensor's data must lie inside it."""

    def __init__(self, path: Path, expected_bytes: int | None = None, expected_sha256: str | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.path = path
        try:
            self._file = open_regular_file(path, "shard file")
        except FileNotFoundError:
            raise CheckpointError(f"shard file {path} is missing") from None
        except OSError as error:
            raise CheckpointError(f"cannot open shard file {path}: {error}") from None
        try:
            self.size = os.fstat(self._file.fileno()).st_size
            if expected_bytes is not None and self.size != expected_bytes:
                state = "truncated" if self.size < expected_bytes else "longer than recorded"
                raise CheckpointError(f"shard file {path} is {state}: {self.size} bytes, the manifest says "
                                      f"{expected_bytes}")
            if expected_sha256 is not None:
                digest, _ = sha256_file(path, progress)
                if digest != expected_sha256:
                    raise CheckpointError(f"checksum mismatch in shard file {path}: sha256 {digest}, the "
                                          f"manifest says {expected_sha256} (the file is corrupted)")
            self.header = self._read_header()
        except BaseException:
            self._file.close()
            raise

    def _read_header(self) -> dict[str, _HeaderEntry]:
        bad = f"shard file {self.path} is truncated or not a safetensors file"
        _expect(self.size >= 8, bad)
        (length,) = struct.unpack("<Q", self._pread(0, 8))
        _expect(8 + length <= self.size and length <= _MAX_HEADER_BYTES, f"{bad} (header of {length} bytes)")
        try:
            header = json.loads(bytes(self._pread(8, length)))
        except ValueError as error:
            raise CheckpointError(f"{bad} (header is not JSON: {error})") from None
        _expect(isinstance(header, dict), bad)
        entries = {}
        data_start, data_size = 8 + length, self.size - 8 - length
        for key, info in header.items():
            if key == "__metadata__":
                continue
            try:
                dtype = _FROM_ST[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"{bad} (bad header entry for {key!r})") from None
            _expect(0 <= begin <= end <= data_size and end - begin == math.prod(shape) * dtype.itemsize,
                    f"{bad} (data of {key!r} at [{begin}, {end}) does not fit {data_size} data bytes)")
            entries[key] = _HeaderEntry(dtype, shape, data_start + begin)
        return entries

    def _pread(self, offset: int, n: int) -> memoryview:
        buffer = bytearray(n)
        self._readinto(offset, memoryview(buffer))
        return memoryview(buffer)

    def _readinto(self, offset: int, view: memoryview) -> None:
        self._file.seek(offset)
        while view.nbytes:
            n = self._file.readinto(view)
            if not n:
                raise CheckpointError(f"shard file {self.path} is truncated (ends inside tensor data)")
            view = view[n:]

    def tensor_info(self, key: str, dtype: torch.dtype, numel: int) -> _HeaderEntry:
        info = self.header.get(key)
        _expect(info is not None, f"shard file {self.path} has no tensor {key!r} (the manifest says it does)")
        _expect(info.dtype == dtype and math.prod(info.shape) == numel,
                f"tensor {key!r} in shard file {self.path} is {dtype_name(info.dtype)} {list(info.shape)}, "
                f"the manifest says {dtype_name(dtype)} [{numel}]")
        return info

    def read_into(self, info: _HeaderEntry, first: int, dest: torch.Tensor) -> None:
        """Elements ``[first, first + dest.numel())`` of a stored 1-D tensor into ``dest``."""
        offset = info.offset + first * info.dtype.itemsize
        if dest.dtype == info.dtype and dest.device.type == "cpu" and dest.is_contiguous():
            self._readinto(offset, _bytes_of(dest))
            return
        if dest.dtype == info.dtype and dest.device.type == "cuda" and dest.is_contiguous():
            _PinnedBounce(info.dtype, dest.device, dest.numel()).from_file(dest, self._readinto, offset)
            return
        step = max(1, CHUNK_BYTES // info.dtype.itemsize)
        buffer = torch.empty(min(step, dest.numel()), dtype=info.dtype)
        flat = dest.view(-1)
        for start in range(0, dest.numel(), step):
            part = buffer[: min(step, dest.numel() - start)]
            self._readinto(offset + start * info.dtype.itemsize, _bytes_of(part))
            flat[start : start + part.numel()].copy_(part)

    def close(self) -> None:
        self._file.close()

# --------------------------------------------------------------------------- Hugging Face layout

_EXPORT_FILE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
"""The files of a Hugging Face layout export: an export replaces every one of them."""

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

    def __init__(self, out_dir: Path, entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 max_shard_bytes: int, json_files: dict[str, Any] | None = None) -> None:
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
        self.names = ["model.safetensors"] if count == 1 else [
            f"model-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
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
                write_text_synced(self._dir / "model.safetensors.index.json", json.dumps(
                    {"metadata": {"total_size": self.total_size}, "weight_map": self.weight_map}, indent=2) + "\n")
            for name, content in self._json_files.items():
                write_text_synced(self._dir / name, json.dumps(content, indent=2, sort_keys=True) + "\n")
            _carry_over(self.out_dir, self._dir, lambda name: bool(_EXPORT_FILE.fullmatch(name))
                        or name in self._json_files)
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
