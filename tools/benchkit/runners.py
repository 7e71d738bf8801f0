"""The configurations: shardpar stage N (this checkout's, or a ``--candidate`` checkout's as
``stageN-cand``), and the peers it is measured against: torch DDP, DDP +
ZeroRedundancyOptimizer, FSDP2, and plain torch at world size 1.

A :class:`Runner` holds one configuration (a model copy, its wrapper and optimizer) and splits
its training step into phases so the report can say where the time goes.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardpar

from .models import ModelSpec

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
    """``--configs`` when not given: see [Note: on CUDA] in __init__.py."""
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
    stage: int | None = None
    """The shardpar stage; None for the peers."""
    wait_clock: Any = None
    """Where the engine adds up its waits for collectives (shardpar stages only); see
    [Note: what is measured] in __init__.py."""

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
        self.wait_clock = wrapped.engine.wait_clock  # not in API.md: see [Note: engine internals] in comm_alone.py
        return wrapped, self.library.optimizer(wrapped, torch.optim.AdamW, lr=1e-3)

    def model_state(self) -> dict[str, int]:
        stats = self.model.memory_stats()
        return {k: stats[k] for k in ("params", "grads", "optimizer_state", "workspace")}

    def close(self) -> None:
        self.model.engine.close()  # not in API.md: see [Note: engine internals] in comm_alone.py


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


def parse_option(text: str) -> tuple[str, Any]:
    """A ``--wrap-option``/``--candidate-option`` KEY=VALUE: a ``shardpar.wrap`` option, its
    value a Python literal (or else the text)."""
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
