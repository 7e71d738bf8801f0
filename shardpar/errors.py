"""Exception types of shardpar's public API."""

from typing import Any


class CheckpointError(Exception):
    """Anything wrong with a checkpoint on disk: missing, incomplete, corrupted, or not
    matching the model/optimizer it is loaded into. The message names the file or tensor."""


class RanksOutOfStep(RuntimeError):
    """The ranks of a job are not at the same point: one skipped a backward or an optimizer
    step, ran a different number of micro-batches, entered a collective phase (a checkpoint
    save, an evaluation at stage 3) alone, died, or never arrived. Raised on every rank that
    is still in a shardpar collective, with a message that names each rank and what it was
    doing; ``reports`` maps each rank to its report (None: it sent none) and ``missing``
    lists the ranks that sent none."""

    def __init__(self, message: str, reports: dict[int, Any] | None = None, missing: list[int] | None = None) -> None:
        super().__init__(message)
        self.reports = reports or {}
        self.missing = list(missing or [])


class ShardedGradError(RuntimeError):
    """Plain torch code asked for a full gradient at stages 1-3, where gradients exist only as
    shards: a torch optimizer over ``model.parameters()``, ``torch.nn.utils.clip_grad_norm_``,
    or a read of ``param.grad``. The message names the parameter and what to call instead."""


class UnitOrderMismatch(RanksOutOfStep):
    """Stage 3: ranks ran different units at the same point (a data-dependent branch between
    units, a unit skipped or repeated on some ranks, a different number of forwards), so their
    parameter all-gathers would pair up wrongly. Raised on every rank, naming each rank's unit:
    at the first gather whose tags differ, or, where the ranks' collectives no longer meet at
    all, once every rank's wait has stalled (see [Note: stalled waits] in
    ``shardpar/comm/stalls.py``). A :class:`RanksOutOfStep`, so scripts that catch that catch it
    too."""
