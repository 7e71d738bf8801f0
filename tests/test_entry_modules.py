"""Stage-3 units whose hook module's forward is bypassed: calling any module of a unit gathers
it ([Note: entry modules] in shardpar/core/units.py). Oracle: plain torch, one process, the
concatenated batch.

The model is timm's ResNet in small: a stem, two stages ``layer1``/``layer2`` that are
``nn.Sequential``s of two residual blocks each, a head. With the default policy each stage is
a unit (its blocks are below ``min_unit_params``, the stage above it). The stages' forward
runs or is bypassed, as timm's models do it:

- "Sequential called": ``self.layer2(self.layer1(x))`` (the stages' own forward runs);
- "loop": ``for block in self.layer1: x = block(x)``, a parent iterating a Sequential;
- "checkpoint_seq": timm's ``--grad-checkpointing``, ``checkpoint_seq([self.layer1,
  self.layer2], x, flatten=True)``, each block checkpointed on its own, reentrant or not.

Before: every mode but the first raised at the first block ("parameter 'layer1.0.conv1.weight'
of stage-3 unit 'layer1' was read (conv2d) while the unit is sharded").
"""

from __future__ import annotations

from itertools import chain
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import shardpar
from shardpar.comm import collectives as C
from shardpar.engines.hooks import FORWARD_HOOK_MARK
from tests.support.harness import run_ranks

STEPS = 3
BATCH = 12  # divisible by 2 and 3
CHANNELS = 8
MIN_UNIT_PARAMS = 2000  # a block has 1,184 parameters, a stage 2,368: the stages are the units
TOL = 1e-5  # fp32 sums in another order differ by a few ulps; a wrong weight shows at >1e-3
MODES = ("Sequential called", "loop", "checkpoint_seq, non-reentrant", "checkpoint_seq, reentrant")


def checkpoint_seq(functions: Any, x: torch.Tensor, flatten: bool = False, use_reentrant: bool = False) -> torch.Tensor:
    """timm.models._manipulate.checkpoint_seq (every=1, no skip_last): each module called
    directly, each in a checkpoint of its own."""

    def run(module: nn.Module) -> Any:
        return lambda _x: module(_x)

    if isinstance(functions, nn.Sequential):
        functions = functions.children()
    if flatten:
        functions = chain.from_iterable(functions)
    for module in tuple(functions):
        x = checkpoint(run(module), x, use_reentrant=use_reentrant)
    return x


class BasicBlock(nn.Module):
    """A residual block (GroupNorm rather than BatchNorm: per-rank batch statistics could not
    be compared with one process on the whole batch; SiLU rather than ReLU: a pre-activation
    within rounding of ReLU's kink flips its gradient, and on an AMD EPYC core plain torch
    itself, summing the batch in three parts, ended 3.3e-3 away from its whole-batch run)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(2, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x + self.norm2(self.conv2(F.silu(self.norm1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, mode: str, channels: int = CHANNELS, classes: int = 5) -> None:
        super().__init__()
        self.mode = mode
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layer1 = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.layer2 = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.head = nn.Linear(channels, classes)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        if self.mode.startswith("checkpoint_seq") and torch.is_grad_enabled():
            return checkpoint_seq([self.layer1, self.layer2], x, flatten=True, use_reentrant="non-" not in self.mode)
        if self.mode == "loop":
            for block in self.layer1:
                x = block(x)
            for block in self.layer2:
                x = block(x)
            return x
        return self.layer2(self.layer1(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x).mean((2, 3)))


def _build(mode: str) -> TinyResNet:
    torch.manual_seed(0)
    return TinyResNet(mode)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 3, 6, 6, generator=generator), torch.randint(0, 5, (BATCH,), generator=generator)


def _eval_batch() -> torch.Tensor:
    return torch.randn(4, 3, 6, 6, generator=torch.Generator().manual_seed(99))


def _reference(mode: str) -> dict[str, Any]:
    model = _build(mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    states = []
    for step in range(STEPS):
        x, y = _batch(step)
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    model.eval()
    with torch.no_grad():
        evaluated = model(_eval_batch())
    return {"states": states, "eval": evaluated}


def _train(mode: str) -> dict[str, Any]:
    model = shardpar.wrap(_build(mode), stage=3, min_unit_params=MIN_UNIT_PARAMS)
    result = _train_wrapped(model)
    model.engine.close()
    return result


def _train_wrapped(model: Any) -> dict[str, Any]:
    """STEPS steps of AdamW on this rank's share of each batch, then an evaluation (the engine
    left open: the caller closes it)."""
    rank, world_size = C.get_rank(), C.get_world_size()
    units = [unit.name for unit in model.engine.storage.units]
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    share = BATCH // world_size
    states, gathers = [], []
    for step in range(STEPS):
        x, y = _batch(step)
        model.reset_comm_stats()
        F.cross_entropy(model(x[rank * share : (rank + 1) * share]), y[rank * share : (rank + 1) * share]).backward()
        gathers.append(model.comm_stats()["all_gather"]["calls"])
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        states.append(model.full_state_dict())
    model.eval()
    with torch.no_grad():
        evaluated = model(_eval_batch())
    return {"units": units, "states": states, "eval": evaluated, "gathers": gathers}


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def _assert_trains_like(result: dict[str, Any], expected: dict[str, Any], label: str) -> None:
    """Every step's state and the evaluation within TOL of plain torch's."""
    for step, (state, reference) in enumerate(zip(result["states"], expected["states"], strict=True)):
        for name, value in reference.items():
            error = _rel_error(state[name], value)
            assert error <= TOL, f"{label}, step {step}: {name} off by {error:.2e}"
    error = _rel_error(result["eval"], expected["eval"])
    assert error <= TOL, f"{label}: evaluation off by {error:.2e}"


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_default_policy_units_train_like_plain_torch_when_their_forward_is_bypassed(mode: str, world_size: int) -> None:
    expected = _reference(mode)
    results = run_ranks(_train, world_size, mode, timeout=120)
    for rank, result in enumerate(results):
        assert {"layer1", "layer2"} <= set(result["units"]), result["units"]  # the stages are units
        _assert_trains_like(result, expected, f"{mode}, rank {rank}")


def test_uses_through_entry_modules_share_a_gather_in_forward() -> None:
    # A stage gathered once per forward whether its own forward runs or its blocks are called
    # one by one; in backward once per block called ([Note: entry modules]): 2 more gathers
    # per step for the two stages (all-gather calls are per flat group; one group per unit).
    called = run_ranks(_train, 2, "Sequential called", timeout=120)[0]["gathers"]
    looped = run_ranks(_train, 2, "loop", timeout=120)[0]["gathers"]
    assert looped == [calls + 2 for calls in called], (called, looped)


def _train_after_a_raise_at_the_first_entry() -> dict[str, Any]:
    """The "loop" mode, whose blocks are entry modules of their stage, with a first call of
    ``layer1[0]`` on its own (outside the root's forward, whose end would also end the use)
    that raises: the use it started ends in the forward hook that entry put on (torch runs it
    for a raised forward too), and training goes on."""
    built = _build("loop")
    entered = built.layer1[0]
    raising = [True]

    def raise_once(module: nn.Module, args: Any) -> None:
        if raising[0]:
            raising[0] = False
            raise ValueError("a data error in the first forward")

    built.layer1[0].conv2.register_forward_pre_hook(raise_once)
    model = shardpar.wrap(built, stage=3, min_unit_params=MIN_UNIT_PARAMS)
    hooks_before = len(entered._forward_hooks)  # none of shardpar's until a use enters there
    with pytest.raises(ValueError, match="data error"):  # a block called on its own, outside the root's forward
        entered(torch.randn(2, CHANNELS, 6, 6))
    hooks_after_raise = len(entered._forward_hooks)
    (stage,) = [unit for unit in model.engine.storage.units if unit.name == "layer1"]
    left = (stage.running, stage.entered_by)  # the use ended: not running, entered by none
    result = _train_wrapped(model)
    hooks_after = len(entered._forward_hooks)
    model.engine.close()
    return {**result, "hooks": (hooks_before, hooks_after_raise, hooks_after), "left": left}


def test_an_entry_modules_use_ends_when_its_first_forward_raises() -> None:
    # The hook that ends a use begun at an entry module goes on at the first such use (inside
    # the unit's own uses it would be a call doing nothing, once per entry module per forward):
    # none before, one from then on, and a forward raised there ends the use all the same.
    expected = _reference("loop")
    for rank, result in enumerate(run_ranks(_train_after_a_raise_at_the_first_entry, 2, timeout=120)):
        assert result["hooks"] == (0, 1, 1), result["hooks"]
        assert result["left"] == (0, None), result["left"]
        _assert_trains_like(result, expected, f"rank {rank}")


def _entry_hooks_inside_and_after_a_use() -> dict[str, Any]:
    """The "Sequential called" mode, where every module inside a stage is an entry module of
    it, with a user's pre-hooks: one on ``layer1[0].norm1`` from before wrapping (counting its
    calls), one on ``layer1`` after wrapping that, while the stage's use is in progress, reads
    how many forward pre-hooks each entry module has, and registers in the first forward a
    pre-hook on ``layer1[1].conv2`` (counting its calls too)."""
    built = _build("Sequential called")
    calls = {"norm1": 0, "conv2": 0}

    def count(name: str) -> Any:
        def hook(module: nn.Module, args: Any) -> None:
            calls[name] += 1

        return hook

    built.layer1[0].norm1.register_forward_pre_hook(count("norm1"))
    model = shardpar.wrap(built, stage=3, min_unit_params=MIN_UNIT_PARAMS)
    entries = {name: module for name, module in built.layer1.named_modules() if name}
    inside: list[dict[str, int]] = []
    registered: list[Any] = []

    def look_inside(module: nn.Module, args: Any) -> None:
        inside.append({name: len(m._forward_pre_hooks) for name, m in entries.items()})
        if not registered:
            registered.append(built.layer1[1].conv2.register_forward_pre_hook(count("conv2")))

    built.layer1.register_forward_pre_hook(look_inside)
    result = _train_wrapped(model)
    after = {name: len(m._forward_pre_hooks) for name, m in entries.items()}
    # The entry hook is back in front of the one registered during the use, as it was registered.
    first_after = list(built.layer1[1].conv2._forward_pre_hooks.values())[0]
    engine_first = getattr(first_after, FORWARD_HOOK_MARK, False)
    registered[0].remove()  # its handle still removes it
    after_removal = len(built.layer1[1].conv2._forward_pre_hooks)
    model.engine.close()
    return {
        **result,
        "inside": inside,
        "after": after,
        "calls": calls,
        "after_removal": after_removal,
        "engine_first": engine_first,
    }


def test_entry_hooks_are_off_inside_a_use_and_other_hooks_stay() -> None:
    # Inside a use of its unit an entry module's own hook would do nothing, so its hook dict
    # stands aside and the module takes nn.Module.__call__'s fast path ([Note: entry hooks
    # quiet inside a use] in shardpar/engines/module_hooks.py); a module with a hook of
    # anyone else's keeps every hook, and a hook registered during the use stays.
    expected = _reference("Sequential called")
    forwards = STEPS + 1  # the training steps and the evaluation
    for rank, result in enumerate(run_ranks(_entry_hooks_inside_and_after_a_use, 2, timeout=120)):
        _assert_trains_like(result, expected, f"rank {rank}")
        assert len(result["inside"]) == forwards, result["inside"]
        first, *later = result["inside"]
        kept = {"0.norm1": 2}  # the entry hook and the user's
        assert first == {name: kept.get(name, 0) for name in first}, first
        kept["1.conv2"] = 2  # the entry hook and the one registered in the first forward
        for seen in later:
            assert seen == {name: kept.get(name, 0) for name in seen}, seen
        assert result["after"] == {name: kept.get(name, 1) for name in result["after"]}, result["after"]
        assert result["calls"] == {"norm1": forwards, "conv2": forwards}, result["calls"]
        assert result["after_removal"] == 1, result["after_removal"]
        assert result["engine_first"], "the entry hook is no longer the first pre-hook"


def _train_after_a_raise_inside_a_use() -> dict[str, Any]:
    """A first forward whose ``layer1`` raises inside the use (the stage's forward hook does
    not run), then training with the stages bypassed ("loop"), which only the entry hooks
    gather for."""
    built = _build("Sequential called")
    raising = [True]

    def raise_once(module: nn.Module, args: Any) -> None:
        if raising[0]:
            raising[0] = False
            raise ValueError("a data error in the first forward")

    built.layer1[1].register_forward_pre_hook(raise_once)
    model = shardpar.wrap(built, stage=3, min_unit_params=MIN_UNIT_PARAMS)
    x, _ = _batch(0)
    with pytest.raises(ValueError, match="data error"):
        model(x[:2])
    entries = {name: len(m._forward_pre_hooks) for name, m in built.named_modules() if name.startswith("layer")}
    built.mode = "loop"
    result = _train_wrapped(model)
    model.engine.close()
    return {**result, "entries": entries}


def test_entry_hooks_are_back_after_a_forward_raised_inside_a_use() -> None:
    # The raised forward never ended the use; the root's abandonment puts every entry hook
    # back, so a later forward that bypasses the stages gathers them and trains.
    expected = _reference("loop")
    for rank, result in enumerate(run_ranks(_train_after_a_raise_inside_a_use, 2, timeout=120)):
        hooks = result["entries"]  # shardpar's one on each (the stages': their use's), the raising one
        assert hooks == {name: 2 if name == "layer1.1" else 1 for name in hooks}, hooks
        _assert_trains_like(result, expected, f"rank {rank}")
