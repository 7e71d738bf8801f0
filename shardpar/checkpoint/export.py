"""``save_full``: the whole model in the Hugging Face layout, written by rank 0 one tensor at
a time from the pieces every rank sends it chunk by chunk (:mod:`shardpar.checkpoint.hf`).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import torch

from ..comm import collectives as C
from ..core.inventory import state_dict_hook_modules
from ..errors import CheckpointError
from ..facade import ShardedModule
from ..sizes import parse_bytes
from .dtypes import dtype_name, parse_dtype
from .hf import HFLayoutWriter
from .hf_config import config_files, floating_dtype, hf_config_of
from .host_bytes import CHUNK_BYTES
from .protocol import agree, collective_phase, flat, model_tensors
from .reorder import MemoryPiece, row_major_range, to_row_major


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


@collective_phase("save_full")
def save_full(
    path: str | os.PathLike[str],
    model: ShardedModule,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | str | None = None,
) -> list[str]:
    """Write the whole model in the Hugging Face layout into the directory ``path``.

    Every rank calls it; rank 0 writes ``model.safetensors`` (or numbered shards plus
    ``model.safetensors.index.json``). Parameters come from the ranks' checkpoint pieces
    (master copies), sent to rank 0 piece by piece in chunks of at most
    :data:`~shardpar.checkpoint.host_bytes.CHUNK_BYTES`, so no rank ever holds more than its shard
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
    if state_dict_hook_modules(engine.module, load=False):
        return _save_full_state_dict(out_dir, model, max_shard_size, dtype)
    try:
        max_bytes = parse_bytes(max_shard_size, "max_shard_size")
        out_dtype = _resolve_dtype(dtype)
        engine.storage.wait_for_params()
        # a reordered piece's values become a function making its row-major values (below)
        local: dict[tuple[str, int, int], torch.Tensor | Callable[[], torch.Tensor]] = {
            (p.name, *p.param_range): p.tensor for p in engine.save_pieces()
        }
        mine = [
            (name, start, end, dtype_name(cast(torch.Tensor, t).dtype))  # every one a tensor yet
            for (name, start, end), t in local.items()
        ]
    except Exception as error:
        problem = error
    everyone = agree(problem, "save_full", group, mine)

    # Pieces of tensors kept in another element order become the row-major ranges their ranks
    # write ([Note: reordered pieces] in reorder.py): the same plan on every rank.
    orders = engine.element_orders()
    reordered = [
        MemoryPiece(("model", name), start, end, cast(torch.Tensor, local.pop((name, start, end))))  # not made yet
        for name, start, end, _ in mine
        if orders[name].reorders
    ]
    held = [
        [(("model", name), start, end) for name, start, end, _ in listed if orders[name].reorders]
        for listed in everyone
    ]
    for piece in to_row_major(reordered, held, orders, rank, group):
        local[(piece.ref[1], piece.start, piece.end)] = piece.values

    inventory, _ = model_tensors(engine)
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
            entries = [(n, output_dtype(n, t), tuple(t.shape)) for n, _, t in inventory]
            json_files = config_files(hf_config_of(model.module), floating_dtype([d for _, d, _ in entries]))
            writer = HFLayoutWriter(out_dir, entries, max_bytes, json_files)
        except Exception as error:
            problem = error
    # Rank 0 keeps receiving after a write error so no sender is left blocked (the verdict
    # follows in the final agreement).
    with torch.no_grad():
        for name, kind, tensor in inventory:
            if kind == "buffer" or not pieces.get(name):
                if rank == 0:
                    problem = _write_chunk(writer, flat(tensor), problem)
                continue
            for start, end, owner, stored in pieces[name]:
                values = local[(name, start, end)] if owner == rank else None
                values = values() if callable(values) else values  # a reordered piece: made now, one at a time
                for first, last in _chunk_ranges(start, end, stored.itemsize):
                    if owner == rank:
                        assert values is not None  # this rank's own piece
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
                assert writer is not None  # rank 0 made it, or problem is set
                names = writer.close()
            elif writer is not None:
                writer.abort()
        except Exception as error:
            problem = error
    written: list[str] = agree(problem, "save_full", group, names)[0]  # rank 0's, on every rank
    return written


def _save_full_state_dict(
    out_dir: Path, model: ShardedModule, max_shard_size: int | str, dtype: torch.dtype | str | None
) -> list[str]:
    """:func:`save_full` of a model whose modules have state-dict hooks: what ``state_dict()``
    gives, the hooks run on full values (every rank then holds the whole model once, as plain
    torch's ``save_pretrained`` does), written by rank 0; entries sharing memory (tied weights)
    are written once, under their first name."""
    engine = model.engine
    problem: BaseException | None = None
    names: list[str] = []
    try:
        max_bytes = parse_bytes(max_shard_size, "max_shard_size")
        out_dtype = _resolve_dtype(dtype)
    except Exception as error:
        problem = error
    agree(problem, "save_full", engine.group)
    state = model.full_state_dict()  # collective: every rank
    if engine.rank == 0:
        try:
            written: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
            tensors: list[tuple[str, torch.Tensor]] = []
            for name, value in state.items():
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"state-dict entry '{name}' is a {type(value).__name__}, which the safetensors "
                        "layout cannot hold (save_full writes tensors only)"
                    )
                where = (value.data_ptr(), tuple(value.shape), value.dtype)
                if where not in written:
                    written[where] = name
                    cast_to = out_dtype if out_dtype is not None and value.is_floating_point() else value.dtype
                    tensors.append((name, value.to(cast_to)))
            entries = [(name, value.dtype, tuple(value.shape)) for name, value in tensors]
            json_files = config_files(hf_config_of(model.module), floating_dtype([d for _, d, _ in entries]))
            writer = HFLayoutWriter(out_dir, entries, max_bytes, json_files)
            try:
                for _, value in tensors:
                    writer.write(flat(value))
                names = writer.close()
            except BaseException:
                writer.abort()
                raise
        except Exception as error:
            problem = error
    files: list[str] = agree(problem, "save_full", engine.group, names)[0]  # rank 0's, on every rank
    return files


def _write_chunk(
    writer: HFLayoutWriter | None, chunk: torch.Tensor, problem: BaseException | None
) -> BaseException | None:
    if problem is None:
        try:
            assert writer is not None  # rank 0 made it, or problem is set
            writer.write(chunk)
        except Exception as error:
            return error
    return problem
