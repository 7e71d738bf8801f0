"""``shardpar.load_pretrained``: weights in the Hugging Face layout, straight into a wrapped model.

Every rank opens the directory (``model.safetensors``, or ``model.safetensors.index.json``
and its shards), validates every header, and then reads only the byte ranges of the elements
it keeps: its shards at stage 3, whole parameters at stages 0-2 ([Note: byte-range reading]
in ``io.py``). Nothing is broadcast and no file is deserialised whole; values are cast to the
parameters' dtypes chunk by chunk, so a rank's peak is its model state plus one read chunk.
Tied weights are stored once and fill every name tied to them; missing and unexpected keys
are reported as ``transformers`` reports them ([Note: missing and unexpected keys]).

With ``shardpar.wrap`` of a meta-device model this is how a model larger than one rank starts
from pretrained weights: the initialisation fills what the checkpoint lacks, then this
overwrites the rest, and the full model never exists on any rank.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..comm import watch
from ..core.inventory import state_dict_hook_modules
from ..engines import Engine
from ..errors import CheckpointError
from ..facade import sharded_module_of
from .hf import HFCheckpoint, RangeRead, open_hf_checkpoint
from .hf_keys import KeyReport, hf_ignore_patterns, match_keys, tied_groups
from .protocol import agree, buffer_target, model_tensors, read_on_every_rank
from .reorder import ReorderedReads


def load_pretrained(model: Any, path: str | os.PathLike[str], strict: bool = True) -> KeyReport:
    """Load a Hugging Face safetensors checkpoint into ``model`` (a ``ShardedModule``) on every
    rank, at any stage and world size. Returns ``missing_keys`` and ``unexpected_keys``;
    with ``strict`` either being non-empty is a :class:`shardpar.CheckpointError` (raised
    before anything is read). Bad files, shapes, or names in the index are
    ``CheckpointError``\\ s naming the tensor or file, on every rank."""
    sharded = sharded_module_of(model, "shardpar.load_pretrained")  # or a torch.compile wrapper of it
    engine = sharded.engine
    group = engine.group
    if state_dict_hook_modules(engine.module, load=True):
        return _load_through_hooks(sharded, path, strict)
    with watch.operation("load_pretrained"):
        watch.meet(group, "load_pretrained")
        problem: BaseException | None = None
        checkpoint = None
        report = KeyReport([], [])
        reads: list[RangeRead] = []
        reordered = ReorderedReads()  # pieces of tensors kept in another element order
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # buffers that cannot be read into in place
        try:
            try:
                checkpoint = open_hf_checkpoint(path)
                report, reads, staged = _plan(engine, checkpoint, strict, reordered)
            except Exception as error:
                problem = error
            agree(problem, "load_pretrained", group)
            assert checkpoint is not None  # agree raised on every rank if any could not open it

            def read_all() -> None:
                checkpoint.read_ranges(reads)
                reordered.run(checkpoint.read_ranges)

            read_on_every_rank(read_all, staged, "load_pretrained", group)
        finally:
            if checkpoint is not None:
                checkpoint.close()
        engine.storage.after_load()
    return report


def _load_through_hooks(model: Any, path: str | os.PathLike[str], strict: bool) -> KeyReport:
    """``load_pretrained`` of a model whose modules have load hooks (a fused QKV weight stored
    split): only torch's ``load_state_dict`` knows which stored tensor reaches which parameter,
    so every rank reads every stored tensor whole and runs it on the full values ([Note: full
    values in the module]), as plain torch's loading of the file does. Missing and unexpected
    keys are torch's, less the patterns a ``transformers`` model ignores; with ``strict`` any
    left is a CheckpointError and nothing is written."""
    engine = model.engine
    group = engine.group
    with watch.operation("load_pretrained"):
        watch.meet(group, "load_pretrained")
        problem: BaseException | None = None
        checkpoint = None
        state: dict[str, torch.Tensor] = {}
        try:
            try:
                checkpoint = open_hf_checkpoint(path)
                reads = []
                for name, (dtype, shape) in checkpoint.tensors.items():
                    state[name] = torch.empty(shape, dtype=dtype, device=engine.device)
                    reads.append(RangeRead(name, 0, state[name].numel(), state[name].view(-1)))
            except Exception as error:
                problem = error
            agree(problem, "load_pretrained", group)
            assert checkpoint is not None  # agree raised on every rank if any could not open it
            read_on_every_rank(lambda: checkpoint.read_ranges(reads), [], "load_pretrained", group)
        finally:
            if checkpoint is not None:
                checkpoint.close()
        ignore_missing, ignore_unexpected = hf_ignore_patterns(engine.module)

        def check(result: Any) -> KeyReport:
            # torch's keys, filtered as transformers filters them (nothing provided, nothing known)
            report = match_keys(
                result.unexpected_keys,
                result.missing_keys,
                {},
                ignore_missing=ignore_missing,
                ignore_unexpected=ignore_unexpected,
            )
            if strict and (report.missing_keys or report.unexpected_keys):
                raise CheckpointError(
                    f"{checkpoint.directory}: missing keys {report.missing_keys or 'none'}; unexpected keys "
                    f"{report.unexpected_keys or 'none'} (after the model's load hooks; "
                    "load_pretrained(..., strict=False) loads what matches)"
                )
            return report

        problem = None
        report = KeyReport([], [])
        try:
            report = model.module_state.load_checked(state, check)
        except Exception as error:
            problem = error
        agree(problem, "load_pretrained", group)
    return report


def _plan(
    engine: Engine, checkpoint: HFCheckpoint, strict: bool, reordered: ReorderedReads
) -> tuple[KeyReport, list[RangeRead], list[tuple[torch.Tensor, torch.Tensor]]]:
    inventory, aliases = model_tensors(engine)
    stored = checkpoint.tensors
    ignore_missing, ignore_unexpected = hf_ignore_patterns(engine.module)
    report = match_keys(
        stored,
        [name for name, _, _ in inventory] + list(aliases),
        aliases,
        ignore_missing=ignore_missing,
        ignore_unexpected=ignore_unexpected,
    )
    if strict and (report.missing_keys or report.unexpected_keys):
        raise CheckpointError(
            f"{checkpoint.directory}: missing keys {report.missing_keys or 'none'}; unexpected keys "
            f"{report.unexpected_keys or 'none'} (load_pretrained(..., strict=False) loads what matches)"
        )
    # Which stored tensor supplies each of the model's tensors: its own name, else any name tied to it.
    tied = tied_groups(aliases)
    source: dict[str, str] = {}
    for name, _, _ in inventory:
        for candidate in [name, *sorted(tied.get(name, ()))]:
            if candidate in stored:
                source[name] = candidate
                break
    tensors = {name: tensor for name, _, tensor in inventory}
    checkpoint.check_shapes({source[name]: tuple(tensors[name].shape) for name in source})
    engine.storage.wait_for_params()
    orders = engine.element_orders()
    reads: list[RangeRead] = []
    for piece in engine.storage.load_pieces():
        if piece.name in source:

            def plan(start: int, end: int, dest: torch.Tensor, stored: str = source[piece.name]) -> list[RangeRead]:
                return [RangeRead(stored, start, end, dest)]

            reads += reordered.reads_for(orders[piece.name], *piece.param_range, piece.tensor, plan)
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, kind, tensor in inventory:
        if kind == "buffer" and name in source:
            reads.append(RangeRead(source[name], 0, tensor.numel(), buffer_target(tensor, staged)))
    return report, reads, staged
