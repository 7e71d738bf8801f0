"""The configurations: shardpar stage N (this checkout's, or a ``--candidate`` checkout's as
``stageN-cand``), and the peers it is measured against: torch DDP, DDP +
ZeroRedundancyOptimizer, FSDP2, and plain torch at world size 1; hybrid sharding,
``stageN-gG`` against FSDP2's HSDP ``hsdp-gG`` (see [Note: hybrid configurations]); and, for a
model trained with Muon + AdamW, the DistMuon-style peer ``distmuon`` (see [Note: Muon
configurations]).

A :class:`Runner` holds one configuration (a model copy, its wrapper and optimizers) and splits
its training step into phases so the report can say where the time goes.

[Note: Muon configurations]
A model's ``ModelSpec.optimizers`` says what every configuration trains it with (optimizers.py).
With ``"muon+adamw"`` (nanochat:SIZE) the stages build two shardpar optimizers over the wrapped
model, ``shardpar.optimizer(model, torch.optim.Muon, matrices, ...)`` and ``shardpar.optimizer(
model, torch.optim.AdamW, rest, ...)``, and ``ddp`` and ``torch`` the same two torch optimizers,
so DDP stays the oracle; ``distmuon`` is the peer issue #43 measures the stages against
(tools/benchkit/distmuon.py: whole matrices owned round-robin, ZeRO-1 AdamW). ZeroRedundancyOptimizer,
FSDP2 and HSDP run AdamW only here, so ``ddp+zero``, ``fsdp2`` and ``hsdp-gG`` are refused with
such a model, and ``distmuon`` with a model trained with AdamW alone (it would compare Muon with
AdamW). At stages 1-3 shardpar refuses Muon until it owns whole tensors (issue #43): those
configurations are built the same way and fail with shardpar's ValueError naming the class.

[Note: hybrid configurations]
``stageN-gG`` (N = 1..3) is ``shardpar.wrap(model, stage=N, shard_group_size=G)``: state
sharded over groups of G consecutive ranks, replicated across the R = world/G groups.
``hsdp-gG`` is its peer, FSDP2 on the same layout: ``fully_shard`` on every block then the
root with ``mesh=init_device_mesh(device, (R, G), mesh_dim_names=("replicate", "shard"))``,
whose shard dimension groups consecutive ranks as shardpar's shard groups do. Each is also
compared with its full-sharding sibling (``stageN``, ``fsdp2``). G must divide the world size
and lie strictly between 1 and it: G = world is ``stageN`` itself, and G = 1 shards nothing
(stage 0 moves the same bytes). Stage 0 ignores ``shard_group_size``, so ``stage0-gG`` is
refused, and so is ``--wrap-option shard_group_size=...``: a configuration's G is in its name,
where the closed forms and the report read it. Stages 1-2 have no HSDP peer (FSDP2 always
shards parameters): their ``vs peer`` stays empty and the hybrid table compares them with
their full-sharding sibling only.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardpar

from .distmuon import DistMuonAdamW
from .models import ModelSpec
from .optimizers import ADAMW_ONLY_OPTIONS, MUON_ADAMW, build_optimizers, torch_optimizer

ALL_CONFIGS = ["stage0", "stage1", "stage2", "stage3", "ddp", "ddp+zero", "fsdp2"]
PLAIN = "torch"
"""Plain torch, no wrapper: every stage's peer at world size 1 on CUDA (``--configs`` may name
it at world size 1 on the CPU too)."""
DISTMUON = "distmuon"
"""The DistMuon-style peer of a model trained with Muon + AdamW ([Note: Muon configurations])."""
KNOWN_CONFIGS = [*ALL_CONFIGS, PLAIN, DISTMUON]
ADAMW_ONLY_CONFIGS = ("ddp+zero", "fsdp2", "hsdp")
"""The peers that train with AdamW alone (a hybrid hsdp-gG by its base)."""
HYBRID_CONFIGS = ["stage1-gG", "stage2-gG", "stage3-gG", "hsdp-gG"]
"""Patterns of the hybrid configurations (G a number): see [Note: hybrid configurations]."""
PEER_STAGE = {"ddp": 0, "ddp+zero": 1, "fsdp2": 3, PLAIN: 0, DISTMUON: 1}
"""The shardpar stage each peer matches (same storage and collectives)."""
CANDIDATE = "-cand"
"""Suffix of the stages run from ``--candidate`` (another checkout's shardpar, to A/B a patch)."""
_HYBRID = re.compile(r"(?P<base>stage\d|hsdp)-g(?P<size>\d+)")


def stage_of(config: str) -> int | None:
    """3 for "stage3", "stage3-cand" and "stage3-g2"; None for the peers."""
    return int(config[len("stage")]) if config.startswith("stage") else None


def shard_group_size_of(config: str) -> int | None:
    """G of a hybrid configuration ("stage3-g2", "stage3-g2-cand", "hsdp-g2"); None for the others."""
    match = _HYBRID.fullmatch(config.removesuffix(CANDIDATE))
    return int(match["size"]) if match else None


def full_sharding_of(config: str) -> str:
    """A hybrid configuration's full-sharding sibling: "stage3-g2-cand" -> "stage3-cand",
    "hsdp-g2" -> "fsdp2"; any other configuration itself."""
    match = _HYBRID.fullmatch(config.removesuffix(CANDIDATE))
    if match is None:
        return config
    return "fsdp2" if match["base"] == "hsdp" else match["base"] + config[match.end() :]


def config_problem(config: str, world: int) -> str | None:
    """Why ``--configs`` cannot hold ``config`` at ``world`` ranks; None when it can."""
    if config in KNOWN_CONFIGS:
        return None
    match = _HYBRID.fullmatch(config)
    if match is None:
        return f"unknown configuration {config!r}"
    if match["base"] == "stage0":
        return f"{config}: stage 0 ignores shard_group_size (every rank holds everything); name stage1-3"
    if match["base"] not in ("stage1", "stage2", "stage3", "hsdp"):
        return f"unknown configuration {config!r}"
    size = int(match["size"])
    if not 1 < size < world or world % size:
        return (
            f"{config}: G = {size} must divide the world size {world} and lie strictly between 1 and it "
            f"(G = {world} is full sharding, G = 1 shards nothing)"
        )
    return None


def optimizers_problem(config: str, optimizers: str) -> str | None:
    """Why ``config`` cannot train a model with ``optimizers`` ([Note: Muon configurations]);
    None when it can."""
    match = _HYBRID.fullmatch(config)
    base = match["base"] if match else config
    if optimizers == MUON_ADAMW and base in ADAMW_ONLY_CONFIGS:
        return f"{config} trains with AdamW only, not Muon + AdamW; name distmuon, ddp or the stages"
    if optimizers != MUON_ADAMW and config == DISTMUON:
        return f"{DISTMUON} trains with Muon + AdamW, which this model is not trained with"
    return None


def peer_of(config: str, present: Any = ()) -> str | None:
    """The peer a stage is compared with: its distributed counterpart, or plain torch when only
    that is in ``present`` (world size 1 on CUDA); for hybrid sharding, HSDP on the same
    layout at stage 3 and none at stages 1-2 ([Note: hybrid configurations])."""
    size = shard_group_size_of(config)
    if size is not None:
        return f"hsdp-g{size}" if stage_of(config) == 3 else None
    peer = {0: "ddp", 1: "ddp+zero", 2: "ddp+zero", 3: "fsdp2"}[stage_of(config)]
    return PLAIN if peer not in present and PLAIN in present else peer


def default_configs(device: str, world: int) -> list[str]:
    """``--configs`` when not given: see [Note: on CUDA] in __init__.py."""
    if device == "cuda" and world == 1:
        return [c for c in ALL_CONFIGS if stage_of(c) is not None] + [PLAIN]
    return list(ALL_CONFIGS)


def zero_formula(config: str, psi: int, world: int, state: int | None = None) -> float:
    """docs/design.md's model-state bytes per rank with fp32 parameters and gradients and
    ``state`` bytes of optimizer state over the whole model (k·Ψ; default AdamW's 8Ψ); peers:
    the stage they match; under hybrid sharding with the shard group's G in place of the world
    size."""
    stage = stage_of(config)
    if stage is None:
        stage = PEER_STAGE[full_sharding_of(config)]
    n = shard_group_size_of(config) or world
    k = 8 * psi if state is None else state
    return [8 * psi + k, 8 * psi + k / n, 4 * psi + (4 * psi + k) / n, (8 * psi + k) / n][stage]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _tensor_bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


class Runner:
    """One configuration: a model copy, its wrapper and optimizers (one, or nanochat's two:
    ``ModelSpec.optimizers``), and one training step split into phases so the report can say
    where the time goes."""

    name: str
    stage: int | None = None
    """The shardpar stage; None for the peers."""
    wait_clock: Any = None
    """Where the engine adds up its waits for collectives (shardpar stages only); see
    [Note: what is measured] in __init__.py."""

    def __init__(self, model: nn.Module, spec: ModelSpec, wrap_options: dict[str, Any]) -> None:
        self.spec, self.wrap_options = spec, wrap_options  # options for shardpar.wrap
        self.device = next(model.parameters()).device  # the model arrives on the rank's device
        self.model, self.optimizers = self.wrap(model)

    def wrap(self, model: nn.Module) -> tuple[nn.Module, list[Any]]:
        """The model as this configuration trains it, and its optimizers, stepped in order."""
        raise NotImplementedError

    def forward_backward(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        logits = self.model(batch[0])
        loss = F.cross_entropy(logits.flatten(0, -2), batch[1])
        loss.backward()
        return loss.detach()

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()

    def model_state(self) -> dict[str, int]:
        """Bytes of params, grads and optimizer state on this rank (after a step, before zero_grad)."""
        params = list(self.model.parameters())
        return {
            "params": _tensor_bytes(params),
            "grads": _tensor_bytes(p.grad for p in params),
            "optimizer_state": _tensor_bytes(self._optimizer_state()),
        }

    def _optimizer_state(self):
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))

    def close(self) -> None:
        pass


class ShardparRunner(Runner):
    def __init__(self, stage: int, library: Any, *args: Any) -> None:
        self.stage, self.library = stage, library  # shardpar, or a --candidate copy of it
        super().__init__(*args)

    def wrap(self, model: nn.Module) -> tuple[nn.Module, list[Any]]:
        options = dict(self.wrap_options)
        if self.stage == 3:
            options["wrap_policy"] = [self.spec.unit_class]
        wrapped = self.library.wrap(model, stage=self.stage, **options)
        self.wait_clock = wrapped.engine.wait_clock  # not in API.md: see [Note: engine internals] in comm_alone.py

        def sharded(optimizer_class: type[torch.optim.Optimizer], params: Any, **defaults: Any) -> Any:
            return self.library.optimizer(wrapped, optimizer_class, params, **defaults)

        # The parameters by the wrapped model's (ShardedModule forwards muon_params/adamw_params).
        return wrapped, build_optimizers(self.spec.optimizers, wrapped, sharded)

    def model_state(self) -> dict[str, int]:
        # optimizer_state: every ShardedOptimizer attached to the model (Muon's and AdamW's).
        stats = self.model.memory_stats()
        return {k: stats[k] for k in ("params", "grads", "optimizer_state", "workspace")}

    def close(self) -> None:
        self.model.engine.close()  # not in API.md: see [Note: engine internals] in comm_alone.py


def _ddp(model: nn.Module, device: torch.device) -> nn.parallel.DistributedDataParallel:
    return nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


class PlainRunner(Runner):
    """The model and its optimizers, nothing else: what a stage costs over plain torch at world size 1."""

    name = PLAIN

    def wrap(self, model: nn.Module) -> tuple[nn.Module, list[Any]]:
        return model, build_optimizers(self.spec.optimizers, model, torch_optimizer)


class DDPRunner(Runner):
    name = "ddp"

    def wrap(self, model: nn.Module) -> tuple[nn.Module, list[Any]]:
        ddp = _ddp(model, self.device)
        return ddp, build_optimizers(self.spec.optimizers, model, torch_optimizer)  # DDP's module's parameters


class DistMuonRunner(Runner):
    """Config ``distmuon``: the model unwrapped, :class:`DistMuonAdamW` as its optimizer (see
    [Note: the DistMuon peer] in distmuon.py)."""

    name = DISTMUON

    def wrap(self, model: nn.Module) -> tuple[nn.Module, list[Any]]:
        return model, [DistMuonAdamW(model)]

    def _optimizer_state(self):
        for optimizer in self.optimizers:
            yield from optimizer.state_tensors()  # this rank's share only


def _adamw_only(spec: ModelSpec, config: str) -> None:
    """The guard of the peers that build AdamW themselves ([Note: Muon configurations]);
    ``--configs`` refuses them first, with the same words."""
    problem = optimizers_problem(config, spec.optimizers)
    if problem is not None:
        raise ValueError(f"{spec.name}: {problem}")


class ZeroRunner(Runner):
    name = "ddp+zero"

    def wrap(self, model: nn.Module) -> tuple[nn.Module, list[Any]]:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        _adamw_only(self.spec, self.name)
        ddp = _ddp(model, self.device)
        options = ADAMW_ONLY_OPTIONS
        return ddp, [ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **options)]

    def _optimizer_state(self):
        for optimizer in self.optimizers:
            for state in optimizer.optim.state.values():  # the local, sharded optimizer
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class FSDPRunner(Runner):
    name = "fsdp2"

    def mesh(self) -> Any:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.device.type, (dist.get_world_size(),))

    def wrap(self, model: nn.Module) -> tuple[nn.Module, list[Any]]:
        from shardpar.comm.compat import fully_shard

        _adamw_only(self.spec, self.name)
        mesh = self.mesh()
        for module in model.modules():
            if isinstance(module, self.spec.unit_class):
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, [torch.optim.AdamW(model.parameters(), **ADAMW_ONLY_OPTIONS)]


@functools.cache
def hsdp_mesh(device_type: str, replicas: int, shard_size: int) -> Any:
    """The 2-D mesh (replicate, shard) of HSDP, made once per launch: every ``init_device_mesh``
    creates new process groups, and each configuration is built three times per model."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (replicas, shard_size), mesh_dim_names=("replicate", "shard"))


class HSDPRunner(FSDPRunner):
    """FSDP2's hybrid sharding: ``fully_shard`` on a 2-D mesh; see [Note: hybrid configurations]."""

    def __init__(self, shard_size: int, *args: Any) -> None:
        self.shard_size = shard_size
        self.name = f"hsdp-g{shard_size}"
        super().__init__(*args)

    def mesh(self) -> Any:
        return hsdp_mesh(self.device.type, dist.get_world_size() // self.shard_size, self.shard_size)


LIBRARIES: dict[str, Any] = {CANDIDATE: shardpar}
"""The shardpar package the CANDIDATE stages run: this checkout's unless --candidate names one."""


def shardpar_packages() -> list[Path]:
    """The directories of every shardpar package in the process (this checkout's and the
    ``--candidate``'s), whose Python calls the *shardpar calls* column counts ([Note: host
    columns] in measure.py)."""
    return list(dict.fromkeys(Path(library.__file__).resolve().parent for library in (shardpar, *LIBRARIES.values())))


def build_runner(config: str, model: nn.Module, spec: ModelSpec, args: argparse.Namespace) -> Runner:
    """``config`` built on ``model``, which is first moved to the rank's device."""
    model = model.to(args.torch_device)
    stage, shard_size = stage_of(config), shard_group_size_of(config)
    if stage is None and shard_size is not None:
        return HSDPRunner(shard_size, model, spec, {})
    if stage is None:
        runners = {
            "ddp": DDPRunner,
            "ddp+zero": ZeroRunner,
            "fsdp2": FSDPRunner,
            PLAIN: PlainRunner,
            DISTMUON: DistMuonRunner,
        }
        return runners[config](model, spec, {})
    hybrid = {} if shard_size is None else {"shard_group_size": shard_size}
    if config.endswith(CANDIDATE):
        options = {**args.wrap_options, **args.candidate_options, **hybrid}
        return ShardparRunner(stage, LIBRARIES[CANDIDATE], model, spec, options)
    return ShardparRunner(stage, shardpar, model, spec, {**args.wrap_options, **hybrid})


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


def parse_option(text: str) -> tuple[str, Any]:
    """A ``--wrap-option``/``--candidate-option`` KEY=VALUE: a ``shardpar.wrap`` option, its
    value a Python literal (or else the text)."""
    key, sep, value = text.partition("=")
    if not sep or key not in shardpar.ShardConfig.option_names():
        raise SystemExit(f"error: --wrap-option {text!r}: expected KEY=VALUE with KEY a shardpar.wrap option")
    if key in ("shard_group_size", "mesh"):
        raise SystemExit(
            f"error: --wrap-option {text!r}: name the hybrid configurations in --configs instead "
            f"({', '.join(HYBRID_CONFIGS)}, G a number)"
        )
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
