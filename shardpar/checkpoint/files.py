"""The file system under a checkpoint or an export, made safe to trust: files written and
fsynced with errors that name them, a directory made visible by one atomic rename, only
regular files read, temporaries of killed saves swept, file names kept inside their
directory. Nothing here knows what the files hold.

[Note: atomic commit]
A checkpoint is written into a hidden temporary directory next to its target (a rename
across file systems fails), every file fsynced, the manifest written last, then one rename
makes it visible. Replacing an existing checkpoint uses ``renameat2(RENAME_EXCHANGE)`` on
Linux, which swaps the two directories atomically, so the old checkpoint stays intact
until the new one is complete; elsewhere the old one is renamed aside first (a crash
between the two renames leaves the target absent, and
:func:`~shardpar.checkpoint.format.latest_checkpoint` falls back to the newest other valid
checkpoint). ``latest`` is replaced via a temporary file. The protocol around it (who
verifies what) is in :func:`shardpar.checkpoint.save_checkpoint`. A Hugging Face export
(:class:`~shardpar.checkpoint.hf.HFLayoutWriter`) is committed the same way, so it too
appears whole or not at all.

[Note: only regular files are read]
Every file of a checkpoint or a Hugging Face directory is opened through
:func:`open_regular_file`, which refuses anything but a regular file *before* it could
block or never end: opening a FIFO for reading waits for a writer forever, and a symlink to
``/dev/zero`` never reaches its end. It checks with ``stat`` first (so no device is even
opened), then opens with ``O_NONBLOCK`` and checks again with ``fstat`` (a swap between the
two still cannot block). Symlinks to regular files are followed: the Hugging Face cache
links snapshot files to blobs. Small files read whole (the manifest, ``latest``, an index)
also have a size cap (:func:`read_regular_file`).

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
import math
import os
import re
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Collection
from io import FileIO
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

_HASH_CHUNK = 8 * 2**20


def check_file_name(name: Any, where: str, reserved: Collection[str] = ()) -> str:
    """A file named by a manifest or index must be a plain name inside its directory (and
    none of ``reserved``); refused names are a CheckpointError naming ``where``."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{where}: file name {name!r} is not a string")
    if os.path.isabs(name) or name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        raise CheckpointError(f"{where}: file name {name!r} is absolute; refusing to read outside the checkpoint")
    if ".." in re.split(r"[/\\]", name):
        raise CheckpointError(f"{where}: file name {name!r} contains '..'; refusing to read outside the checkpoint")
    if "/" in name or "\\" in name or "\0" in name or name == "." or name in reserved:
        raise CheckpointError(f"{where}: file name {name!r} is not a plain file name")
    return name


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


_FILE_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
    stat.S_IFSOCK: "a socket",
}


def _check_regular(mode: int, path: Path, what: str) -> None:
    if not stat.S_ISREG(mode):
        kind = _FILE_KINDS.get(stat.S_IFMT(mode), "not a file")
        raise CheckpointError(f"{what} {path} is not a regular file ({kind}); refusing to read it")


def open_regular_file(path: Path, what: str) -> FileIO:
    """``open(path, "rb", buffering=0)`` for a regular file only, refused before it could
    block; see [Note: only regular files are read]. ``what`` names the file in errors
    ("shard file"). A missing file raises FileNotFoundError."""
    _check_regular(os.stat(path).st_mode, path, what)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
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
    article = "an" if what[:1] in "aeiou" else "a"
    raise CheckpointError(
        f"{what} {path} is {max(size, len(data))} bytes, more than the {max_bytes} bytes "
        f"{article} {what} may have; refusing to read it"
    )


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


def _temporaries(parent: Path) -> list[tuple[os.DirEntry[str], str]]:
    """``(entry, target name)`` of every temporary in ``parent``."""
    try:
        entries = list(os.scandir(parent))
    except OSError:  # missing, or not a directory: nothing to sweep
        return []
    return [(entry, match["target"]) for entry in entries if (match := TEMP_NAME.fullmatch(entry.name))]


def _remove_entry(entry: os.DirEntry[str]) -> None:
    """A directory with its contents; anything else (a symlink included) is unlinked."""
    try:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
    except OSError:
        pass  # gone already, or not ours to remove: leave it


def _last_modified(entry: os.DirEntry[str]) -> float:
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
