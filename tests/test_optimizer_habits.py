"""What training scripts do with their optimizer, against plain torch and torch DDP.

- Trust-ratio optimizers (LAMB, LARS; timm's ``Lamb`` and ``Lars``, written out below since
  timm is not a dependency) scale each parameter's update by norms of the whole parameter.
  A norm does not change under reshape, so they passed the reshape check; at stages 1-3 they
  would then take their norms over each rank's piece and silently train differently. They
  are refused at construction on every rank, naming the class, the param group and stage 0,
  also when only one group turns the trust ratio on (timm's LARS: weight decay on) and when
  the groups come at lr 0 from a warmup scheduler. At stage 0 they train as plain torch.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shardpar
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
