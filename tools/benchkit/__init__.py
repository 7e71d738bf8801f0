"""The benchmark behind ``tools/bench.py``: shardpar stages 0-3 against torch DDP, DDP +
ZeroRedundancyOptimizer and FSDP2, in one run (see tools/bench.py for the commands).

One module per job:

    models      the model zoo (``--models``: MLP stacks and transformers, tiny to large; the
                overhead stack, [Note: the overhead model])
    optimizers  what a model trains with: AdamW, or nanochat's Muon + AdamW (``nanochat:SIZE``)
    distmuon    the DistMuon-style peer's optimizer (issue #43's baseline, [Note: the DistMuon peer])
    runners     one configuration each: shardpar stage N, DDP, DDP + ZeRO, FSDP2, plain torch;
                hybrid sharding stageN-gG against FSDP2's HSDP hsdp-gG ([Note: hybrid configurations]);
                distmuon for a model trained with Muon + AdamW ([Note: Muon configurations])
    measure     one timed training step: wall, phases, CPU, page faults, waits; one untimed
                step's Python calls into shardpar ([Note: host columns])
    memory      the memory phase: each configuration alone, its peak RSS or CUDA allocation
    comm_alone  the collectives of one step timed with nothing else running
    run         one model: the memory phase, then warm-up and interleaved timed rounds
    stats       every rank's figures into one summary per configuration
    tables      the Markdown tables of the report
    report      the report page, its chart and the machine it ran on
    __main__    the command line (``python -m tools.benchkit`` runs it too)

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
  against docs/design.md's ZeRO formula; and the process's peak RSS above what it held before
  the configuration was built (VmHWM, reset through /proc/self/clear_refs, with glibc's
  mmap threshold lowered and free heap pages trimmed first, so no tensor lands on pages
  counted before), each configuration alone in the process for ``MEMORY_STEPS`` steps,
  then dropped. See [Note: allocator modes] in memory.py.
- Bytes: ``comm_stats()`` over the timed steps / steps, against ``estimate_communication``
  (payload and, in the JSON summary, padding, with the configuration's bucket cap and
  alignment). Under hybrid sharding also per group (``comm_stats()["by_group"]``: within the
  shard groups, across replicas, all ranks) against ``estimate_communication(...,
  shard_group_size=G).by_group``, the closed forms of docs/design.md; the report's "bytes per
  group" table shows them when a hybrid configuration ran.
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
  hidden = 1 - exposed / (gradients alone + gathers alone), clamped to [0, 1]. Under hybrid
  sharding the collectives run on the shard group and each reduce-scatter is followed by the
  all-reduce of the owned slice across replicas, counted with the gradients ([Note: hybrid
  sharding alone] in comm_alone.py).

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

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's shardpar, wherever the bench is run from
