"""Reading a shardpar checkpoint: any range of any tensor, from whichever rank files hold its
pieces. The manifest (:mod:`shardpar.checkpoint.format`) says where each piece lies; every
file is read by byte range through :class:`~shardpar.checkpoint.io.SafetensorsReader`, after
its size and sha256 are checked against the manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from .dtypes import dtype_name
from .format import Manifest, StoredPiece, TensorEntry
from .host_bytes import CHUNK_BYTES
from .io import MAX_OPEN_FILES, OpenFiles, SafetensorsReader, StoredTensor


@dataclass
class PieceRead:
    """Elements ``[first, first + dest.numel())`` of the stored ``piece`` of ``entry`` into the
    1-D ``dest``."""

    entry: TensorEntry
    piece: StoredPiece
    first: int  # element offset inside the stored piece
    dest: torch.Tensor  # 1-D

    @property
    def file(self) -> str:
        return self.piece.file


class CheckpointReader:
    """Reads ranges of a checkpoint's tensors from whichever files hold them.

    Each file is verified (size, sha256) the first time it is opened; at most
    ``max_open`` files stay open at once.
    """

    def __init__(
        self,
        manifest: Manifest,
        verify: bool = True,
        max_open: int = MAX_OPEN_FILES,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.manifest = manifest
        self.verify = verify
        self.progress = progress
        self._files = OpenFiles(self._open, max_open)
        self._verified: set[str] = set()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _open(self, name: str) -> SafetensorsReader:
        record = self.manifest.files[name]
        verify = self.verify and name not in self._verified
        reader = SafetensorsReader(
            self.manifest.directory / name,
            "shard file",
            expected_bytes=record.bytes,
            expected_sha256=record.sha256 if verify else None,
            progress=self.progress,
        )
        self._verified.add(name)
        return reader

    def file(self, name: str) -> SafetensorsReader:
        """The open, verified file ``name``."""
        return self._files.get(name)

    def verify_files(self, names: Iterable[str]) -> None:
        """Check (and open) these files now, before any data is read from them."""
        for name in sorted(set(names)):
            self.file(name)

    def stored(self, entry: TensorEntry, piece: StoredPiece) -> StoredTensor:
        """Where ``piece`` of ``entry`` lies in its file, which must hold it as the manifest says."""
        file = self.file(piece.file)
        stored = file.tensors.get(piece.key)
        if stored is None:
            raise CheckpointError(f"{file.where} has no tensor {piece.key!r} (the manifest says it does)")
        numel = piece.end - piece.start
        if stored.dtype != entry.dtype or stored.numel != numel:
            raise CheckpointError(
                f"tensor {piece.key!r} in {file.where} is {dtype_name(stored.dtype)} "
                f"{list(stored.shape)}, the manifest says {dtype_name(entry.dtype)} [{numel}]"
            )
        return stored

    def plan(self, entry: TensorEntry, start: int, end: int, dest: torch.Tensor) -> list[PieceRead]:
        """Reads that fill ``dest`` (1-D, ``end - start`` elements) with ``entry[start:end]``."""
        assert dest.numel() == end - start, (entry.name, start, end, dest.numel())
        return [
            PieceRead(entry, piece, a - piece.start, dest[a - start : b - start])
            for piece, a, b in entry.overlapping(start, end)
        ]

    def run(self, reads: list[PieceRead]) -> None:
        """Execute reads grouped by file, in file order (sequential access per file)."""
        for read in sorted(reads, key=lambda r: (r.piece.file, r.piece.key, r.first)):
            self.file(read.file).read_into(self.stored(read.entry, read.piece), read.first, read.dest)

    def read(self, entry: TensorEntry, start: int, end: int, dest: torch.Tensor) -> None:
        self.run(self.plan(entry, start, end, dest))

    def iter_range(self, entry: TensorEntry, start: int, end: int) -> Iterator[torch.Tensor]:
        """``entry[start:end]`` in order, as 1-D chunks of at most :data:`CHUNK_BYTES` read into
        one reused buffer (consume each chunk before asking for the next)."""
        step = max(1, CHUNK_BYTES // entry.dtype.itemsize)
        buffer = torch.empty(min(step, max(0, end - start)), dtype=entry.dtype)
        for first in range(start, end, step):
            last = min(end, first + step)
            part = buffer[: last - first]
            self.read(entry, first, last, part)
            yield part

    def close(self) -> None:
        self._files.close()
