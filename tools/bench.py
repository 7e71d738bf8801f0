"""shardpar stages 0-3 against torch DDP, DDP + ZeroRedundancyOptimizer and FSDP2, in one run.

    torchrun --standalone --nproc_per_node 2 tools/bench.py            # the default report
    python tools/bench.py --models mlp:tiny --rounds 2                  # world size 1, quick
    python tools/bench.py --device cuda --out /tmp/gpu.md               # one GPU: against plain torch
    torchrun --standalone --nproc_per_node 8 tools/bench.py --device cuda   # 8 GPUs, NCCL

For every model (``--models``, e.g. ``mlp:small,gpt:large``) every configuration is built
on the same initial weights and the same per-rank batches, warmed up, then timed in
interleaved rounds: round r runs every configuration ``--steps-per-round`` times, in an
order rotated by r, so machine drift lands on all of them alike. Writes ``--out`` (the
Markdown report, default docs/benchmarks.md), ``--png`` when matplotlib is importable and
``--json`` when asked. Only rank 0 writes.

[Note: what is measured]
- Step time: wall time of forward + backward + optimizer step + zero_grad, after a barrier
  so every rank starts together; a step's time is the slowest rank's. Median and IQR over
  the timed steps (warm-up steps excluded).
- Memory (a phase of its own, before timing): model state as each engine accounts it (``memory_stats()`` for shardpar; the
  parameter, gradient and optimizer-state tensors for the peers, local shards for FSDP2),
  against DESIGN.md's ZeRO formula; and the process's peak RSS above what it held before
  the configuration was built (VmHWM, reset through /proc/self/clear_refs, with glibc's
  mmap threshold lowered and free heap pages trimmed first, so no tensor lands on pages
  counted before), each configuration alone in the process for ``MEMORY_STEPS`` steps,
  then dropped.

[Note: allocator modes]
glibc serves big allocations by mmap and returns them at free; below its threshold memory
is reused from the heap. The memory phase sets the threshold to 64 KiB so every tensor's
pages come and go with it (exact RSS). That would make the timing phase pay page faults
for every activation every step, which no real run does: glibc's dynamic threshold climbs
to 32 MiB after the first frees. So the timing phase sets 32 MiB (and trim at 64 MiB)
explicitly, the steady state every configuration sees from its first step. The JSON summary
gives each configuration's minor page faults per timed step (``minor_faults``, the process's,
the slowest rank's median), which shows whether that holds.
- Bytes: ``comm_stats()`` over the timed steps / steps, against ``estimate_communication``
  (payload and, in the JSON summary, padding, with the configuration's bucket cap and
  alignment).
- Exposed communication (shardpar stages only): ``engine.wait_clock``, reset before each
  step and read after it, gives the seconds the rank's main thread was blocked waiting for
  collectives, per phase (forward: parameter gathers; backward gathers: stage 3's; backward
  reductions: gradients; step: what ``step()`` and zero_grad waited for; see [Note: exposed
  communication] in shardpar/core/wait_clock.py). Per rank the median over the timed steps,
  per phase and of the step's total; the report shows the slowest rank's.
- Communication alone: the same collectives with nothing else running, shardpar's own
  functions on fresh buffers, all launched then all waited (the median of ``--comm-reps``):
  the gradient collectives (one per bucket, of the bucket's size and reduce dtype: stage 0
  all-reduce, stages 1-3 reduce-scatter), then, timed on their own, the parameter
  all-gathers (stages 1-2: one per bucket; stage 3: one per flat group of every unit, twice,
  forward and backward, unless ``reshard_after_forward=False`` or the unit was kept gathered
  from forward into backward; in the compute dtype; stage 3's
  16-byte gather tags and the few bytes of the used-parameter flags are left out).
  hidden = 1 - exposed / (gradients alone + gathers alone), clamped to [0, 1].

[Note: on CUDA]
``--device cuda`` puts each rank on ``cuda:LOCAL_RANK`` with NCCL (under plain python, a
one-rank NCCL group). The host runs ahead of the GPU, so what the CPU path measures does not
carry over as it is:
- a step is timed from a ``torch.cuda.synchronize()`` after the barrier to one after
  zero_grad (so the GPU work it queued is in it, post-step all-gathers included); its phases
  (fwd+bwd, opt step, zero_grad) are CUDA events on the current stream, the GPU time between
  them, which adds up to at most the step;
- memory is the caching allocator's, not RSS: ``torch.cuda.max_memory_allocated`` over the
  memory phase above what was allocated before the configuration was built (the report's
  "peak CUDA allocated" columns, in place of the RSS ones);
- the collectives alone are timed between two ``torch.cuda.synchronize()``;
- the wait clock counts what the host waited for, which on CUDA is only what synchronises the
  host (ideally nothing): the GPU's own waits do not show in it.
At world size 1 the default configurations are the four stages and ``torch`` (plain torch: the
model and AdamW, no wrapper, no collective), the peer of every stage; at world size N they are
the CPU run's (DDP, DDP + ZeroRedundancyOptimizer, FSDP2). ``--device cpu`` (the default) is the
CPU run described above, unchanged.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import ctypes
import datetime
import gc
import importlib.util
import json
import math
import os
import platform
import resource
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from collections.abc import Callable
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import shardpar  # noqa: E402
from shardpar.comm import collectives  # noqa: E402
from shardpar.core.wait_clock import PHASES as WAIT_PHASES  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEEP_MARKER = "<!-- everything below this line is written by hand; tools/bench.py keeps it -->"
MIB = 2**20

# --------------------------------------------------------------------------- models


class MLPBlock(nn.Module):
    """Residual feed-forward block: x + W2 gelu(W1 x)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(x)))


class MLPStack(nn.Module):
    def __init__(self, width: int, layers: int, classes: int) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(MLPBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Block(nn.Module):
    """Pre-norm transformer block with causal SDPA attention."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = MLPBlock(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, c/heads)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, c))
        return self.mlp(self.ln2(x))


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))  # (batch, seq, vocab)


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "mlp" or "gpt"
    size: str
    width: int
    layers: int
    batch: int  # rows (mlp) or sequences (gpt) per rank
    seq: int = 0
    vocab: int = 0
    heads: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.size}"

    def build(self) -> nn.Module:
        if self.kind == "mlp":
            return MLPStack(self.width, self.layers, classes=self.width)
        return Transformer(self.width, self.layers, self.heads, self.vocab, self.seq)

    @property
    def unit_class(self) -> type[nn.Module]:
        """Stage-3 units and FSDP2 ``fully_shard`` calls: one per block, then the root."""
        return MLPBlock if self.kind == "mlp" else Block

    def batch_for(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kind == "mlp":
            x = torch.randn(self.batch, self.width, generator=generator)
            return x, torch.randint(0, self.width, (self.batch,), generator=generator)
        tokens = torch.randint(0, self.vocab, (self.batch, self.seq + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def describe(self) -> str:
        if self.kind == "mlp":
            return f"MLP stack, width {self.width}, {self.layers} blocks, batch {self.batch} rows/rank"
        return (f"transformer, width {self.width}, {self.layers} blocks, {self.heads} heads, vocab {self.vocab}, "
                f"batch {self.batch}x{self.seq} tokens/rank")


SIZES = {
    "mlp": {
        "tiny": {"width": 32, "layers": 2, "batch": 8},
        "small": {"width": 256, "layers": 4, "batch": 128},
        "large": {"width": 512, "layers": 4, "batch": 128},
    },
    "gpt": {
        "tiny": {"width": 32, "layers": 2, "heads": 2, "vocab": 64, "seq": 16, "batch": 2},
        "small": {"width": 192, "layers": 4, "heads": 4, "vocab": 2048, "seq": 64, "batch": 4},
        "large": {"width": 256, "layers": 6, "heads": 4, "vocab": 4096, "seq": 64, "batch": 4},
    },
}


def parse_models(text: str) -> list[ModelSpec]:
    specs = []
    for item in text.split(","):
        kind, _, size = item.strip().partition(":")
        if kind not in SIZES or size not in SIZES[kind]:
            choices = ", ".join(f"{k}:{s}" for k in SIZES for s in SIZES[k])
            raise SystemExit(f"error: --models: unknown model {item!r}; choose from {choices}")
        specs.append(ModelSpec(kind, size, **SIZES[kind][size]))
    return specs


# --------------------------------------------------------------------------- configurations

ALL_CONFIGS = ["stage0", "stage1", "stage2", "stage3", "ddp", "ddp+zero", "fsdp2"]
PLAIN = "torch"
"""Plain torch, no wrapper: every stage's peer at world size 1 on CUDA (``--configs`` may name
it at world size 1 on the CPU too)."""
KNOWN_CONFIGS = [*ALL_CONFIGS, PLAIN]
PEER_STAGE = {"ddp": 0, "ddp+zero": 1, "fsdp2": 3, PLAIN: 0}
"""The shardpar stage each peer matches (same storage and collectives)."""
CANDIDATE = "-cand"
"""Suffix of the stages run from ``--candidate`` (another checkout's shardpar, to A/B a patch)."""


def stage_of(config: str) -> int | None:
    """3 for "stage3" and "stage3-cand"; None for the peers."""
    return int(config.removesuffix(CANDIDATE)[-1]) if config.startswith("stage") else None


def peer_of(config: str, present: Any = ()) -> str:
    """The peer a stage is compared with: its distributed counterpart, or plain torch when only
    that is in ``present`` (world size 1 on CUDA)."""
    peer = {0: "ddp", 1: "ddp+zero", 2: "ddp+zero", 3: "fsdp2"}[stage_of(config)]
    return PLAIN if peer not in present and PLAIN in present else peer


def default_configs(device: str, world: int) -> list[str]:
    """``--configs`` when not given: see [Note: on CUDA]."""
    if device == "cuda" and world == 1:
        return [c for c in ALL_CONFIGS if stage_of(c) is not None] + [PLAIN]
    return list(ALL_CONFIGS)


def zero_formula(config: str, psi: int, world: int) -> float:
    """DESIGN.md's model-state bytes per rank with fp32 AdamW (peers: the stage they match)."""
    stage = PEER_STAGE[config] if stage_of(config) is None else stage_of(config)
    return [16 * psi, 8 * psi + 8 * psi / world, 4 * psi + 12 * psi / world, 16 * psi / world][stage]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


class Runner:
    """One configuration: a model copy, its wrapper and optimizer, and one training step
    split into phases so the report can say where the time goes."""

    name: str
    engine: Any = None  # shardpar configurations only

    def __init__(self, model: nn.Module, spec: ModelSpec, wrap_options: dict[str, Any]) -> None:
        self.spec, self.wrap_options = spec, wrap_options  # options for shardpar.wrap
        self.device = next(model.parameters()).device  # the model arrives on the rank's device
        self.model, self.opt = self.wrap(model)

    def wrap(self, model: nn.Module) -> tuple[nn.Module, Any]:
        raise NotImplementedError

    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = self.model(batch[0])
        loss = F.cross_entropy(logits.flatten(0, -2), batch[1])
        loss.backward()
        return loss.detach()

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def model_state(self) -> dict[str, int]:
        """Bytes of params, grads and optimizer state on this rank (after a step, before zero_grad)."""
        params = list(self.model.parameters())
        return {
            "params": _tensor_bytes(params),
            "grads": _tensor_bytes(p.grad for p in params),
            "optimizer_state": _tensor_bytes(self._optimizer_state()),
        }

    def _optimizer_state(self):
        for state in self.opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def close(self) -> None:
        pass


class ShardparRunner(Runner):
    def __init__(self, stage: int, library: Any, *args: Any) -> None:
        self.stage, self.library = stage, library  # shardpar, or a --candidate copy of it
        super().__init__(*args)

    def wrap(self, model: nn.Module) -> tuple[nn.Module, Any]:
        options = dict(self.wrap_options)
        if self.stage == 3:
            options["wrap_policy"] = [self.spec.unit_class]
        wrapped = self.library.wrap(model, stage=self.stage, **options)
        self.engine = wrapped.engine
        return wrapped, self.library.optimizer(wrapped, torch.optim.AdamW, lr=1e-3)

    def model_state(self) -> dict[str, int]:
        stats = self.model.memory_stats()
        return {k: stats.get(k, 0) for k in ("params", "grads", "optimizer_state", "workspace")}

    def close(self) -> None:
        self.engine.close()


def _ddp(model: nn.Module, device: torch.device) -> nn.parallel.DistributedDataParallel:
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


class PlainRunner(Runner):
    """The model and AdamW, nothing else: what a stage costs over plain torch at world size 1."""

    name = PLAIN

    def wrap(self, model: nn.Module) -> tuple[nn.Module, Any]:
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


class DDPRunner(Runner):
    name = "ddp"

    def wrap(self, model: nn.Module) -> tuple[nn.Module, Any]:
        ddp = _ddp(model, self.device)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


class ZeroRunner(Runner):
    name = "ddp+zero"

    def wrap(self, model: nn.Module) -> tuple[nn.Module, Any]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = _ddp(model, self.device)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)

    def _optimizer_state(self):
        for state in self.opt.optim.state.values():  # the local, sharded optimizer
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class FSDPRunner(Runner):
    name = "fsdp2"

    def wrap(self, model: nn.Module) -> tuple[nn.Module, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from shardpar.comm.compat import fully_shard

        mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        for module in model.modules():
            if isinstance(module, self.spec.unit_class):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


LIBRARIES: dict[str, Any] = {CANDIDATE: shardpar}
"""The shardpar package the CANDIDATE stages run: this checkout's unless --candidate names one."""


def build_runner(config: str, model: nn.Module, spec: ModelSpec, args: argparse.Namespace) -> Runner:
    """``config`` built on ``model``, which is first moved to the rank's device."""
    model = model.to(args.torch_device)
    stage = stage_of(config)
    if stage is None:
        runners = {"ddp": DDPRunner, "ddp+zero": ZeroRunner, "fsdp2": FSDPRunner, PLAIN: PlainRunner}
        return runners[config](model, spec, {})
    if config.endswith(CANDIDATE):
        return ShardparRunner(stage, LIBRARIES[CANDIDATE], model, spec, {**args.wrap_options, **args.candidate_options})
    return ShardparRunner(stage, shardpar, model, spec, args.wrap_options)


def load_candidate(checkout: Path) -> None:
    """Import ``checkout``/shardpar under another name (its imports are relative), so stages
    of a patched copy run interleaved with this checkout's in one launch."""
    package = checkout / "shardpar"
    spec = importlib.util.spec_from_file_location(
        "shardpar_candidate", package / "__init__.py", submodule_search_locations=[str(package)]
    )
    if spec is None or not (package / "__init__.py").exists():
        raise SystemExit(f"error: --candidate {checkout}: no shardpar package there")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    LIBRARIES[CANDIDATE] = module


# --------------------------------------------------------------------------- process memory


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MEASURE_MMAP_BYTES = 64 * 1024
TIMING_MMAP_BYTES = 32 * MIB


def set_allocator(mmap_threshold: int) -> None:
    """glibc's malloc thresholds; see [Note: allocator modes]."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap_threshold)


def release_free_memory() -> None:
    """Give the pages of free heap chunks back to the OS (glibc ``malloc_trim``): malloc
    reuses free chunks before it mmaps, so without this a configuration could grow into
    memory an earlier one freed and its peak RSS would not show it."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(field_name)


def reset_peak_rss() -> bool:
    """Set VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def current_rss() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


# --------------------------------------------------------------------------- measuring


@dataclass
class Measured:
    """What one rank measured for one configuration."""

    steps: list[float] = field(default_factory=list)  # seconds per timed step
    phases: list[tuple[float, float, float]] = field(default_factory=list)  # fwd+bwd, opt step, zero_grad
    cpu: list[float] = field(default_factory=list)  # CPU seconds per timed step, all threads of the process
    cpu_other: list[float] = field(default_factory=list)  # of which not the main thread (gloo's threads)
    minor_faults: list[int] = field(default_factory=list)  # minor page faults per timed step, whole process
    phase_cpu_main: list[tuple[float, float, float]] = field(default_factory=list)  # main-thread CPU per phase
    exposed: list[dict[str, float]] = field(default_factory=list)  # wait-clock seconds per phase, per step
    state: dict[str, int] = field(default_factory=dict)
    rss_increase: int = 0
    rss_peak: int = 0
    rss_exact: bool = True
    sent_bytes: float | None = None
    padding_bytes: float | None = None
    sent_by_op: dict[str, float] = field(default_factory=dict)
    grad_alone_s: float | None = None
    gather_alone_s: float | None = None
    final_loss: float = math.nan


def _clock() -> tuple[float, float, float]:
    """(wall, CPU of the whole process, CPU of this thread) in seconds."""
    return time.perf_counter(), time.process_time(), time.thread_time()


def _minor_faults() -> int:
    """Minor page faults of the whole process so far: pages touched for the first time since
    the allocator got them from the OS, which a step pays for every buffer it allocates anew."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _synchronize(device: torch.device) -> None:
    """Wait for the GPU's queue on CUDA (see [Note: on CUDA]); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _GPUMarks:
    """CUDA events at the phase boundaries of a step, on the current stream: a phase's GPU time
    without making the host wait (see [Note: on CUDA]). On the CPU, no events and no phases."""

    def __init__(self, device: torch.device) -> None:
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if device.type == "cuda" else []
        self.next = 0

    def mark(self) -> None:
        if self.events:
            self.events[self.next].record()
            self.next += 1

    def phases(self) -> tuple[float, float, float] | None:
        """fwd+bwd, opt step, zero_grad in seconds, once the step is synchronised."""
        if not self.events:
            return None
        e = self.events
        return e[0].elapsed_time(e[1]) / 1e3, e[1].elapsed_time(e[2]) / 1e3, e[3].elapsed_time(e[4]) / 1e3


def run_step(runner: Runner, batch, measured: Measured | None = None, before_zero: Callable | None = None) -> float:
    """One training step after a barrier; ``before_zero`` runs between the optimizer step
    and zero_grad, outside the timed phases."""
    dist.barrier()
    _synchronize(runner.device)
    marks = _GPUMarks(runner.device)
    wait_clock = getattr(runner.engine, "wait_clock", None)  # None: a peer, or a --candidate from before it
    if wait_clock is not None:
        wait_clock.reset()
    faults = _minor_faults()
    start = _clock()
    marks.mark()
    loss = runner.forward_backward(batch)
    after_backward = _clock()
    marks.mark()
    runner.step()
    after_step = _clock()
    marks.mark()
    if before_zero is not None:
        before_zero()
    before_zero_grad = _clock()
    marks.mark()
    runner.zero_grad()
    marks.mark()
    _synchronize(runner.device)
    end = _clock()
    faults = _minor_faults() - faults
    if measured is not None:
        measured.minor_faults.append(faults)
        spans = [(start, after_backward), (after_backward, after_step), (before_zero_grad, end)]
        gpu_phases = marks.phases()
        measured.phases.append(gpu_phases or tuple(b[0] - a[0] for a, b in spans))
        measured.phase_cpu_main.append(tuple(b[2] - a[2] for a, b in spans))
        if gpu_phases is None:
            measured.steps.append(sum(measured.phases[-1]))
        else:  # the host ran ahead: the step is the wall time between the two synchronisations
            measured.steps.append(end[0] - start[0] - (before_zero_grad[0] - after_step[0]))
        cpu = sum(b[1] - a[1] for a, b in spans)
        measured.cpu.append(cpu)
        measured.cpu_other.append(cpu - sum(measured.phase_cpu_main[-1]))
        if wait_clock is not None:
            measured.exposed.append(dict(wait_clock.seconds))
    return float(loss)


def gradient_buckets(engine: Any) -> list[tuple[Any, torch.dtype]]:
    """Every gradient bucket and its reduce dtype; also for a ``--candidate`` checkout from
    before the engine was composed of parts (its engine held the buckets itself)."""
    if hasattr(engine, "reducer"):
        return [(b, engine.reduce_dtype(b.space)) for b in engine.reducer.buckets]
    return [(b, engine.grad_dtype(b.flat)) for b in engine.buckets]


def parameter_gathers(engine: Any) -> list[tuple[int, torch.dtype]] | None:
    """(full numel, dtype) of every parameter all-gather of one step: none at stage 0, one
    per bucket at stages 1-2, one per flat group of every unit and use at stage 3 (twice
    with ``reshard_after_forward``: forward and backward, except for the units the last
    forward kept gathered into backward; the bench's models use every unit once). None where
    the engine does not say (a ``--candidate`` from before the gatherers)."""
    if engine.stage == 0:
        return []
    gatherer = getattr(engine, "gatherer", None)
    flats = getattr(gatherer, "groups", None) if engine.stage < 3 else getattr(gatherer, "flats", None)
    if flats is None:
        return None
    uses = 2 if engine.stage == 3 and engine.config.reshard_after_forward else 1
    gathers = [(flat.layout.numel, flat.dtype) for flat in flats] * uses
    if uses == 2:  # the units kept gathered from forward into backward are gathered once
        for unit in getattr(gatherer, "last_kept", []):
            for flat in unit.flats:
                gathers.remove((flat.layout.numel, flat.dtype))
    return gathers


def _alone_s(launch: Callable[[], list[Any]], reps: int, device: torch.device) -> float:
    """Median seconds to launch ``launch``'s collectives and wait for them all, every rank
    starting together (on CUDA, until the GPU has finished them)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        for handle in launch():
            handle.wait()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def collectives_alone_s(runner: Runner, reps: int) -> tuple[float | None, float | None]:
    """Seconds the engine's gradient collectives, and its parameter all-gathers, take with
    nothing else running (see [Note: what is measured]): shardpar's own collective
    functions, on fresh buffers of the buckets' and groups' sizes."""
    engine = runner.engine
    world = dist.get_world_size()
    if engine is None or world == 1:
        return None, None
    device = runner.device
    inputs = [torch.zeros(b.spec.range.size, dtype=dtype, device=device) for b, dtype in gradient_buckets(engine)]
    outputs = [buf[: buf.numel() // world].clone() for buf in inputs]
    if engine.stage == 0:
        grads = _alone_s(lambda: [collectives.all_reduce(buf, async_op=True) for buf in inputs], reps, device)
    else:
        grads = _alone_s(lambda: [collectives.reduce_scatter(out, buf, async_op=True)
                                  for out, buf in zip(outputs, inputs)], reps, device)
    sizes = parameter_gathers(engine)
    if sizes is None:
        return grads, None
    fulls = [torch.zeros(numel, dtype=dtype, device=device) for numel, dtype in sizes]
    slices = [full[: full.numel() // world].clone() for full in fulls]
    gathers = _alone_s(lambda: [collectives.all_gather(full, part, async_op=True)
                                for full, part in zip(fulls, slices)], reps, device) if sizes else 0.0
    return grads, gathers


MEMORY_STEPS = 2
"""Steps of the memory phase: the first allocates optimizer state, the second is steady."""


def measure_memory(config: str, spec: ModelSpec, base: nn.Module, batches, args: argparse.Namespace) -> Measured:
    """Build one configuration alone, train ``MEMORY_STEPS`` steps and take its memory; drop it.
    On CUDA the memory is the caching allocator's (see [Note: on CUDA]), in the rss_* fields."""
    set_allocator(MEASURE_MMAP_BYTES)
    release_free_memory()
    on_gpu = args.torch_device.type == "cuda"
    if on_gpu:
        _synchronize(args.torch_device)
        torch.cuda.reset_peak_memory_stats(args.torch_device)
        exact, before = True, torch.cuda.memory_allocated(args.torch_device)
    else:
        exact = reset_peak_rss()
        before = current_rss()
    runner = build_runner(config, copy.deepcopy(base), spec, args)
    measured = Measured(rss_exact=exact)
    for i in range(MEMORY_STEPS - 1):
        run_step(runner, batches[i % len(batches)])
    run_step(runner, batches[(MEMORY_STEPS - 1) % len(batches)],
             before_zero=lambda: measured.state.update(runner.model_state()))
    measured.rss_peak = torch.cuda.max_memory_allocated(args.torch_device) if on_gpu else peak_rss()
    measured.rss_increase = measured.rss_peak - before
    runner.close()
    return measured


def _on(batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return batch[0].to(device), batch[1].to(device)


def warm_process(configs: list[str], args) -> None:
    """Pay one-time costs (lazy imports, gloo and autograd threads, allocator pools) on a
    tiny model first, so the first configuration's RSS increase is its own."""
    spec = ModelSpec("gpt", "warm-up", **SIZES["gpt"]["tiny"])
    base = spec.build()
    batch = _on(spec.batch_for(torch.Generator().manual_seed(0)), args.torch_device)
    for config in configs:
        runner = build_runner(config, copy.deepcopy(base), spec, args)
        for _ in range(2):
            run_step(runner, batch)
        runner.close()
    gc.collect()


def bench_model(spec: ModelSpec, configs: list[str], args) -> dict[str, Any]:
    """Every configuration on one model: memory alone one by one, then built together, warmed
    up and timed in interleaved rounds."""
    torch.manual_seed(args.seed)
    base = spec.build()
    psi = sum(p.numel() for p in base.parameters())
    generator = torch.Generator().manual_seed(args.seed * 1000 + dist.get_rank())
    batches = [_on(spec.batch_for(generator), args.torch_device) for _ in range(4)]
    measured = {config: measure_memory(config, spec, base, batches, args) for config in configs}
    set_allocator(TIMING_MMAP_BYTES)
    runners: dict[str, Runner] = {}
    for config in configs:
        runners[config] = build_runner(config, copy.deepcopy(base), spec, args)
        for i in range(args.warmup):
            run_step(runners[config], batches[i % len(batches)])
    step_index = args.warmup
    for r in range(args.rounds):
        order = configs[r % len(configs):] + configs[: r % len(configs)]
        for config in order:
            runner, m = runners[config], measured[config]
            if runner.engine is not None:
                runner.model.reset_comm_stats()
            for s in range(args.steps_per_round):
                m.final_loss = run_step(runner, batches[(step_index + s) % len(batches)], m)
            if runner.engine is not None:
                accumulate_comm(m, runner.model.comm_stats(), args.steps_per_round)
        step_index += args.steps_per_round
    for config in configs:
        m = measured[config]
        m.grad_alone_s, m.gather_alone_s = collectives_alone_s(runners[config], args.comm_reps)
        runners[config].close()
    runners.clear()
    gc.collect()
    gathered: list[dict[str, Any]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(gathered, {c: asdict(m) for c, m in measured.items()})
    return summarize(spec, psi, configs, gathered, args)


def accumulate_comm(m: Measured, stats: dict[str, dict[str, float]], steps: int) -> None:
    """Per-step bytes from one round's counters (every round moves the same bytes)."""
    m.sent_bytes = stats["total"]["sent_bytes"] / steps
    m.padding_bytes = stats["total"]["padding_sent_bytes"] / steps
    m.sent_by_op = {op: v["sent_bytes"] / steps for op, v in stats.items() if op != "total"}


# --------------------------------------------------------------------------- summary


def quantiles(values: list[float]) -> dict[str, float]:
    values = sorted(values)
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": q[1], "p25": q[0], "p75": q[2], "min": values[0], "max": values[-1]}


def exposure(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Exposed seconds per phase and per step (each rank's median over the timed steps, the
    slowest rank's), the collectives alone, and the hidden fraction; what is known of them."""
    out: dict[str, Any] = {}
    if all(m["exposed"] for m in per_rank):
        out["exposed_s"] = {
            phase: max(statistics.median(step.get(phase, 0.0) for step in m["exposed"]) for m in per_rank)
            for phase in WAIT_PHASES
        }
        out["exposed_total_s"] = max(statistics.median(sum(step.values()) for step in m["exposed"]) for m in per_rank)
    if all(m["grad_alone_s"] is not None for m in per_rank):
        out["grad_alone_s"] = max(m["grad_alone_s"] for m in per_rank)
    if all(m["gather_alone_s"] is not None for m in per_rank):
        out["gather_alone_s"] = max(m["gather_alone_s"] for m in per_rank)
    if "grad_alone_s" in out and "gather_alone_s" in out:
        out["comm_alone_s"] = out["grad_alone_s"] + out["gather_alone_s"]
        if "exposed_total_s" in out and out["comm_alone_s"] > 0:
            out["hidden"] = min(1.0, max(0.0, 1 - out["exposed_total_s"] / out["comm_alone_s"]))
    return out


def summarize(spec: ModelSpec, psi: int, configs: list[str], ranks: list[dict], args) -> dict[str, Any]:
    world = len(ranks)
    per_config: dict[str, Any] = {}
    for config in configs:
        per_rank = [r[config] for r in ranks]
        # A step takes as long as its slowest rank.
        steps = [max(times) for times in zip(*(m["steps"] for m in per_rank))]
        phases = [[max(p[i] for p in ps) for i in range(3)] for ps in zip(*(m["phases"] for m in per_rank))]
        row: dict[str, Any] = {
            "step_s": quantiles(steps),
            "phase_s": {k: statistics.median(p[i] for p in phases) for i, k in enumerate(("fwd_bwd", "opt", "zero"))},
            "cpu_s": max(statistics.median(m["cpu"]) for m in per_rank),
            "cpu_other_s": max(statistics.median(m["cpu_other"]) for m in per_rank),
            "minor_faults": max(statistics.median(m["minor_faults"]) for m in per_rank),
            "phase_cpu_main_s": {
                k: max(statistics.median(p[i] for p in m["phase_cpu_main"]) for m in per_rank)
                for i, k in enumerate(("fwd_bwd", "opt", "zero"))
            },
            "state": [m["state"] for m in per_rank],
            "model_state": [sum(m["state"].get(k, 0) for k in ("params", "grads", "optimizer_state")) for m in per_rank],
            "formula": zero_formula(config, psi, world),
            "rss_increase": [m["rss_increase"] for m in per_rank],
            "rss_peak": [m["rss_peak"] for m in per_rank],
            "rss_exact": all(m["rss_exact"] for m in per_rank),
            "final_loss": per_rank[0]["final_loss"],
        }
        if per_rank[0]["sent_bytes"] is not None:
            stage = stage_of(config)
            options = {**args.wrap_options, **(args.candidate_options if config.endswith(CANDIDATE) else {})}
            closed = shardpar.estimate_communication(
                spec.build(), world, stage,
                bucket_cap_mb=options.get("bucket_cap_mb", shardpar.ShardConfig.bucket_cap_mb),
                wrap_policy=[spec.unit_class] if stage == 3 else None,
                align_for_bandwidth=options.get("align_for_bandwidth"),
            )
            row["sent_bytes"] = [m["sent_bytes"] for m in per_rank]
            row["padding_bytes"] = [m["padding_bytes"] for m in per_rank]
            row["closed_form_bytes"] = closed.sent_bytes
            row["closed_form_padding_bytes"] = closed.padding_sent_bytes
            row.update(exposure(per_rank))
        per_config[config] = row
    for config, row in per_config.items():
        if stage_of(config) is None:
            continue
        peer = peer_of(config, per_config)
        if peer in per_config:
            row["peer"] = peer
            row["vs_peer"] = row["step_s"]["median"] / per_config[peer]["step_s"]["median"]
        base = config.removesuffix(CANDIDATE)
        if base != config and base in per_config:
            row["vs_base"] = row["step_s"]["median"] / per_config[base]["step_s"]["median"]
    return {"model": spec.name, "description": spec.describe(), "params": psi, "world": world, "configs": per_config}


# --------------------------------------------------------------------------- report

TARGETS = {"stage0": 0.95, "stage1": 0.85, "stage2": 0.85, "stage3": 0.60}
"""Step time over the peer's (issue #16, "Communication that hides behind compute"; the first
round's were 1.00 / 0.90 / 0.90 / 0.80). Not against plain torch, which does less."""


def machine(device: torch.device) -> dict[str, Any]:
    model = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": model,
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads_per_rank": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        **(gpu_info(device) if device.type == "cuda" else {}),
    }


def gpu_info(device: torch.device) -> dict[str, Any]:
    """The GPU a rank runs on, and the CUDA and NCCL it runs with (CUDA runs only)."""
    nccl = torch.cuda.nccl.version() if hasattr(torch.cuda, "nccl") else None
    return {
        "gpu": torch.cuda.get_device_name(device),
        "gpus_visible": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl),
    }


def command_line(world: int) -> str:
    args = shlex.join(["tools/bench.py", *sys.argv[1:]])
    if "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_WORLD_SIZE" in os.environ:
        return f"torchrun --standalone --nproc_per_node {world} {args}"
    return f"python {args}"


def _mib(n: float) -> str:
    return f"{n / MIB:.1f}"


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _per_rank(values: list[float], fmt: Callable[[float], str]) -> str:
    return " / ".join(fmt(v) for v in values)


def timing_table(result: dict[str, Any]) -> list[str]:
    lines = [
        ("| config | median step ms | IQR ms | min–max ms | vs peer | fwd+bwd ms | opt step ms | zero_grad ms "
         "| CPU ms/step (comm threads) |"),
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for config, row in result["configs"].items():
        q, ph = row["step_s"], row["phase_s"]
        vs = f"{row['vs_peer']:.2f}× {row['peer']}" if "vs_peer" in row else "—"
        if config in TARGETS and "vs_peer" in row and row["peer"] != PLAIN:  # targets are against the peers
            vs += " ✓" if row["vs_peer"] <= TARGETS[config] else f" ✗ (target ≤ {TARGETS[config]:.2f})"
        if "vs_base" in row:
            vs += f"; {row['vs_base']:.2f}× {config.removesuffix(CANDIDATE)}"
        lines.append(
            f"| {config} | {_ms(q['median'])} | {_ms(q['p25'])}–{_ms(q['p75'])} | {_ms(q['min'])}–{_ms(q['max'])} "
            f"| {vs} | {_ms(ph['fwd_bwd'])} | {_ms(ph['opt'])} | {_ms(ph['zero'])} "
            f"| {_ms(row['cpu_s'])} ({_ms(row['cpu_other_s'])}) |"
        )
    return lines


PHASE_LABELS = {"forward": "forward", "backward_gather": "backward gathers", "backward": "backward reductions",
                "step": "step"}
"""Report names of the wait clock's phases (shardpar.core.wait_clock.PHASES)."""


def exposure_table(result: dict[str, Any]) -> list[str]:
    """Exposed communication per phase and per step against the same collectives alone."""
    lines = [
        ("| config | " + " | ".join(f"{PHASE_LABELS[p]} ms" for p in WAIT_PHASES)
         + " | exposed ms | exposed / step | grads alone ms | gathers alone ms | comm alone ms | hidden |"),
        "|---|" + "---:|" * (len(WAIT_PHASES) + 6),
    ]
    for config, row in result["configs"].items():
        if "exposed_s" in row:
            waits = [_ms(row["exposed_s"][p]) for p in WAIT_PHASES]
            waits += [_ms(row["exposed_total_s"]), f"{row['exposed_total_s'] / row['step_s']['median']:.0%}"]
        else:
            waits = ["—"] * (len(WAIT_PHASES) + 2)
        alone = [_ms(row[k]) if k in row else "—" for k in ("grad_alone_s", "gather_alone_s", "comm_alone_s")]
        hidden = f"{row['hidden']:.0%}" if "hidden" in row else "—"
        lines.append(f"| {config} | {' | '.join(waits + alone)} | {hidden} |")
    return lines


def _longest_wait(row: dict[str, Any]) -> str:
    phase = max(WAIT_PHASES, key=lambda p: row["exposed_s"][p])
    return PHASE_LABELS[phase] if row["exposed_s"][phase] > 0 else "none"


def _span(values: list[float], fmt: Callable[[float], str]) -> str:
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}–{high}"


def _waits_hidden(result: dict[str, Any], row: dict[str, Any]) -> float:
    """The ratio to the peer with every wait of the step hidden and nothing else changed."""
    return (row["step_s"]["median"] - row["exposed_total_s"]) / result["configs"][row["peer"]]["step_s"]["median"]


def limits_section(results: list[dict[str, Any]], nproc: int) -> list[str]:
    """What this run's figures say limits each stage's ratio to its peer: how much of the step
    is spent waiting for collectives, where, and the ratio with every wait hidden."""
    rows = [(result, config, row) for result in results for config, row in result["configs"].items()
            if "exposed_s" in row and "vs_peer" in row]
    if not rows:
        return []
    lines = [
        f"## What limits the ratios on {nproc} cores",
        "",
        ("Derived from the tables above. *Exposed* is the step's waits for collectives (the wait clock), its "
         "share of the median step in brackets; *longest wait* the phase that waited most; *vs peer, every wait "
         "hidden* = (median step − exposed) / the peer's median step, the ratio if overlap hid every wait and "
         "nothing else changed (optimistic where communication threads share the cores with compute: a hidden "
         "collective still costs their CPU); *comm-thread CPU*: CPU ms per step of the threads other than the "
         "main one, the peer's in brackets."),
        "",
        "| model | config | vs peer | exposed ms | longest wait | hidden | vs peer, every wait hidden "
        "| comm-thread CPU ms |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for result, config, row in rows:
        peer = result["configs"][row["peer"]]
        share = row["exposed_total_s"] / row["step_s"]["median"]
        hidden = f"{row['hidden']:.0%}" if "hidden" in row else "—"
        lines.append(
            f"| {result['model']} | {config} | {row['vs_peer']:.2f}× {row['peer']} | {_ms(row['exposed_total_s'])} "
            f"({share:.0%}) | {_longest_wait(row)} | {hidden} | {_waits_hidden(result, row):.2f}× | {_ms(row['cpu_other_s'])} "
            f"({_ms(peer['cpu_other_s'])}) |"
        )
    lines.append("")
    for config in dict.fromkeys(config for _, config, _ in rows):
        mine = [(result, row) for result, c, row in rows if c == config]
        shares = [row["exposed_total_s"] / row["step_s"]["median"] for _, row in mine]
        longest = [_longest_wait(row) for _, row in mine]
        top = max(dict.fromkeys(longest), key=longest.count)
        hidden = [row["hidden"] for _, row in mine if "hidden" in row]
        lines.append(
            f"- **{config}**: waiting was {_span(shares, lambda v: f'{v:.0%}')} of the median step "
            f"({_span([row['exposed_total_s'] for _, row in mine], _ms)} ms) "
            + (f"over {len(mine)} models; the longest wait was in *{top}* for {longest.count(top)} of them"
               if len(mine) > 1 else f"on {mine[0][0]['model']}; the longest wait was in *{top}*")
            + (f"; hidden {_span(hidden, lambda v: f'{v:.0%}')}." if hidden else ".")
        )
    lines.append("")
    missed = [(result, config, row) for result, config, row in rows
              if config in TARGETS and row["peer"] != PLAIN and row["vs_peer"] > TARGETS[config]]
    if all(row["peer"] == PLAIN for _, _, row in rows):
        lines.append(f"The time targets are against the distributed peers; this run compares with plain torch "
                     f"(`{PLAIN}`) only.")
    elif not missed:
        lines.append("Every time target is met in this run; *vs peer, every wait hidden* is how far each ratio "
                     "could still move by overlap alone.")
    else:
        lines += ["Time targets missed in this run:", ""]
    for result, config, row in missed:
        peer = result["configs"][row["peer"]]
        bound, limit = _waits_hidden(result, row), TARGETS[config]
        head = (f"- {result['model']} {config}: {row['vs_peer']:.2f}× {row['peer']} against a target of "
                f"≤ {limit:.2f}×; with every wait hidden it would be {bound:.2f}×")
        if bound <= limit:
            lines.append(f"{head}: the {_ms(row['exposed_total_s'])} ms of waiting (most in "
                         f"*{_longest_wait(row)}*) accounts for the gap.")
        else:
            lines.append(f"{head}, still above: waiting is not what limits it but the rest of the step, "
                         f"{_ms(row['cpu_s'])} ms of process CPU against the peer's {_ms(peer['cpu_s'])} "
                         f"(communication threads {_ms(row['cpu_other_s'])} against {_ms(peer['cpu_other_s'])}).")
    return lines


def memory_table(result: dict[str, Any], peak: str = "RSS") -> list[str]:
    """``peak`` names what the peak columns measure: "RSS", or "CUDA allocated" on a GPU."""
    lines = [
        ("| config | model state MiB (rank 0 / 1 …) | ZeRO formula MiB | measured / formula | workspace MiB "
         f"| peak {peak} increase MiB | peak {peak} MiB | sent MB/step | closed form MB | difference | padding MB |"),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config, row in result["configs"].items():
        ratio = max(row["model_state"]) / row["formula"]
        mark = " ✓" if abs(ratio - 1) <= 0.10 else " ✗"
        workspace = _per_rank([s.get("workspace", 0) for s in row["state"]], _mib) if config.startswith("stage") else "—"
        if "sent_bytes" in row:
            sent = max(row["sent_bytes"])
            closed = row["closed_form_bytes"]
            diff = (sent - closed) / closed if closed else 0.0
            comm = (f"{sent / 1e6:.2f} | {closed / 1e6:.2f} | {diff:+.2%}{' ✓' if abs(diff) <= 0.01 else ' ✗'} "
                    f"| {max(row['padding_bytes']) / 1e6:.4f}")
        else:
            comm = "— | — | — | —"
        rss_note = "" if row["rss_exact"] else " (not reset)"
        lines.append(
            f"| {config} | {_per_rank(row['model_state'], _mib)} | {_mib(row['formula'])} | {ratio:.3f}{mark} "
            f"| {workspace} | {_per_rank(row['rss_increase'], _mib)}{rss_note} | {_per_rank(row['rss_peak'], _mib)} "
            f"| {comm} |"
        )
    return lines


def targets_section(results: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | target | measured | met |", "|---|---|---:|---|"]
    for result in results:
        if result["world"] == 1:
            continue
        for config, limit in TARGETS.items():
            row = result["configs"].get(config)
            if row is None or "vs_peer" not in row:
                continue
            met = "yes" if row["vs_peer"] <= limit else "**no**"
            lines.append(f"| {result['model']} | {config} ≤ {limit:.2f}× {row['peer']} | {row['vs_peer']:.2f}× | {met} |")
        for config, row in result["configs"].items():
            if "sent_bytes" in row:
                diff = (max(row["sent_bytes"]) - row["closed_form_bytes"]) / row["closed_form_bytes"]
                met = "yes" if abs(diff) <= 0.01 else "**no**"
                lines.append(f"| {result['model']} | {config} bytes/step = closed form ±1% | {diff:+.2%} | {met} |")
            if config.startswith("stage"):
                ratio = max(row["model_state"]) / row["formula"]
                met = "yes" if abs(ratio - 1) <= 0.10 else "**no**"
                lines.append(f"| {result['model']} | {config} model state = ZeRO formula ±10% | {ratio:.3f}× | {met} |")
    return lines


COLUMNS = (
    "Columns. *median step*, *IQR*, *min–max*: wall time of forward + backward + optimizer step + zero_grad, "
    "the slowest rank's, over the timed steps. *vs peer*: median over the matching peer's median (stage 0 vs "
    "DDP, stages 1–2 vs DDP + ZeroRedundancyOptimizer, stage 3 vs FSDP2). *fwd+bwd*, *opt step*, *zero_grad*: "
    "median wall time of each phase. *CPU ms/step*: CPU time of the whole rank process per step (in brackets: "
    "of its threads other than the main one, i.e. gloo's communication threads); on a loaded machine this is "
    "steadier than wall time. "
    "Exposed communication (second table): what the rank's main thread waited for collectives during the step "
    "(`engine.wait_clock`, reset before every step), per phase: *forward* (parameter all-gathers completed in "
    "forward: stages 1–2's post-step gathers, stage 3's unit gathers), *backward gathers* (stage 3's gathers "
    "in backward), *backward reductions* (gradient collectives) and *step* (what `step()` and zero_grad "
    "waited for, e.g. a post-step gather still in flight); each the median over the timed steps, the slowest "
    "rank's; *exposed* the median of the step's total (so not always the sum of the phases), *exposed / step* "
    "its share of the median step. *grads alone*, *gathers alone*: the same collectives (shardpar's functions, "
    "same sizes and dtypes: one per gradient bucket; one all-gather per bucket at stages 1–2, per unit group "
    "and pass at stage 3) timed with nothing else running; *comm alone* their sum; *hidden* = 1 − exposed / comm "
    "alone, clamped to [0, 1]. The peers wait inside torch (DDP's C++ reducer, ZeroRedundancyOptimizer's "
    "broadcasts, FSDP2's hooks), where the benchmark cannot time their waits without changing them: their "
    "cells show —. *Model state*: params + grads "
    "+ optimizer state as the engine accounts it (`memory_stats()`; for the peers the tensors they hold, local "
    "shards for FSDP2) against DESIGN.md's ZeRO formula (peers: the stage they match). *Peak RSS increase*: "
    "VmHWM minus RSS before building, with the configuration alone in the process for 2 steps (see the note "
    "in tools/bench.py). *Sent*: `comm_stats()` per step, padding shown apart, against "
    "`shardpar.estimate_communication`."
)
CUDA_COLUMNS = (
    "On CUDA (see the note in tools/bench.py): every step runs between two `torch.cuda.synchronize()`, so its "
    "time includes the GPU work it queued; *fwd+bwd*, *opt step*, *zero_grad* are GPU time between CUDA events "
    "on the current stream; *peak CUDA allocated increase*: `torch.cuda.max_memory_allocated` over the "
    "configuration's 2 steps above what was allocated before it was built; the wait clock counts only the "
    "host's waits, so a step that never synchronises shows none. At world size 1, *torch* is plain torch "
    "(the model and AdamW, no wrapper), every stage's peer."
)


def write_report(path: Path, results: list[dict[str, Any]], info: dict[str, Any], args, png: Path | None) -> None:
    kept = ""
    if path.exists():
        text = path.read_text()
        if KEEP_MARKER in text:
            kept = text.split(KEEP_MARKER, 1)[1]
    world = results[0]["world"]
    lines = [
        "# Benchmarks: shardpar stages 0–3 against torch DDP, ZeroRedundancyOptimizer and FSDP2",
        "",
        "Generated by `tools/bench.py` from one run of:",
        "",
        "```",
        info["command"],
        "```",
        "",
        (f"- Machine: {info['cpu']}, `nproc` = {info['nproc']}; {world} rank(s), {info['threads_per_rank']} "
         f"intra-op thread(s) per rank, backend {info['backend']}"),
        *([f"- GPU: {info['gpu']} ({info['gpus_visible']} visible), one per rank (`cuda:LOCAL_RANK`); "
           f"CUDA {info['cuda']}, NCCL {info['nccl']}"] if "gpu" in info else []),
        f"- torch {info['torch']}, Python {info['python']}; run started {info['date']}, took {info['elapsed_s']:.0f} s",
        (f"- Load average (1/5/15 min): {info['load_start']} at start, {info['load_end']} at end "
         "(other processes on the machine slow every configuration; interleaving spreads that evenly)"),
        (f"- Per configuration: {args.warmup} warm-up steps (excluded), then {args.rounds} interleaved rounds × "
         f"{args.steps_per_round} timed steps; AdamW lr 1e-3, fp32; shardpar.wrap options: "
         f"{args.wrap_options or 'defaults'} (+ the blocks as stage-3 units)"),
        ("- Peers: `DistributedDataParallel` (defaults), DDP + `ZeroRedundancyOptimizer(AdamW)` (defaults), "
         "`fully_shard` (FSDP2) on every block then the root; shardpar stage 3 uses the same blocks as units"),
        *([f"- Plain torch (`{PLAIN}`): the model and AdamW, no wrapper; every stage's peer at world size 1"]
          if any(PLAIN in result["configs"] for result in results) else []),
        "",
        COLUMNS,
        *(["", CUDA_COLUMNS] if "gpu" in info else []),
        "",
    ]
    if png is not None:
        lines += [f"![step time per configuration]({png.name})", ""]
    for result in results:
        lines += [f"## {result['model']}: {result['description']}, Ψ = {result['params']:,} parameters", ""]
        peak = "CUDA allocated" if "gpu" in info else "RSS"
        lines += timing_table(result) + [""] + exposure_table(result) + [""] + memory_table(result, peak) + [""]
        losses = {c: r["final_loss"] for c, r in result["configs"].items()}
        spread = max(losses.values()) - min(losses.values())
        lines += [f"Final loss after the same steps, all configurations: {min(losses.values()):.5f}–"
                  f"{max(losses.values()):.5f} (spread {spread:.1e}; same data and updates everywhere).", ""]
    if world > 1:
        lines += [f"## Targets (world size {world}, {info['backend']})", ""] + targets_section(results) + [""]
        limits = limits_section(results, info["nproc"])
        lines += limits + ([""] if limits else [])
    lines += [KEEP_MARKER]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + (kept if kept else "\n"))


def write_chart(path: Path, results: list[dict[str, Any]]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 3.8), squeeze=False)
    for ax, result in zip(axes[0], results):
        names = list(result["configs"])
        med = [result["configs"][c]["step_s"]["median"] * 1e3 for c in names]
        low = [m - result["configs"][c]["step_s"]["p25"] * 1e3 for m, c in zip(med, names)]
        high = [result["configs"][c]["step_s"]["p75"] * 1e3 - m for m, c in zip(med, names)]
        colors = ["tab:blue" if c.startswith("stage") else "tab:gray" for c in names]
        ax.bar(names, med, yerr=[low, high], color=colors, capsize=3, label="median step (IQR)")
        cpu = [result["configs"][c]["cpu_s"] * 1e3 for c in names]
        ax.plot(names, cpu, "k_", markersize=16, mew=2, label="CPU ms/step")
        ax.set_title(f"{result['model']} (Ψ={result['params'] / 1e6:.1f}M, N={result['world']})", fontsize=9)
        ax.set_ylabel("ms per step")
        ax.legend(fontsize=7)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp:small,mlp:large,gpt:small,gpt:large",
                        help="comma-separated KIND:SIZE, kinds mlp and gpt, sizes tiny, small, large")
    parser.add_argument("--configs", default=None,
                        help=f"subset of {','.join(KNOWN_CONFIGS)} (default: {','.join(ALL_CONFIGS)}; with --device "
                             f"cuda at world size 1 the stages and {PLAIN})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo (default); cuda: cuda:LOCAL_RANK and NCCL (see [Note: on CUDA])")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--comm-reps", type=int, default=5, help="repetitions of the isolated collectives")
    parser.add_argument("--wrap-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a shardpar.wrap option for every stage, e.g. bucket_cap_mb=4 (value: a Python literal)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--png", type=Path, default=None,
                        help="chart (written only when matplotlib is importable; default: --out with .png)")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw summary here")
    parser.add_argument("--candidate", type=Path, default=None,
                        help="another checkout whose shardpar also runs, as stageN-cand (A/B a patch)")
    parser.add_argument("--candidate-option", action="append", default=[], metavar="KEY=VALUE",
                        help="a wrap option for the stageN-cand runs only (with or without --candidate)")
    args = parser.parse_args(argv)
    if args.png is None:
        args.png = args.out.with_suffix(".png")
    args.model_specs = parse_models(args.models)
    args.wrap_options = dict(parse_option(text) for text in args.wrap_option)
    args.candidate_options = dict(parse_option(text) for text in args.candidate_option)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; a plain python run is one rank
    if args.configs is None:
        args.config_list = default_configs(args.device, world)
    else:
        args.config_list = [c.strip() for c in args.configs.split(",")]
    unknown = [c for c in args.config_list if c not in KNOWN_CONFIGS]
    if unknown or args.warmup < 1 or args.rounds < 1 or args.steps_per_round < 1:
        raise SystemExit(f"error: bad --configs {unknown} or a count below 1")
    if PLAIN in args.config_list and world > 1:
        raise SystemExit(f"error: --configs {PLAIN}: plain torch averages no gradients, so it runs at world size 1 only")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if args.candidate is not None:
        load_candidate(args.candidate)
    if args.candidate is not None or args.candidate_options:
        args.config_list += [c + CANDIDATE for c in args.config_list if stage_of(c) is not None]
    return args


def parse_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or key not in shardpar.ShardConfig.option_names():
        raise SystemExit(f"error: --wrap-option {text!r}: expected KEY=VALUE with KEY a shardpar.wrap option")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def init_group(kind: str = "cpu") -> torch.device:
    """torchrun's group, or a one-rank group so the peers also run under plain python: gloo on
    the CPU, NCCL on ``cuda:LOCAL_RANK`` (made current first). Returns the rank's device."""
    device = torch.device("cpu")
    options: dict[str, Any] = {}
    if kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        options["device_id"] = device
    backend = "nccl" if kind == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, **options)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **options)
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.torch_device = init_group(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    info = {**machine(args.torch_device), "command": command_line(world), "load_start": "{:.2f} / {:.2f} / {:.2f}".format(*os.getloadavg())}
    started = time.perf_counter()
    warm_process(args.config_list, args)
    results = []
    for spec in args.model_specs:
        if rank == 0:
            print(f"[bench] {spec.name}: {spec.describe()}", flush=True)
        results.append(bench_model(spec, args.config_list, args))
        if rank == 0:
            for line in timing_table(results[-1]) + exposure_table(results[-1]):
                print(line, flush=True)
    info["elapsed_s"] = time.perf_counter() - started
    info["load_end"] = "{:.2f} / {:.2f} / {:.2f}".format(*os.getloadavg())
    if rank == 0:
        png = args.png if args.png and write_chart(args.png, results) else None
        write_report(args.out, results, info, args, png)
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "results": results}, indent=1))
        print(f"[bench] wrote {args.out}" + (f" and {png}" if png else " (no chart: matplotlib not importable)"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
