"""What the engine and the module facade call on a stage's parameter storage: the
:class:`Storage` protocol, which :class:`~.replicated.ReplicatedStorage` (stages 0-2, with its
master part) and :class:`~.sharded.ShardedStorage` (stage 3) both satisfy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .element_order import ElementOrder
from .flat_param import FlatParamGroup
from .layout import BufferLayout
from .pieces import FullValues, TensorPiece
from .rebuild import Relayout
from .reducer import BucketedParams

if TYPE_CHECKING:
    from .reduce_strategies import ReduceStrategy


class Storage(Protocol):
    """A stage's parameter storage (the storage column of the stage table, engines/stages.py)."""

    @property
    def relayouts(self) -> bool:
        """Whether its buckets may be laid out again after the first backward ([Note: bucket rebuild])."""

    @property
    def params_are_masters(self) -> bool:
        """Whether the module's parameters hold the values the optimizer updates."""

    @property
    def full_values(self) -> FullValues:
        """Where full-precision values are read ([Note: full values in the module])."""

    @property
    def spaces(self) -> Sequence[BucketedParams]:
        """The trainable bucketed parameter sets the reducer buckets (stage 0-2 buffers, stage-3 groups)."""

    @property
    def groups(self) -> Sequence[FlatParamGroup]:
        """Its flat parameter groups (stages 1-2: one per bucket; stage 3: every unit's; stage 0: none)."""

    def element_orders(self) -> dict[str, ElementOrder]: ...
    def layouts(self) -> list[BufferLayout]: ...
    def layout_summary(self) -> dict[str, Any]: ...

    def whole_layouts(self, names: frozenset[str]) -> dict[Any, BufferLayout]:
        """The layouts, by bucketed parameter set, in which ``names`` are owned whole too, where
        that moves anything ([Note: whole-tensor ownership] in layout.py)."""

    def relayout(self, moves: dict[Any, Relayout]) -> None:
        """Move to new layouts (a bucket rebuild, or tensors owned whole)."""

    def optimizer_pieces(self, names: Sequence[str], strategy: ReduceStrategy) -> list[TensorPiece]:
        """The tensors the wrapped optimizer updates for ``names`` on this rank, with their
        reduced gradients (read from ``strategy``)."""

    def before_optimizer_step(self, names: frozenset[str] | None = None) -> None:
        """An optimizer over ``names`` (None: every parameter) is about to change their values."""

    def after_optimizer_step(self, names: frozenset[str] | None = None) -> None:
        """It changed them: make them the ones forward computes with."""

    def wait_for_params(self) -> None:
        """Block until the parameters are complete and current."""

    def save_pieces(self) -> list[TensorPiece]: ...
    def load_pieces(self) -> list[TensorPiece]: ...
    def after_load(self) -> None: ...
    def param_bytes(self) -> int: ...
