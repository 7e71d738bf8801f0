"""Stage 0: data parallelism with bucketed, overlapped gradient all-reduce.

[Note: gradient readiness and launch order]
Each trainable parameter gets a post-accumulate-grad hook, which autograd calls once the
parameter's gradient for this backward is final. The hook counts the parameter's bucket
down; a complete bucket starts its collective at once, so communication runs while
backward computes earlier layers. Collectives must be issued in the same order on every
rank, so buckets are *launched strictly in bucket order*: a bucket that completes early
waits for its predecessors. At the end of backward (an autograd engine callback queued by
the first hook) every bucket not launched yet -- those holding parameters that got no
gradient on this rank -- is launched with zeros for the missing gradients, so unused
branches and rank-dependent control flow neither hang nor corrupt, without walking the
graph. Then every handle is waited on, so ``param.grad`` is final when ``backward()``
returns.

Gradients are divided by N before the collective (sum of averages = average of sums),
which keeps fp32 values in range and makes the result equal one process training on the
concatenated batch.
"""

from __future__ import annotations

import collections
import enum
import time
from typing import Sequence

import torch
from torch import nn

from ..comm import collectives as C
from ..core.layout import Bucket, BufferLayout, ShardPiece
from ..config import ShardConfig
from .base import Engine, TensorPiece


class FlatParams:
    """One dtype's trainable parameters stored back to back in one 1-D tensor.

    After construction every parameter's ``.data`` is a view into ``self.data``; the
    Parameter objects themselves are unchanged (optimizers and user code keep them).
    With a low-precision ``param_dtype``, ``self.data`` holds the compute copy and
    ``self.master`` the parameters' original (full-precision) values, which are what the
    optimizer updates; stages 1-3 keep only their shard of the master.
    """

    def __init__(
        self,
        named: Sequence[tuple[str, nn.Parameter]],
        world_size: int,
        bucket_cap_numel: int | None,
        param_dtype: torch.dtype | None = None,
    ) -> None:
        first = named[0][1]
        self.master_dtype = first.dtype
        self.dtype = param_dtype if param_dtype is not None and first.dtype.is_floating_point else first.dtype
        self.device = first.device
        self.params = dict(named)
        # Reverse registration order: see [Note: layout order] in core/layout.py.
        self.layout = BufferLayout([(n, p.shape) for n, p in reversed(named)], world_size, bucket_cap_numel)
        self.data = torch.zeros(self.layout.numel, dtype=self.dtype, device=self.device)  # 1-D, padded
        self.master: torch.Tensor | None = None
        if self.dtype != self.master_dtype:
            self.master = torch.zeros(self.layout.numel, dtype=self.master_dtype, device=self.device)
        with torch.no_grad():
            for name, param in named:
                if self.master is not None:
                    self.layout.view(self.master, name).copy_(param.data)
                view = self.layout.view(self.data, name)
                view.copy_(param.data)
                param.data = view

    @property
    def values(self) -> torch.Tensor:
        """The full-precision parameter values (the master copy when there is one)."""
        return self.master if self.master is not None else self.data

    def param_view(self, name: str) -> torch.Tensor:
        return self.layout.view(self.data, name)


class BucketPhase(enum.Enum):
    COLLECTING = "collecting"  # waiting for gradients of this backward
    COMPLETE = "complete"  # every gradient is in, waiting for earlier buckets to launch
    IN_FLIGHT = "in_flight"  # collective launched, handle pending


class GradBucket:
    """Run-time state of one bucket during a backward pass."""

    def __init__(self, position: int, flat: FlatParams, spec: Bucket) -> None:
        self.position = position
        """Index in the engine's launch order (``spec.index`` counts within one flat)."""
        self.flat = flat
        self.spec = spec
        self.missing: set[str] = set(spec.names)
        self.phase = BucketPhase.COLLECTING
        self.handle: C.Handle | None = None
        self.reduced = False
        """Holds reduced gradients not consumed by ``zero_grad`` yet (stages 1-3)."""

    def mark_ready(self, name: str) -> None:
        assert self.phase is BucketPhase.COLLECTING, (
            f"gradient of '{name}' arrived after bucket {self.position} was already reduced; "
            "a parameter took part in two backward passes that were not separated by a forward"
        )
        self.missing.discard(name)
        if not self.missing:
            self.phase = BucketPhase.COMPLETE

    def reset(self) -> None:
        self.missing = set(self.spec.names)
        self.phase = BucketPhase.COLLECTING
        self.handle = None


def group_by_dtype(named: Sequence[tuple[str, nn.Parameter]]) -> list[list[tuple[str, nn.Parameter]]]:
    groups: dict[torch.dtype, list[tuple[str, nn.Parameter]]] = {}
    for name, param in named:
        groups.setdefault(param.dtype, []).append((name, param))
    return list(groups.values())


class AllReduceEngine(Engine):
    """Stage 0 (DDP). Stages 1 and 2 subclass this and swap storage and collective."""

    stage = 0
    max_buckets_in_flight: int | None = None
    """Finish the oldest collective before launching more than this many (None: no bound).
    Stage 2 bounds it because every bucket in flight holds full-size gradients."""

    def __init__(self, module: nn.Module, config: ShardConfig, group: C.ProcessGroup | None = None) -> None:
        super().__init__(module, config, group)
        if not self.trainable:
            raise ValueError(
                "shardpar.wrap: the module has no parameter with requires_grad=True; "
                "there is nothing to train in data parallel"
            )
        self.flats = self.build_flats()
        self.flat_of = {name: flat for flat in self.flats for name in flat.params}
        specs = [(flat, spec) for flat in self.flats for spec in flat.layout.buckets]
        self.buckets = [GradBucket(position, flat, spec) for position, (flat, spec) in enumerate(specs)]
        self.bucket_of = {name: bucket for bucket in self.buckets for name in bucket.spec.names}
        self.cast_buffers()
        self.frozen_masters = self.cast_frozen_params()
        self.broadcast_module_tensors(
            [flat.data for flat in self.flats]
            + [flat.master for flat in self.flats if flat.master is not None]
            + list(self.iter_frozen_and_buffers())
        )
        self.allocate_grads()
        self._next_launch = 0
        self._in_flight: collections.deque[GradBucket] = collections.deque()
        self._backward_active = False
        self._backward_syncs = True
        self.timeline: list[tuple[str, object]] | None = None
        """Set to a list to record ("grad", name) and ("launch", bucket index) events."""
        for name, param in self.trainable:
            self.add_hook(param.register_post_accumulate_grad_hook(self._make_grad_hook(name)))

    # ------------------------------------------------------------------ storage (stage hooks)

    def build_flats(self) -> list[FlatParams]:
        """Stages 0-2: one flat buffer per dtype of all trainable parameters, bucketed."""
        bytes_cap = int(self.config.bucket_cap_mb * 1024 * 1024)
        return [
            FlatParams(named, self.world_size, max(1, bytes_cap // named[0][1].element_size()), self.param_dtype)
            for named in group_by_dtype(self.trainable)
        ]

    def cast_frozen_params(self) -> dict[str, torch.Tensor]:
        """Mixed precision: frozen parameters compute in ``param_dtype`` too; their original
        values are kept (``name -> tensor``) so checkpoints stay exact."""
        masters = {}
        if self.param_dtype is not None:
            for name, param in self.frozen:
                if param.is_floating_point() and param.dtype != self.param_dtype:
                    masters[name] = param.data
                    param.data = param.data.to(self.param_dtype)
        return masters

    def iter_frozen_and_buffers(self):
        yield from self.frozen_masters.values()
        yield from super().iter_frozen_and_buffers()

    def frozen_bytes(self) -> int:
        """Frozen parameters as used (compute dtype) plus their kept full-precision originals."""
        return super().frozen_bytes() + sum(t.numel() * t.element_size() for t in self.frozen_masters.values())

    def grad_dtype(self, flat: FlatParams) -> torch.dtype:
        """dtype gradients are accumulated and communicated in (``reduce_dtype``)."""
        mp = self.config.mixed_precision
        if mp is None or not flat.master_dtype.is_floating_point:
            return flat.dtype
        return mp.reduce_dtype if mp.reduce_dtype is not None else flat.master_dtype

    def allocate_grads(self) -> None:
        """Stage 0/1: one full gradient buffer per flat, in the reduce dtype. When that is the
        parameters' dtype, ``param.grad`` are views into it (autograd accumulates in place);
        otherwise each finished gradient is added into it and ``param.grad`` is released."""
        self.grad_data = {
            flat: torch.zeros(flat.layout.numel, dtype=self.grad_dtype(flat), device=flat.device) for flat in self.flats
        }
        # Cached so that `param.grad is view` tells whether autograd still writes into the buffer.
        self._grad_views = {
            name: flat.layout.view(self.grad_data[flat], name) for flat in self.flats for name in flat.params
        }
        for name, param in self.trainable:
            if self._grad_views[name].dtype == param.dtype:
                param.grad = self._grad_views[name]
        # What the optimizer reads: the reduced gradients in the master dtype (stage 0: full).
        self.master_grads = {
            flat: grad if grad.dtype == flat.master_dtype else torch.zeros_like(grad, dtype=flat.master_dtype)
            for flat, grad in self.grad_data.items()
        }

    def grad_view(self, name: str) -> torch.Tensor:
        return self._grad_views[name]

    def accept_grad(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        """Move a just-finished gradient to where its bucket reduces it."""
        view = self.grad_view(name)
        if param.grad is view:
            return
        if view.dtype == param.dtype:
            # The gradient was set to None (e.g. module.zero_grad()), so autograd allocated a
            # fresh tensor: take its value and point .grad back at the buffer.
            view.copy_(param.grad)
            param.grad = view
        else:
            # Low-precision gradient into the reduce-dtype buffer, which accumulates.
            view.add_(param.grad)
            param.grad = None

    def fill_missing(self, bucket: GradBucket) -> None:
        """Give parameters that got no gradient this backward a zero one (or keep what they
        accumulated earlier, e.g. under no_sync)."""
        for name in bucket.missing:
            param = bucket.flat.params[name]
            view = self.grad_view(name)
            if view.dtype != param.dtype:
                if param.grad is not None:
                    self.accept_grad(bucket, name, param)
            elif param.grad is None:
                view.zero_()
                param.grad = view
            elif param.grad is not view:
                self.accept_grad(bucket, name, param)

    def start_bucket_sync(self, bucket: GradBucket) -> C.Handle:
        data = bucket.spec.range.of(self.grad_data[bucket.flat])
        data.div_(self.world_size)
        return C.all_reduce(
            data, group=self.group, async_op=True, stats=self.comm, padding_numel=bucket.spec.padding
        )

    def finish_bucket_sync(self, bucket: GradBucket) -> None:
        """After the collective of ``bucket`` completed."""
        master_grad = self.master_grads[bucket.flat]
        if master_grad is not self.grad_data[bucket.flat]:
            bucket.spec.range.of(master_grad).copy_(bucket.spec.range.of(self.grad_data[bucket.flat]))

    # ------------------------------------------------------------------ backward

    def _make_grad_hook(self, name: str):
        bucket = self.bucket_of[name]

        def on_grad_ready(param: nn.Parameter) -> None:
            with torch.no_grad():
                self._on_grad_ready(bucket, name, param)

        return on_grad_ready

    def _on_grad_ready(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        if not self._backward_active:
            self._backward_active = True
            self._backward_syncs = self.require_grad_sync
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if not self._backward_syncs:
            self.accumulate_without_sync(bucket, name, param)
            return
        if self.timeline is not None:
            self.timeline.append(("grad", name))
        self.accept_grad(bucket, name, param)
        bucket.mark_ready(name)
        if bucket.phase is BucketPhase.COMPLETE:
            self.on_bucket_complete(bucket)
            self._launch_complete_buckets()

    def on_bucket_complete(self, bucket: GradBucket) -> None:
        """Every gradient of ``bucket`` is in (before its collective may launch)."""

    def accumulate_without_sync(self, bucket: GradBucket, name: str, param: nn.Parameter) -> None:
        """Inside ``no_sync()``: keep accumulating locally, no collective."""
        self.accept_grad(bucket, name, param)

    def _launch(self, bucket: GradBucket) -> None:
        assert bucket.handle is None, f"bucket {bucket.position} already has a collective in flight"
        if self.timeline is not None:
            self.timeline.append(("launch", bucket.position))
        bucket.handle = self.start_bucket_sync(bucket)
        bucket.phase = BucketPhase.IN_FLIGHT
        self._in_flight.append(bucket)
        while self.max_buckets_in_flight is not None and len(self._in_flight) > self.max_buckets_in_flight:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        bucket = self._in_flight.popleft()
        bucket.handle.wait()
        self.finish_bucket_sync(bucket)
        bucket.reset()

    def _launch_complete_buckets(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].phase is BucketPhase.COMPLETE:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _finish_backward(self) -> None:
        self._backward_active = False
        with torch.no_grad():
            if self._backward_syncs:
                started = time.perf_counter()
                for bucket in self.buckets[self._next_launch :]:
                    self.fill_missing(bucket)
                    self.on_bucket_complete(bucket)
                    self._launch(bucket)
                while self._in_flight:
                    self._finish_oldest()
                self._next_launch = 0
                self.last_backward_wait_s = time.perf_counter() - started
                self.grads_ready = True
            self.after_backward()

    def after_backward(self) -> None:
        """End of every backward that reached this engine's parameters (synced or not)."""

    # ------------------------------------------------------------------ per step

    def pre_forward(self) -> None:
        self.broadcast_buffers()

    def clear_grads(self) -> None:
        # As torch's zero_grad(set_to_none=True): no memset of the buffer. The next backward's
        # first gradient of each parameter is copied over the stale values (accept_grad),
        # parameters that get none are zeroed (fill_missing), and master_grads are overwritten
        # bucket by bucket. Only a buffer of another dtype than the parameters accumulates by
        # add_, so only that one is zeroed.
        for flat, grad in self.grad_data.items():
            if grad.dtype != flat.dtype:
                grad.zero_()
        for _, param in self.trainable:
            param.grad = None

    def optimizer_tensors(self, names: Sequence[str]) -> list[TensorPiece]:
        pieces = []
        for name in names:
            flat = self.flat_of[name]
            param = flat.params[name]
            if flat.master is None and self.master_grads[flat] is self.grad_data[flat]:
                tensor = param  # no master copy: the optimizer updates the parameter itself
            else:
                # A master copy, or reduced gradients kept apart from param.grad (reduce_dtype
                # differs from the parameters'): hand the optimizer a view of the full-precision
                # values with the full-precision reduced gradient attached.
                tensor = flat.layout.view(flat.values, name)
                tensor.grad = flat.layout.view(self.master_grads[flat], name)
            pieces.append(TensorPiece(name, tensor, (0, param.numel())))
        return pieces

    def owned_grads(self) -> tuple[list[torch.Tensor], bool]:
        return list(self.master_grads.values()), False

    def after_optimizer_step(self) -> None:
        """Refresh the low-precision compute copy from the updated master."""
        with torch.no_grad():
            for flat in self.flats:
                if flat.master is not None:
                    flat.data.copy_(flat.master)

    def master_piece(self, flat: FlatParams, piece: ShardPiece) -> torch.Tensor:
        """This rank's full-precision values of ``piece`` (1-D view)."""
        return piece.buffer_range.of(flat.values)

    def save_pieces(self) -> list[TensorPiece]:
        # Parameters are replicated at stages 0-2, yet each rank writes only its bucket
        # slices, so saving is parallel and every rank writes the same amount.
        pieces = [
            TensorPiece(p.name, self.master_piece(flat, p), (p.param_range.start, p.param_range.end))
            for flat in self.flats
            for p in flat.layout.pieces(self.rank)
        ]
        if self.rank == 0:
            pieces += [TensorPiece(name, tensor.reshape(-1), (0, tensor.numel())) for name, tensor in self.frozen_values()]
        return pieces

    def frozen_values(self) -> list[tuple[str, torch.Tensor]]:
        """Frozen parameters at full precision (their originals under mixed precision)."""
        return [(name, self.frozen_masters.get(name, param.data)) for name, param in self.frozen]

    def load_pieces(self) -> list[TensorPiece]:
        pieces = [
            TensorPiece(name, flat.layout.view(flat.values, name).view(-1), (0, flat.params[name].numel()))
            for flat in self.flats
            for name in flat.params
        ]
        return pieces + self.frozen_load_pieces()

    def frozen_load_pieces(self) -> list[TensorPiece]:
        pieces = []
        for name, tensor in self.frozen_values():
            if not tensor.is_contiguous():
                raise ValueError(f"frozen parameter '{name}' is not contiguous; cannot load into it in place")
            pieces.append(TensorPiece(name, tensor.view(-1), (0, tensor.numel())))
        return pieces

    def after_load(self) -> None:
        with torch.no_grad():
            for name, param in self.frozen:
                if name in self.frozen_masters:
                    param.data.copy_(self.frozen_masters[name])
        self.after_optimizer_step()

    def memory_stats(self) -> dict[str, int]:
        masters = [f.master for f in self.flats if f.master is not None]
        extra_grads = [g for f, g in self.master_grads.items() if g is not self.grad_data[f]]
        return {
            "params": sum(t.numel() * t.element_size() for t in [f.data for f in self.flats] + masters)
            + self.frozen_bytes(),
            "grads": sum(g.numel() * g.element_size() for g in list(self.grad_data.values()) + extra_grads),
            "workspace": 0,
        }
