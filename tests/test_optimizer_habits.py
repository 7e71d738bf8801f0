"""What training scripts do with their optimizer, against plain torch and torch DDP.

- Trust-ratio optimizers (LAMB, LARS; timm's ``Lamb`` and ``Lars``, written out below since
  timm is not a dependency) scale each parameter's update by norms of the whole parameter.
  A norm does not change under reshape, so they passed the reshape check; at stages 1-3 they
  would then take their norms over each rank's piece and silently train differently. They
  are refused at construction on every rank, naming the class, the param group and stage 0,
  also when only one group turns the trust ratio on (timm's LARS: weight decay on) and when
  the groups come at lr 0 from a warmup scheduler. At stage 0 they train as plain torch.
- DDP's resume idiom at stage 0: rank 0 saves ``opt.state_dict()`` with ``torch.save``, every
  rank loads that file with ``torch.load(f, map_location=...)``. Training then matches torch
  DDP doing the same and the uninterrupted run, also in a job of another size. A rank's
  state at stages 1-3 on another rank, another set of parameters, another stage and a plain
  torch state_dict are still refused, saying which.
- A factory-built optimizer (timm's ``create_optimizer_v2``) ports as
  ``shardpar.optimizer(model, type(opt), opt.param_groups)``: groups with weight decay 0 for
  biases and norms, extra keys (timm's ``lr_scale``, ``param_names``) and a scheduler's
  ``initial_lr`` keep working, and training matches the factory's torch optimizer.
- Per-parameter gradient clipping (timm's adaptive gradient clipping): stage 0 clips as plain
  torch; stages 1-3 raise, saying that only stage 0 keeps whole gradients.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shardpar
from shardpar import ShardedGradError
from shardpar.comm import collectives as C
from tests.harness import run_ranks

STAGES = (0, 1, 2, 3)
GLOBAL_BATCH = 6
"""Rows of every step's batch: divisible by 2 and 3, the world sizes used here."""
TOL = 1e-5
"""Relative, per tensor ([Note: the parity contract] in tests/parity.py)."""


class Net(nn.Module):
    """Weights, biases and a LayerNorm, so that timm-style groups have both kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.gelu(self.fc2(self.norm(F.gelu(self.fc1(x))))))


def _net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _wrap(module: nn.Module, stage: int, **options: Any) -> shardpar.ShardedModule:
    """Small buckets and units, so that ranks hold pieces of parameters, not whole ones."""
    return shardpar.wrap(module, stage=stage, min_unit_params=1, bucket_cap_mb=0.001, **options)


def _batch(step: int, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """Rank ``rank``'s rows of step ``step``'s global batch (the whole batch at world size 1)."""
    rows = torch.randn(GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(1000 + step))
    size = GLOBAL_BATCH // world_size
    return rows[rank * size:(rank + 1) * size]


def _train(model: nn.Module, opt: Any, steps: range, schedule: Callable[[int], None] | None = None,
           clip: Callable[[nn.Module], None] | None = None) -> None:
    """The loop of a DDP script on this rank's rows; at world size 1 the plain torch reference."""
    rank, world_size = (C.get_rank(), C.get_world_size()) if isinstance(model, (shardpar.ShardedModule,
                                                                                DistributedDataParallel)) else (0, 1)
    for step in steps:
        model(_batch(step, rank, world_size)).square().mean().backward()
        if clip is not None:
            clip(model)
        opt.step()
        opt.zero_grad()
        if schedule is not None:
            schedule(step + 1)


def _assert_close(ours: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert ours.keys() == expected.keys(), what
    for name, value in expected.items():
        error = (ours[name] - value).abs().max().item() / max(value.abs().max().item(), 1e-12)
        assert error <= TOL, f"{what}: {name} differs by {error:.2e} (relative)"


# --------------------------------------------------------------------------- a factory, as timm's


def _timm_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """timm's ``param_groups_weight_decay`` with its layer-decay keys: no weight decay for
    biases and norms (1-D), ``lr_scale`` per group and the names of its parameters."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [(n, p) for n, p in named if p.ndim <= 1]
    decay = [(n, p) for n, p in named if p.ndim > 1]
    return [
        {"params": [p for _, p in no_decay], "weight_decay": 0.0, "lr_scale": 0.5,
         "param_names": [n for n, _ in no_decay]},
        {"params": [p for _, p in decay], "weight_decay": weight_decay, "lr_scale": 1.0,
         "param_names": [n for n, _ in decay]},
    ]


def _create_optimizer(model: nn.Module, name: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """timm's ``create_optimizer_v2(model, opt=name, lr=lr, weight_decay=weight_decay)``: a
    torch optimizer over timm's groups, whose class the caller does not name."""
    classes = {"adamw": torch.optim.AdamW, "lamb": Lamb, "lars": Lars}
    return classes[name](_timm_groups(model, weight_decay), lr=lr, weight_decay=weight_decay)


class TimmLikeScheduler:
    """timm's ``Scheduler``: remembers each group's ``initial_lr`` and sets its lr to it times
    a warmup factor times the group's ``lr_scale``. lr is 0 right after construction."""

    def __init__(self, optimizer: Any, warmup: int = 2) -> None:
        self.optimizer = optimizer
        self.warmup = warmup
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.step(0)

    def step(self, epoch: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = group["initial_lr"] * min(1.0, epoch / self.warmup) * group.get("lr_scale", 1.0)


# --------------------------------------------------------------------------- trust-ratio optimizers


class Lamb(torch.optim.Optimizer):
    """LAMB as timm's ``Lamb``: all gradients clipped by their global norm
    (``max_grad_norm``), then Adam's step plus weight decay, scaled per parameter by the trust
    ratio ``||p|| / ||update||``."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, max_grad_norm: float | None = 1.0) -> None:
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      max_grad_norm=max_grad_norm))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        max_norm = self.defaults["max_grad_norm"]
        clip = 1.0
        if max_norm is not None and grads:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            clip = (norm / max_norm).clamp(min=1.0)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad / clip
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(())
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                step = state["step"].item()
                state["exp_avg"].lerp_(grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = (state["exp_avg"] / (1 - beta1 ** step)) / (
                    (state["exp_avg_sq"] / (1 - beta2 ** step)).sqrt() + group["eps"])
                update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones(()))
                p.add_(update * trust, alpha=-group["lr"])


class Lars(torch.optim.Optimizer):
    """LARS as timm's ``Lars``: SGD with momentum whose gradient is scaled per parameter by
    ``trust_coeff * ||p|| / (||g|| + weight_decay * ||p||)``, only where weight decay is on (so
    timm's no-decay group of biases and norms steps as plain SGD)."""

    def __init__(self, params: Any, lr: float = 1.0, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coeff: float = 0.001, eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coeff=trust_coeff, eps=eps))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["weight_decay"] != 0:
                    w_norm, g_norm = p.norm(), grad.norm()
                    trust = group["trust_coeff"] * w_norm / (g_norm + w_norm * group["weight_decay"] + group["eps"])
                    grad = (grad + group["weight_decay"] * p) * trust
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = grad.clone()
                else:
                    state["momentum_buffer"].mul_(group["momentum"]).add_(grad)
                p.add_(state["momentum_buffer"], alpha=-group["lr"])


def _trust_ratio_optimizer(case: str, model: shardpar.ShardedModule) -> Any:
    """Each case as a script builds it; the factory ones are ported by their param groups after
    a warmup scheduler set their lr to 0."""
    if case == "Lamb":
        return shardpar.optimizer(model, Lamb, lr=1e-3)
    if case == "Lars":
        return shardpar.optimizer(model, Lars, lr=0.1, weight_decay=1e-4)
    factory = _create_optimizer(model, case.split()[0].lower(), lr=0.1, weight_decay=1e-2)
    TimmLikeScheduler(factory)
    return shardpar.optimizer(model, type(factory), factory.param_groups)


TRUST_RATIO_CASES = ["Lamb", "Lars", "Lamb from a factory", "Lars from a factory"]


def _build_trust_ratio_optimizers() -> dict[tuple[int, str], str | None]:
    messages = {}
    for stage in (1, 2, 3):
        for case in TRUST_RATIO_CASES:
            model = _wrap(_net(), stage)
            try:
                _trust_ratio_optimizer(case, model)
                messages[stage, case] = None
            except ValueError as error:
                messages[stage, case] = str(error)
            model.engine.close()
    return messages


def test_trust_ratio_optimizers_are_refused_at_stages_1_to_3_on_every_rank() -> None:
    for rank, messages in enumerate(run_ranks(_build_trust_ratio_optimizers, 2, timeout=120)):
        for (stage, case), message in messages.items():
            where = f"rank {rank}, stage {stage}, {case}"
            assert message is not None, f"{where}: built, and would take its norms over this rank's pieces"
            name = f"{Lamb.__module__}.{'Lamb' if 'Lamb' in case else 'Lars'}"
            assert message.startswith(f"{name} does not update parameters element by element"), (where, message)
            assert "two halves" in message and "LAMB's or LARS's trust ratio" in message, (where, message)
            assert f"at stage {stage} each rank updates 1-D slices" in message and "Use stage=0" in message
            assert "torch.optim.AdamW, Adam, SGD" in message, (where, message)
            if case == "Lars from a factory":  # only the weight-decay group takes norms
                assert "with the options of param group 1 (" in message, (where, message)


def _trust_ratio_at_stage_0(case: str) -> dict[str, torch.Tensor]:
    model = _wrap(_net(), 0)
    opt = _trust_ratio_optimizer(case, model)
    schedule = TimmLikeScheduler(opt).step if "factory" in case else None
    _train(model, opt, range(4), schedule)
    return model.full_state_dict()


def _trust_ratio_reference(case: str) -> dict[str, torch.Tensor]:
    model = _net()
    if case == "Lamb":
        opt = Lamb(model.parameters(), lr=1e-3)
    elif case == "Lars":
        opt = Lars(model.parameters(), lr=0.1, weight_decay=1e-4)
    else:
        opt = _create_optimizer(model, case.split()[0].lower(), lr=0.1, weight_decay=1e-2)
    schedule = TimmLikeScheduler(opt).step if "factory" in case else None
    _train(model, opt, range(4), schedule)
    return model.state_dict()


@pytest.mark.parametrize("case", TRUST_RATIO_CASES)
def test_trust_ratio_optimizers_at_stage_0_train_as_plain_torch(case: str) -> None:
    expected = _trust_ratio_reference(case)
    for rank, ours in enumerate(run_ranks(_trust_ratio_at_stage_0, 2, case, timeout=60)):
        _assert_close(ours, expected, f"rank {rank}")


def _probe_cost() -> tuple[int, int]:
    """Instances of the class made while building, and while stepping (the probe's are the
    former; none may come per step)."""
    made = []

    class Counted(torch.optim.AdamW):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            made.append(1)
            super().__init__(*args, **kwargs)

    model = _wrap(_net(), 2)
    opt = shardpar.optimizer(model, Counted, _timm_groups(model, 0.1), lr=1e-2)
    built = len(made)
    _train(model, opt, range(3))
    return built, len(made) - built


def test_the_elementwise_probe_runs_once_per_group_at_construction_not_per_step() -> None:
    for built, stepping in run_ranks(_probe_cost, 2, timeout=60):
        assert stepping == 0
        assert built == 1 + 2 * 4  # the optimizer; per group (their options differ) the probe's four instances


# --------------------------------------------------------------------------- DDP's resume idiom


def _adamw(model: nn.Module, make: Callable[..., Any]) -> tuple[Any, Any]:
    """nanoGPT-style groups and a warmup schedule, built by ``make(class, groups, **options)``."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = make(torch.optim.AdamW, groups, lr=0.05, betas=(0.9, 0.95))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))


def _resume(path: str, model: nn.Module, opt: Any, sched: Any, steps: range) -> None:
    """What timm, nanoGPT and most DDP scripts do: train, rank 0 saves with torch.save, every
    rank loads the file into the objects it resumes with, training goes on."""
    checkpoint = torch.load(path, map_location="cpu")  # weights_only, torch's default
    opt.load_state_dict(checkpoint["optimizer"])
    sched.load_state_dict(checkpoint["scheduler"])
    _train(model, opt, steps, lambda _: sched.step())


def _save_on_rank_0(path: str, module: nn.Module, opt: Any, sched: Any) -> None:
    if C.get_rank() == 0:
        torch.save({"model": module.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()},
                   path)
    dist.barrier()


def _shardpar_optimizer(model: shardpar.ShardedModule) -> Callable[..., Any]:
    return lambda cls, groups, **options: shardpar.optimizer(model, cls, groups, **options)


def _resume_like_ddp(path: str, mixed_precision: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    model = _wrap(_net(), 0, mixed_precision=mixed_precision)  # uninterrupted
    opt, sched = _adamw(model, _shardpar_optimizer(model))
    _train(model, opt, range(4), lambda _: sched.step())
    out["uninterrupted"] = model.full_state_dict()

    model = _wrap(_net(), 0, mixed_precision=mixed_precision)
    opt, sched = _adamw(model, _shardpar_optimizer(model))
    _train(model, opt, range(2), lambda _: sched.step())
    _save_on_rank_0(f"{path}/shardpar.pt", model.module, opt, sched)
    module = _net(seed=1)  # what a restarted job builds, then loads the weights into
    module.load_state_dict(torch.load(f"{path}/shardpar.pt", map_location="cpu")["model"])
    model = _wrap(module, 0, mixed_precision=mixed_precision)
    opt, sched = _adamw(model, _shardpar_optimizer(model))
    _resume(f"{path}/shardpar.pt", model, opt, sched, range(2, 4))
    out["resumed"] = model.full_state_dict()

    if mixed_precision is None:  # torch DDP, the same idiom
        ddp = DistributedDataParallel(_net())
        opt, sched = _adamw(ddp, lambda cls, groups, **options: cls(groups, **options))
        _train(ddp, opt, range(2), lambda _: sched.step())
        _save_on_rank_0(f"{path}/ddp.pt", ddp.module, opt, sched)
        module = _net(seed=1)
        module.load_state_dict(torch.load(f"{path}/ddp.pt", map_location="cpu")["model"])
        ddp = DistributedDataParallel(module)
        opt, sched = _adamw(ddp, lambda cls, groups, **options: cls(groups, **options))
        _resume(f"{path}/ddp.pt", ddp, opt, sched, range(2, 4))
        out["ddp"] = ddp.module.state_dict()
    return out


@pytest.mark.parametrize("world_size, mixed_precision", [(3, None), (2, "bf16")])
def test_ddp_resume_idiom_at_stage_0_loads_rank_0s_optimizer_state_on_every_rank(
    tmp_path: Any, world_size: int, mixed_precision: str | None
) -> None:
    """At stage 0 every rank holds the same optimizer state, as under DDP: the file rank 0
    saved loads on every rank, and training goes on as if never interrupted (bit for bit) and
    as torch DDP resumed the same way (within DDP's own error)."""
    for rank, out in enumerate(run_ranks(_resume_like_ddp, world_size, str(tmp_path), mixed_precision, timeout=120)):
        for name, value in out["uninterrupted"].items():
            assert torch.equal(out["resumed"][name], value), f"rank {rank}: {name} differs from the uninterrupted run"
        if mixed_precision is None:
            _assert_close(out["resumed"], out["ddp"], f"rank {rank}, against torch DDP")


def _save_stage_0_at_2_ranks(path: str) -> None:
    model = _wrap(_net(), 0)
    opt, sched = _adamw(model, _shardpar_optimizer(model))
    _train(model, opt, range(2), lambda _: sched.step())
    _save_on_rank_0(path, model.module, opt, sched)


def _resume_stage_0_at_3_ranks(path: str) -> dict[str, torch.Tensor]:
    module = _net(seed=1)
    module.load_state_dict(torch.load(path, map_location="cpu")["model"])
    model = _wrap(module, 0)
    opt, sched = _adamw(model, _shardpar_optimizer(model))
    _resume(path, model, opt, sched, range(2, 4))
    return model.full_state_dict()


def test_a_stage_0_optimizer_state_dict_resumes_a_job_of_another_size(tmp_path: Any) -> None:
    """As under DDP, the state does not depend on the world size: saved by 2 ranks, resumed
    by 3, the result is plain torch's on the whole batches."""
    module = _net()
    opt, sched = _adamw(module, lambda cls, groups, **options: cls(groups, **options))
    _train(module, opt, range(4), lambda _: sched.step())
    path = str(tmp_path / "step-2.pt")
    run_ranks(_save_stage_0_at_2_ranks, 2, path, timeout=60)
    for rank, state in enumerate(run_ranks(_resume_stage_0_at_3_ranks, 3, path, timeout=60)):
        _assert_close(state, module.state_dict(), f"rank {rank} of 3")


def _wrong_loads(path: str) -> dict[str, str | None]:
    """Each rank loads rank 0's file where it must not load, and its own where it must."""
    rank = C.get_rank()
    out: dict[str, str | None] = {}

    def load(what: str, opt: Any, state: dict[str, Any]) -> None:
        try:
            opt.load_state_dict(state)
            out[what] = None
        except ValueError as error:
            out[what] = str(error)

    for stage in STAGES:
        model = _wrap(_net(), stage)
        opt, sched = _adamw(model, _shardpar_optimizer(model))
        _train(model, opt, range(1), lambda _: sched.step())
        file = f"{path}/stage-{stage}.pt"
        if rank == 0:
            torch.save(opt.state_dict(), file)
        torch.save(opt.state_dict(), f"{path}/stage-{stage}-rank-{rank}.pt")
        dist.barrier()
        load(f"stage {stage}: rank 0's", opt, torch.load(file, map_location="cpu"))
        load(f"stage {stage}: its own", opt, torch.load(f"{path}/stage-{stage}-rank-{rank}.pt", map_location="cpu"))
        if stage == 0:
            other = _wrap(_net(), 0)
            fewer = shardpar.optimizer(other, torch.optim.AdamW, list(other.module.fc1.parameters()), lr=0.05)
            load("stage 0: other parameters", fewer, torch.load(file, map_location="cpu"))
            other.engine.close()
            plain = torch.optim.AdamW(_net().parameters())
            load("stage 0: a torch optimizer's", opt, plain.state_dict())
        if stage == 2:
            load("stage 2: stage 0's", opt, torch.load(f"{path}/stage-0.pt", map_location="cpu"))
        model.engine.close()
        dist.barrier()
    return out


def test_optimizer_state_dicts_that_do_not_fit_are_still_refused_saying_why(tmp_path: Any) -> None:
    results = run_ranks(_wrong_loads, 2, str(tmp_path), timeout=120)
    prefix = "this optimizer state_dict was saved for another stage, world size, rank or set of parameters ("
    for rank, out in enumerate(results):
        for stage in STAGES:
            assert out[f"stage {stage}: its own"] is None, (rank, stage, out[f"stage {stage}: its own"])
            refused = out[f"stage {stage}: rank 0's"]
            if stage == 0 or rank == 0:
                assert refused is None, (rank, stage, refused)
            else:
                assert refused is not None and refused.startswith(prefix), (rank, stage, refused)
                assert (f"it was saved by rank 0 of 2, this is rank 1 of 2: at stage {stage} a rank's state covers "
                        "only its own pieces") in refused
        assert "it holds the state of other parameters" in out["stage 0: other parameters"]
        assert "it has no 'shardpar' entry" in out["stage 0: a torch optimizer's"]
        assert "it was saved at stage 0, this optimizer is at stage 2" in out["stage 2: stage 0's"]


# --------------------------------------------------------------------------- a factory-built optimizer


def _ported_factory(stage: int) -> dict[str, Any]:
    module = _net()
    factory = _create_optimizer(module, "adamw", lr=0.05, weight_decay=0.1)  # before wrap, as timm's train.py
    TimmLikeScheduler(factory)  # made before the port: the groups carry initial_lr, and lr 0
    model = _wrap(module, stage)
    opt = shardpar.optimizer(model, type(factory), factory.param_groups)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    schedule = TimmLikeScheduler(opt)
    _train(model, opt, range(4), schedule.step)
    return {"groups": groups, "state": model.full_state_dict()}


def _factory_reference() -> dict[str, torch.Tensor]:
    model = _net()
    opt = _create_optimizer(model, "adamw", lr=0.05, weight_decay=0.1)
    _train(model, opt, range(4), TimmLikeScheduler(opt).step)
    return model.state_dict()


@pytest.mark.parametrize("stage", STAGES)
def test_a_factory_built_optimizer_ports_by_its_class_and_param_groups(stage: int) -> None:
    """``shardpar.optimizer(model, type(opt), opt.param_groups)`` (the migration guide's form)
    with timm's groups: weight decay 0 for biases and norms, its ``lr_scale`` and
    ``param_names``, a scheduler's ``initial_lr`` (and lr 0 from its warmup)."""
    expected = _factory_reference()
    for rank, out in enumerate(run_ranks(_ported_factory, 2, stage, timeout=60)):
        no_decay, decay = out["groups"]
        assert (no_decay["weight_decay"], decay["weight_decay"]) == (0.0, 0.1)
        assert (no_decay["lr_scale"], decay["initial_lr"]) == (0.5, 0.05)
        assert decay["param_names"] == ["fc1.weight", "fc2.weight", "head.weight"]
        _assert_close(out["state"], expected, f"stage {stage}, rank {rank}")


def _named_parameters_port(stage: int) -> dict[str, torch.Tensor]:
    model = _wrap(_net(), stage)
    named = list(model.named_parameters())
    groups = [{"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0},
              {"params": [(n, p) for n, p in named if p.ndim >= 2]}]
    opt = shardpar.optimizer(model, torch.optim.AdamW, groups, lr=0.05, weight_decay=0.1)
    _train(model, opt, range(3))
    return model.full_state_dict()


def _named_parameters_reference() -> dict[str, torch.Tensor]:
    model = _net()
    named = list(model.named_parameters())
    groups = [{"params": [(n, p) for n, p in named if p.ndim < 2], "weight_decay": 0.0},
              {"params": [(n, p) for n, p in named if p.ndim >= 2]}]
    opt = torch.optim.AdamW(groups, lr=0.05, weight_decay=0.1)
    _train(model, opt, range(3))
    return model.state_dict()


@pytest.mark.parametrize("stage", [0, 2])
def test_param_groups_of_named_parameters_work_as_in_torch(stage: int) -> None:
    """torch optimizers take ``(name, parameter)`` pairs (``model.named_parameters()``) in
    place of parameters; so does ``shardpar.optimizer``."""
    expected = _named_parameters_reference()
    for rank, state in enumerate(run_ranks(_named_parameters_port, 2, stage, timeout=60)):
        _assert_close(state, expected, f"stage {stage}, rank {rank}")


def test_porting_a_factory_optimizer_with_its_defaults_fails_where_its_param_groups_work() -> None:
    """Why the guide says ``opt.param_groups`` and not ``**opt.defaults``: torch's AdamW puts
    keys in its defaults that its constructor does not take."""
    model = _wrap(_net(), 1)
    factory = _create_optimizer(model, "adamw", lr=0.05, weight_decay=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        shardpar.optimizer(model, type(factory), factory.param_groups, **factory.defaults)
    shardpar.optimizer(model, type(factory), factory.param_groups)
    model.engine.close()


# --------------------------------------------------------------------------- per-parameter clipping


def _unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm() if x.ndim <= 1 else x.norm(dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(parameters: Any, clip_factor: float = 0.01, eps: float = 1e-3) -> None:
    """timm's ``adaptive_clip_grad`` (AGC): each gradient clipped against its own parameter."""
    for p in parameters:
        if p.grad is None:
            continue
        p_data, g_data = p.detach(), p.grad.detach()
        max_norm = _unitwise_norm(p_data).clamp_(min=eps).mul_(clip_factor)
        grad_norm = _unitwise_norm(g_data)
        clipped = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        p.grad.detach().copy_(torch.where(grad_norm < max_norm, g_data, clipped))


def _clip_per_parameter(stage: int) -> dict[str, Any]:
    model = _wrap(_net(), stage)
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.5)
    try:
        _train(model, opt, range(2), clip=lambda m: adaptive_clip_grad(m.parameters()))
    except (ShardedGradError, RuntimeError) as error:
        return {"error": (type(error).__name__, str(error))}
    return {"state": model.full_state_dict()}


@pytest.mark.parametrize("stage", STAGES)
def test_per_parameter_gradient_clipping_works_at_stage_0_and_says_so_elsewhere(stage: int) -> None:
    model = _net()
    _train(model, torch.optim.SGD(model.parameters(), lr=0.5), range(2),
           clip=lambda m: adaptive_clip_grad(m.parameters()))
    for rank, out in enumerate(run_ranks(_clip_per_parameter, 2, stage, timeout=60)):
        if stage == 0:
            _assert_close(out["state"], model.state_dict(), f"rank {rank}")
            continue
        kind, message = out["error"]
        # Stages 1-2 stop at the gradient, stage 3 already at the sharded parameter.
        assert kind == ("RuntimeError" if stage == 3 else "ShardedGradError"), (rank, kind, message)
        assert re.search(r"per-parameter clipping .*timm's adaptive gradient clipping", message), message
        assert "only stage 0 keeps whole gradients" in message, message
