"""What DDP scripts already do works on a wrapped model at every stage, or fails loudly on
first use -- never a silent no-op.

- A torch optimizer over ``model.parameters()`` (or nanoGPT's decay/no-decay groups): stage
  0 trains like torch DDP; at stages 1-3 its first ``step()`` raises ``ShardedGradError``
  naming the parameter and ``shardpar.optimizer``, before anything changes (also before any
  backward). Before: the loss stayed flat and nothing warned.
- ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``: stage 0 returns torch's norm
  and clips; stages 1-3 raise naming ``model.clip_grad_norm_``. Before: it returned 0.
- ``.grad`` at stages 1-3: a placeholder on every parameter that got a gradient (None where
  plain torch has None), raising on use; gone before the next backward accumulates.
- ``require_backward_grad_sync = False`` (nanoGPT's gradient accumulation) communicates
  nothing and trains exactly like torch DDP doing the same.
- ``model.module.state_dict()`` at stage 3 returns the full tensors.
- Evaluation on rank 0 only: completes at stage 0 under ``no_grad`` (as torch DDP); at stage
  3 every rank's gathers are needed, and the lone rank raises ``RanksOutOfStep`` within
  ``timeout_s`` naming the rank that did not arrive and the unit it waited for.
- Hugging Face ``generate`` at stage 3 with a different number of new tokens per rank works
  with ``synced_gpus=True``, giving the unwrapped model's tokens.
"""

from __future__ import annotations

import contextlib
import copy
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import shardpar
from shardpar import ShardedGradError
from shardpar.comm import collectives as C
from tests.support.harness import RankFailure, run_ranks

STAGES = [0, 1, 2, 3]


class Net(nn.Module):
    """Two blocks and a branch not taken (``spare``), nanoGPT-style 2-D and 1-D parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 4)
        self.spare = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _wrap(module: nn.Module, stage: int, **options: Any) -> shardpar.ShardedModule:
    return shardpar.wrap(module, stage=stage, min_unit_params=1, bucket_cap_mb=0.001, **options)


def _nanogpt_groups(module: nn.Module) -> list[dict[str, Any]]:
    """nanoGPT's configure_optimizers: weight decay on 2-D parameters only."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


# --------------------------------------------------------------------------- torch optimizers


def _torch_optimizer(stage: int, when: str) -> dict[str, Any]:
    module = _net()
    model = _wrap(module, stage)
    opt = torch.optim.AdamW(_nanogpt_groups(model), lr=0.1)
    before = {k: v.clone() for k, v in model.full_state_dict().items()}
    if when == "after backward":
        model(_batch(0, C.get_rank())).square().mean().backward()
    try:
        opt.step()
        error = None
    except ShardedGradError as caught:
        error = str(caught)
    after = model.full_state_dict()
    return {
        "error": error,
        "unchanged": all(torch.equal(after[k], v) for k, v in before.items()),
        "state": len(opt.state),
    }


@pytest.mark.parametrize("when", ["after backward", "before any backward"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_torch_optimizer_over_model_parameters_refuses_to_step_at_stages_1_to_3(stage: int, when: str) -> None:
    for rank, result in enumerate(run_ranks(_torch_optimizer, 2, stage, when, timeout=60)):
        assert result["error"] is not None, f"stage {stage}, rank {rank}: the torch optimizer stepped"
        assert re.search(
            r"torch\.optim\.adamw\.AdamW holds parameter 'blocks\.0\.weight' of a model wrapped by "
            rf"shardpar, whose gradient it cannot see: at stage {stage} it exists only as shards",
            result["error"],
        ), result["error"]
        assert "shardpar.optimizer(model, torch.optim.adamw.AdamW" in result["error"]
        assert result["unchanged"] and result["state"] == 0, f"stage {stage}, rank {rank}: something changed"


def _torch_optimizer_like_ddp(stage: int) -> dict[str, torch.Tensor]:
    """Stage 0 with a plain torch optimizer, against torch DDP with the same optimizer."""
    rank = C.get_rank()
    model = _wrap(_net(), stage)
    ddp = DistributedDataParallel(_net(), find_unused_parameters=True)
    ours = torch.optim.AdamW(_nanogpt_groups(model), lr=0.05)
    theirs = torch.optim.AdamW(_nanogpt_groups(ddp.module), lr=0.05)
    for step in range(3):
        for net, opt in ((model, ours), (ddp, theirs)):
            net(_batch(step, rank)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    theirs_state = ddp.module.state_dict()
    return {k: (v, theirs_state[k]) for k, v in model.full_state_dict().items()}


def test_a_torch_optimizer_over_model_parameters_trains_like_ddp_at_stage_0() -> None:
    for rank, pairs in enumerate(run_ranks(_torch_optimizer_like_ddp, 2, 0, timeout=60)):
        for name, (ours, ddp) in pairs.items():
            torch.testing.assert_close(ours, ddp, rtol=1e-5, atol=1e-6, msg=f"rank {rank}, {name}")


# --------------------------------------------------------------------------- clipping with torch


def _torch_clip(stage: int) -> dict[str, Any]:
    model = _wrap(_net(), stage)
    model(_batch(0, C.get_rank())).square().mean().backward()
    try:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3))
        error = None
    except ShardedGradError as caught:
        norm, error = None, str(caught)
    return {"norm": norm, "error": error, "ours": float(model.clip_grad_norm_(1e9))}


@pytest.mark.parametrize("stage", STAGES)
def test_torch_clip_grad_norm_over_model_parameters(stage: int) -> None:
    reference = _net()
    (sum(reference(_batch(0, rank)).square().mean() for rank in range(2)) / 2).backward()
    expected = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9))
    for rank, result in enumerate(run_ranks(_torch_clip, 2, stage, timeout=60)):
        if stage == 0:
            assert result["norm"] == pytest.approx(expected, rel=1e-5), f"rank {rank}"
            assert result["ours"] == pytest.approx(1e-3, rel=1e-3), "torch's clip_grad_norm_ did not clip"
        else:
            assert result["norm"] is None, f"stage {stage}: torch's clip_grad_norm_ returned {result['norm']}"
            assert "exists only as shards" in result["error"] and "model.clip_grad_norm_" in result["error"]
            assert result["ours"] == pytest.approx(expected, rel=1e-5), "the placeholders disturbed our own clipping"


# --------------------------------------------------------------------------- .grad


def _grads_seen(stage: int) -> dict[str, Any]:
    model = _wrap(_net(), stage)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=0.1)
    rank = C.get_rank()
    seen: dict[str, Any] = {}
    with model.no_sync():
        model(_batch(0, rank)).square().mean().backward()
    seen["inside no_sync"] = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    model(_batch(1, rank)).square().mean().backward()
    seen["after backward"] = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    seen["repr"] = repr(model.module.head.weight.grad)
    model(_batch(2, rank)).square().mean().backward()  # accumulates across reductions, as torch does
    opt.step()
    seen["after step"] = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    opt.zero_grad()
    seen["after zero_grad"] = {n: type(p.grad).__name__ for n, p in model.named_parameters()}
    seen["state"] = model.full_state_dict()
    return seen


def _grads_reference() -> dict[str, torch.Tensor]:
    module = _net()
    opt = torch.optim.AdamW(module.parameters(), lr=0.1)
    for step in range(3):
        (sum(module(_batch(step, rank)).square().mean() for rank in range(2)) / 2).backward()
    opt.step()
    return module.state_dict()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_grad_at_stages_1_to_3_is_a_placeholder_where_torch_has_a_gradient(stage: int) -> None:
    expected = _grads_reference()
    for rank, seen in enumerate(run_ranks(_grads_seen, 2, stage, timeout=60)):
        used = {n: "ShardedGrad" for n in seen["after backward"] if not n.startswith("spare.")}
        assert seen["after backward"] == {**used, "spare.weight": "NoneType", "spare.bias": "NoneType"}
        assert seen["after step"] == seen["after backward"]
        # Inside no_sync stage 1 accumulates in its full buffer, whose views are the local
        # (unreduced) gradients, as torch DDP's .grad are there; stages 2-3 keep them apart.
        local = {n: seen["inside no_sync"][n] for n in used}
        assert set(local.values()) == ({"Tensor"} if stage == 1 else {"NoneType"}), seen["inside no_sync"]
        assert set(seen["after zero_grad"].values()) == {"NoneType"}
        assert "head.weight" in seen["repr"] and "exists only as shards" in seen["repr"]
        for name, value in expected.items():
            torch.testing.assert_close(seen["state"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank}: {name}")


# --------------------------------------------------------------------------- require_backward_grad_sync


def _accumulate_like_nanogpt(stage: int, micro_steps: int) -> dict[str, Any]:
    """nanoGPT's loop: ``model.require_backward_grad_sync = (micro_step == last)``, on
    shardpar and on torch DDP, same data and optimizer."""
    rank = C.get_rank()
    model = _wrap(_net(), stage)
    ddp = DistributedDataParallel(_net(), find_unused_parameters=True)
    ours = shardpar.optimizer(model, torch.optim.AdamW, _nanogpt_groups(model), lr=0.05)
    theirs = torch.optim.AdamW(_nanogpt_groups(ddp.module), lr=0.05)
    reductions_while_off = 0
    for step in range(2):
        for micro in range(micro_steps):
            for net in (model, ddp):
                net.require_backward_grad_sync = micro == micro_steps - 1
                before = _reduce_calls(model)
                (net(_batch(10 * step + micro, rank)).square().mean() / micro_steps).backward()
                if net is model and micro < micro_steps - 1:
                    reductions_while_off += _reduce_calls(model) - before
        for opt in (ours, theirs):
            opt.step()
            opt.zero_grad()
    theirs_state = ddp.module.state_dict()
    return {
        "reductions_while_off": reductions_while_off,
        "pairs": {k: (v, theirs_state[k]) for k, v in model.full_state_dict().items()},
    }


def _reduce_calls(model: shardpar.ShardedModule) -> int:
    stats = model.comm_stats()
    return sum(stats.get(op, {}).get("calls", 0) for op in ("all_reduce", "reduce_scatter", "used_flags"))


@pytest.mark.parametrize("stage", STAGES)
def test_require_backward_grad_sync_false_accumulates_like_ddp(stage: int) -> None:
    for rank, result in enumerate(run_ranks(_accumulate_like_nanogpt, 2, stage, 3, timeout=60)):
        assert result["reductions_while_off"] == 0, f"stage {stage}: micro-steps with sync off communicated"
        for name, (ours, ddp) in result["pairs"].items():
            torch.testing.assert_close(ours, ddp, rtol=1e-5, atol=1e-6, msg=f"stage {stage}, rank {rank}: {name}")


# --------------------------------------------------------------------------- state_dict at stage 3


def _module_state_dict_at_stage_3() -> dict[str, Any]:
    module = _net()
    model = _wrap(module, 3)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=0.1)
    model(_batch(0, C.get_rank())).square().mean().backward()
    opt.step()
    return {"raw": model.module.state_dict(), "full": model.full_state_dict()}


def test_model_module_state_dict_at_stage_3_is_the_full_state() -> None:
    for rank, result in enumerate(run_ranks(_module_state_dict_at_stage_3, 2, timeout=60)):
        assert result["raw"].keys() == result["full"].keys()
        for name, value in result["raw"].items():
            assert not value.isnan().any(), f"rank {rank}: {name} has NaN"
            assert torch.equal(value, result["full"][name]), f"rank {rank}: {name}"


# --------------------------------------------------------------------------- evaluation on one rank


def _evaluate_on_rank_0_only(stage: int, what: str = "eval", mixed_precision: Any = None) -> Any:
    model = _wrap(_net(), stage, timeout_s=3, mixed_precision=mixed_precision)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=0.1)
    rank = C.get_rank()
    model(_batch(0, rank)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    evaluated = None
    try:
        if rank == 0 and what == "eval":
            model.eval()
            with torch.no_grad():
                evaluated = float(model(_batch(9, 0)).square().mean())
            model.train()
        if rank == 0 and what == "state_dict":  # nanoGPT's checkpoint, on master_process only
            evaluated = len(model.module.state_dict())
        if rank == 0 and what == "model.state_dict":
            evaluated = len(model.state_dict())
        dist.barrier()  # the script's own "wait for rank 0", as DDP scripts do
        model(_batch(1, rank)).square().mean().backward()
        opt.step()
    except shardpar.RanksOutOfStep as error:
        raise RuntimeError(f"RanksOutOfStep missing={error.missing}: {error}") from error
    return evaluated, model.full_state_dict()


@pytest.mark.parametrize("what", ["eval", "state_dict", "model.state_dict"])
def test_evaluation_on_rank_0_only_completes_at_stage_0(what: str) -> None:
    """Every rank holds every value at stage 0: an evaluation or a state dict on rank 0 alone
    (nanoGPT's ``if master_process:``) needs no other rank, as under DDP."""
    (evaluated, state0), (nothing, state1) = run_ranks(_evaluate_on_rank_0_only, 2, 0, what, timeout=60)
    assert evaluated is not None and nothing is None
    for name, value in state0.items():
        assert torch.equal(value, state1[name]), name


def test_state_dict_on_rank_0_only_at_stage_3_names_the_missing_rank() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_evaluate_on_rank_0_only, 2, 3, "state_dict", timeout=60)
    message = failure.value.failures[0]
    assert "RanksOutOfStep missing=[1]" in message and "rank 1: no report" in message, message[-3000:]


def test_evaluation_on_rank_0_only_at_stage_3_names_the_missing_rank_and_the_unit() -> None:
    with pytest.raises(RankFailure) as failure:
        run_ranks(_evaluate_on_rank_0_only, 2, 3, timeout=60)
    message = failure.value.failures[0]
    assert "RanksOutOfStep missing=[1]" in message, message[-3000:]
    # (rank 0's report may also describe models of earlier tests that this worker still holds)
    assert re.search(
        r"rank 0: .*in a forward pass after 1 backward passes and 1 optimizer steps.*; waiting in "
        r"tagged all_gather of unit 'blocks\.0'",
        message,
    ), message[-3000:]
    assert "rank 1: no report" in message


# --------------------------------------------------------------------------- generate at stage 3


def _generate_different_lengths(synced_gpus: bool) -> dict[str, Any]:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=63
    )
    plain = transformers.GPT2LMHeadModel(config).eval()
    torch.manual_seed(0)
    module = transformers.GPT2LMHeadModel(config)
    model = shardpar.wrap(module, stage=3, min_unit_params=1, timeout_s=5)
    model.eval()
    rank = C.get_rank()
    prompt = torch.tensor([[1 + rank, 2, 3]])
    new_tokens = 3 + 4 * rank  # the ranks stop at different lengths
    options = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ours = module.generate(prompt, synced_gpus=synced_gpus, **options)
        expected = plain.generate(prompt, **options)
    return {"ours": ours.tolist(), "expected": expected.tolist()}


def test_hf_generate_at_stage_3_with_different_lengths_needs_synced_gpus() -> None:
    for rank, result in enumerate(run_ranks(_generate_different_lengths, 2, True, timeout=90)):
        assert result["ours"] == result["expected"], f"rank {rank}"
        assert len(result["ours"][0]) == 3 + 3 + 4 * rank


# --------------------------------------------------------------------------- partial loads


class _TiedFrozenBuffered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied: two keys, one parameter
        self.body.bias.requires_grad_(False)  # frozen
        self.register_buffer("scale", torch.ones(8))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(tokens)) * self.scale)


def _partial_loads(stage: int) -> dict[str, Any]:
    torch.manual_seed(0)
    plain = _TiedFrozenBuffered()
    model = shardpar.wrap(_TiedFrozenBuffered(), stage=stage, **({"min_unit_params": 1} if stage == 3 else {}))
    plain.load_state_dict(model.full_state_dict())
    g = torch.Generator().manual_seed(5)
    partial = {
        "body.weight": torch.randn(8, 8, generator=g),
        "head.weight": torch.randn(10, 8, generator=g),  # only the alias of the tied emb.weight
        "scale": torch.full((8,), 2.0),
        "not.in.the.model": torch.zeros(3),
    }
    out: dict[str, Any] = {"plain": plain.load_state_dict(partial, strict=False)}
    out["ours"] = model.load_state_dict(partial, strict=False)
    out["state_equal"] = sorted(k for k, v in plain.state_dict().items() if torch.equal(model.full_state_dict()[k], v))
    out["keys"] = sorted(plain.state_dict())
    before = model.full_state_dict()
    for case, bad, strict in (("strict", partial, True), ("shape", {"body.weight": torch.zeros(4, 4)}, False)):
        for who, target in (("plain_" + case, copy.deepcopy(plain)), (case, model)):
            try:
                target.load_state_dict(bad, strict=strict)
                out[who] = "no error"
            except RuntimeError as error:
                out[who] = str(error)
    out["unchanged_after_errors"] = all(torch.equal(v, before[k]) for k, v in model.full_state_dict().items())
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_load_state_dict_strict_false_loads_the_keys_present_like_torch(stage: int) -> None:
    """``strict=False`` (a backbone without its head, a checkpoint with extra keys): the keys
    present are loaded, the rest keep their values, and the missing/unexpected keys returned
    are torch's; a tied parameter is loaded through whichever key is given. ``strict=True``
    names what is missing and unexpected; a wrong shape is an error either way, each torch's
    own error; unlike torch, an error changes nothing."""
    for rank, out in enumerate(run_ranks(_partial_loads, 2, stage, timeout=120)):
        assert tuple(out["ours"]) == tuple(out["plain"]), (rank, out["ours"], out["plain"])
        assert sorted(out["plain"].missing_keys) == ["body.bias", "emb.weight"], out["plain"]
        assert out["state_equal"] == out["keys"], (rank, out["state_equal"])
        assert out["strict"] == out["plain_strict"], (out["strict"], out["plain_strict"])  # torch's own error
        assert out["shape"] == out["plain_shape"], (out["shape"], out["plain_shape"])
        assert 'Missing key(s) in state_dict: "emb.weight", "body.bias"' in out["strict"], out["strict"]
        assert '"not.in.the.model"' in out["strict"] and "size mismatch for body.weight" in out["shape"], out
        assert out["unchanged_after_errors"], rank


# --------------------------------------------------------------------------- copies of the module

_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


_CALLS: list[int] = []


def _record_call(module: nn.Module, args: Any, output: Any) -> None:
    """A user's forward hook (module level, so a pickled module can refer to it)."""
    _CALLS.append(1)


def _copies_of_the_module(stage: int, mixed_precision: Any) -> dict[str, Any]:
    import copy
    import io

    torch.manual_seed(0)
    module = _TiedFrozenBuffered()
    calls = _CALLS
    module.body.register_forward_hook(_record_call)  # the user's own hook: copied
    model = shardpar.wrap(
        module, stage=stage, mixed_precision=mixed_precision, **({"min_unit_params": 1} if stage == 3 else {})
    )
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    tokens = torch.tensor([[1, 2, 3], [4, 5, 6]]) + C.get_rank()
    model(tokens).float().sum().backward()
    opt.step()
    opt.zero_grad()
    out: dict[str, Any] = {}
    full = model.full_state_dict()
    ema = copy.deepcopy(model.module)
    buffer = io.BytesIO()
    torch.save(model.module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for label, copied in (("deepcopy", ema), ("torch.save", loaded)):
        state = copied.state_dict()
        out[label] = {
            "class": type(copied).__name__,
            "equal": sorted(k for k, v in full.items() if torch.equal(state[k], v) and state[k].dtype == v.dtype),
            "tied": copied.head.weight is copied.emb.weight,
            "frozen": [n for n, p in copied.named_parameters() if not p.requires_grad],
            "plain": all(type(p) is nn.Parameter for p in copied.parameters()),
            "hooks": sum(len(getattr(m, d)) for m in copied.modules() for d in _HOOK_DICTS),
            "marks": sorted(
                k
                for k in copied.__dict__
                if "shardpar" in k or k in ("zero_grad", "_apply", "load_state_dict", "__deepcopy__")
            ),
        }
    comm_before = model.comm_stats()
    calls.clear()
    with torch.no_grad():
        ema_out = ema.float()(tokens)  # a plain module: any cast, no collective
    out["ema_no_collective"] = model.comm_stats() == comm_before
    out["user_hook_ran"] = len(calls) == 1
    out["ema_close_to_model"] = float((ema_out - model(tokens).float()).abs().max())
    for what, call in (("model", lambda: copy.deepcopy(model)), ("save", lambda: torch.save(model, io.BytesIO()))):
        try:
            call()
            out[what] = "no error"
        except TypeError as error:
            out[what] = str(error)
    model(tokens).float().sum().backward()  # the wrapped model trains on after being copied
    opt.step()
    out["trains_on"] = not torch.equal(model.full_state_dict()["body.weight"], full["body.weight"])
    model.engine.close()
    out["after_close"] = sorted(
        k for k in module.__dict__ if k in ("__deepcopy__", "__reduce_ex__", "zero_grad", "_apply", "load_state_dict")
    )
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_deepcopy_and_torch_save_of_the_module_give_a_plain_module_with_the_weights(
    stage: int, mixed_precision: Any
) -> None:
    """DDP scripts make an EMA or evaluation model with ``copy.deepcopy(model.module)`` or
    ``torch.save(model.module, path)``: both give the user's class with the current
    full-precision weights (fp32 masters under bf16), tied and frozen parameters as they were,
    the user's own hooks and none of shardpar's, so running it makes no collective. Copying or
    pickling the ShardedModule itself is refused by name."""
    keys = sorted(_TiedFrozenBuffered().state_dict())
    for rank, out in enumerate(run_ranks(_copies_of_the_module, 2, stage, mixed_precision, timeout=120)):
        for label in ("deepcopy", "torch.save"):
            got = out[label]
            assert got["class"] == "_TiedFrozenBuffered" and got["equal"] == keys, (rank, label, got)
            assert got["tied"] and got["plain"] and got["frozen"] == ["body.bias"], (rank, label, got)
            assert got["hooks"] == 1 and got["marks"] == [], (rank, label, got)
        assert out["ema_no_collective"] and out["user_hook_ran"], (rank, out)
        assert out["ema_close_to_model"] < (5e-2 if mixed_precision else 1e-6), (rank, out["ema_close_to_model"])
        assert "copy.deepcopy(model.module)" in out["model"] and "torch.save(model.module" in out["save"], out
        assert out["trains_on"] and out["after_close"] == [], (rank, out)


# --------------------------------------------------------------------------- clipping by value


def _clip_by_value(stage: int) -> dict[str, torch.Tensor]:
    rank, world = C.get_rank(), C.get_world_size()
    torch.manual_seed(0)
    model = shardpar.wrap(
        nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)),
        stage=stage,
        **({"min_unit_params": 1} if stage == 3 else {}),
    )
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.5)
    for step in range(3):
        x = torch.randn(8 * world, 6, generator=torch.Generator().manual_seed(step)) * 5
        model(x[8 * rank : 8 * (rank + 1)]).square().mean().backward()
        model.clip_grad_value_(0.05)
        opt.step()
        opt.zero_grad()
    state = model.full_state_dict()
    model.engine.close()
    return state


@pytest.mark.parametrize("stage", STAGES)
def test_clip_grad_value_matches_torch_on_the_averaged_gradient(stage: int) -> None:
    """``model.clip_grad_value_`` clamps the reduced gradient as torch's clip_grad_value_ does on
    one process with the global batch (a small clip value, so most elements are clamped)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    clamped = 0
    for step in range(3):
        x = torch.randn(16, 6, generator=torch.Generator().manual_seed(step)) * 5
        plain(x).square().mean().backward()
        clamped += sum(int((p.grad.abs() > 0.05).sum()) for p in plain.parameters())
        torch.nn.utils.clip_grad_value_(plain.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    assert clamped > 20  # the clip does something here
    for rank, state in enumerate(run_ranks(_clip_by_value, 2, stage, timeout=120)):
        for name, value in plain.state_dict().items():
            assert torch.allclose(state[name], value, rtol=1e-5, atol=1e-6), (rank, name)


def test_clip_grad_value_refuses_a_negative_value() -> None:
    model = shardpar.wrap(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="clip_value must be a non-negative number, got -1.0"):
        model.clip_grad_value_(-1)
    model.engine.close()


# --------------------------------------------------------------------------- inference mode


def _evaluate_under_inference_mode(stage: int, mixed_precision: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = shardpar.wrap(
        nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1)),
        stage=stage,
        mixed_precision=mixed_precision,
        **({"min_unit_params": 1} if stage == 3 else {}),
    )
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(C.get_rank()))
    out: dict[str, Any] = {"inference": [], "no_grad": []}
    for _ in range(2):
        model.train()
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        with torch.inference_mode():
            out["inference"].append(model(x))
        with torch.no_grad():
            out["no_grad"].append(model(x))
    model.train()
    model(x).float().sum().backward()  # training goes on after evaluating under inference mode
    opt.step()
    out["state"] = model.full_state_dict()
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_evaluation_under_inference_mode_equals_no_grad_and_training_goes_on(stage: int, mixed_precision: Any) -> None:
    """Evaluation loops run under ``torch.inference_mode()`` (Lightning's default): the outputs
    equal ``no_grad``'s exactly at every stage, and training afterwards ends where stage 0 does.
    Stage 3 used to fail when freeing a unit ("this tensor stands in for a sharded parameter")."""
    reference = run_ranks(_evaluate_under_inference_mode, 2, 0, mixed_precision, timeout=120)
    for rank, out in enumerate(run_ranks(_evaluate_under_inference_mode, 2, stage, mixed_precision, timeout=120)):
        for got, want in zip(out["inference"], out["no_grad"]):
            assert torch.equal(got, want), (rank, got, want)
        for name, value in reference[rank]["state"].items():
            assert torch.allclose(out["state"][name], value, rtol=1e-5, atol=1e-6), (rank, name)


# --------------------------------------------------------------------------- two optimizers, one model


class _TwoParts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def _two_optimizer_loop(
    model: nn.Module, inner: _TwoParts, make_opt: Any, rank: int, world: int, no_sync: Any
) -> list[float]:
    """Adam over ``a``, SGD over ``b``. Each step: a micro-batch under no_sync, then a synced
    one; step and clear ``a`` first, then clip what is left (``b``'s gradients only: ``a``'s
    are None now) and step ``b``; ``b`` is cleared every other step only, so its gradients
    accumulate across two steps."""
    o1 = make_opt(list(inner.a.parameters()), torch.optim.Adam, lr=1e-2)
    o2 = make_opt(list(inner.b.parameters()), torch.optim.SGD, lr=1e-1)
    g = torch.Generator().manual_seed(1)
    norms = []
    for step in range(4):
        for micro in range(2):
            x = torch.randn(8, 4, generator=g).chunk(world)[rank]
            with no_sync() if micro == 0 else contextlib.nullcontext():
                (model(x).square().mean() / 2).backward()
        o1.step()
        o1.zero_grad()
        norms.append(
            float(
                model.clip_grad_norm_(0.5)
                if hasattr(model, "engine")
                else torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            )
        )
        o2.step()
        if step % 2:
            o2.zero_grad()
    return norms


def _two_optimizers(stage: int, mixed_precision: Any = None) -> dict[str, Any]:
    torch.manual_seed(0)
    inner = _TwoParts()
    model = shardpar.wrap(
        inner, stage=stage, mixed_precision=mixed_precision, **({"min_unit_params": 1} if stage == 3 else {})
    )
    norms = _two_optimizer_loop(
        model,
        inner,
        lambda params, cls, **kw: shardpar.optimizer(model, cls, params, **kw),
        C.get_rank(),
        C.get_world_size(),
        model.no_sync,
    )
    state = model.full_state_dict()
    model.engine.close()
    return {"norms": norms, "state": state}


@pytest.mark.parametrize("stage", STAGES)
def test_two_optimizers_over_one_model_clear_only_their_own_gradients(stage: int) -> None:
    """torch's ``opt.zero_grad()`` clears its own parameters only: after ``o1.zero_grad()``,
    ``o2`` still steps with its gradients, the global norm leaves ``a`` out, and ``b`` keeps
    accumulating where ``o2`` does not clear it. The same as plain torch on one process with
    the global batch (the no_sync micro-batch included), at every stage."""
    torch.manual_seed(0)
    plain = _TwoParts()
    want_norms = _two_optimizer_loop(
        plain, plain, lambda params, cls, **kw: cls(params, **kw), 0, 1, contextlib.nullcontext
    )
    for rank, out in enumerate(run_ranks(_two_optimizers, 2, stage, timeout=120)):
        assert out["norms"] == pytest.approx(want_norms, rel=1e-5), (rank, out["norms"], want_norms)
        for name, value in plain.state_dict().items():
            assert torch.allclose(out["state"][name], value, rtol=1e-5, atol=1e-6), (rank, name)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_two_optimizers_under_bf16_reductions_match_stage_0(stage: int) -> None:
    """The same loop with bf16 compute and bf16 gradient reductions, where stages 0-1 keep a
    separate fp32 copy of the reduced gradients: every stage ends where stage 0 does."""
    policy = shardpar.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    reference = run_ranks(_two_optimizers, 2, 0, policy, timeout=120)
    for rank, out in enumerate(run_ranks(_two_optimizers, 2, stage, policy, timeout=120)):
        assert out["norms"] == pytest.approx(reference[rank]["norms"], rel=2e-2), (rank, out["norms"])
        for name, value in reference[rank]["state"].items():
            assert torch.allclose(out["state"][name], value, rtol=2e-2, atol=2e-3), (rank, name)


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.c = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_c: bool) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h + self.c(h) if use_c else h)


def _kept_zeros_loop(
    model: nn.Module, inner: _Branchy, opt: Any, rank: int, world: int, no_sync: Any, stage_0_grads: bool
) -> dict[str, Any]:
    """torch's zero_grad(set_to_none=False) keeps zeroed gradients, which later steps still
    apply (AdamW decays the parameter, moves its moments): a step straight after it, and steps
    after backwards that skip the branch ``c``. ``set_to_none=True`` ends that again."""
    g = torch.Generator().manual_seed(1)
    grads_none = []

    def backward(use_c: bool, micro_batches: int = 1) -> None:
        for micro in range(micro_batches):
            x = torch.randn(8, 4, generator=g).chunk(world)[rank]
            with no_sync() if micro < micro_batches - 1 else contextlib.nullcontext():
                (model(x, use_c=use_c).square().mean() / 2).backward()

    backward(use_c=True)
    opt.step()
    opt.zero_grad(set_to_none=False)
    if stage_0_grads:  # where .grad is the gradient: zeros, not None, as torch keeps them
        grads_none.append([p.grad is None for p in inner.parameters()])
    opt.step()  # no backward: the kept zeros still decay every parameter
    backward(use_c=False, micro_batches=2)  # c gets nothing, but keeps its zero gradient
    opt.step()
    model.zero_grad(set_to_none=False)  # the module's own, as in many scripts
    backward(use_c=False)
    opt.step()
    opt.zero_grad()  # set_to_none=True: c has no gradient again, so the next step skips it
    backward(use_c=False)
    if stage_0_grads:
        grads_none.append([p.grad is None for p in inner.parameters()])
    opt.step()
    state = model.full_state_dict() if hasattr(model, "full_state_dict") else inner.state_dict()
    return {"state": state, "grads_none": grads_none}


def _kept_zeros(stage: int, mixed_precision: Any = None) -> dict[str, Any]:
    torch.manual_seed(0)
    inner = _Branchy()
    model = shardpar.wrap(
        inner, stage=stage, mixed_precision=mixed_precision, **({"min_unit_params": 1} if stage == 3 else {})
    )
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.5)
    out = _kept_zeros_loop(
        model, inner, opt, C.get_rank(), C.get_world_size(), model.no_sync, stage == 0 and mixed_precision is None
    )
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_zero_grad_without_set_to_none_keeps_zero_gradients_that_later_steps_apply(stage: int) -> None:
    """The same parameters as plain torch on one process with the global batch: a step right
    after ``zero_grad(set_to_none=False)`` and steps after backwards that skip a branch decay
    every parameter whose gradient was kept; after ``zero_grad()`` the skipped branch is left
    alone again. Before, shardpar treated the kept gradients as None and skipped them."""
    torch.manual_seed(0)
    plain = _Branchy()
    want = _kept_zeros_loop(
        plain,
        plain,
        torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.5),
        0,
        1,
        contextlib.nullcontext,
        True,
    )
    assert want["grads_none"] == [[False] * 6, [False, False, True, True, False, False]]
    for rank, out in enumerate(run_ranks(_kept_zeros, 2, stage, timeout=120)):
        if stage == 0:
            assert out["grads_none"] == want["grads_none"], (rank, out["grads_none"])
        for name, value in plain.state_dict().items():
            assert torch.allclose(out["state"][name], value, rtol=1e-5, atol=1e-6), (rank, name)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_without_set_to_none_under_bf16_matches_stage_0(stage: int) -> None:
    policy = shardpar.MixedPrecision(torch.bfloat16, torch.bfloat16, torch.bfloat16)
    reference = run_ranks(_kept_zeros, 2, 0, policy, timeout=120)
    for rank, out in enumerate(run_ranks(_kept_zeros, 2, stage, policy, timeout=120)):
        for name, value in reference[rank]["state"].items():
            assert torch.allclose(out["state"][name], value, rtol=2e-2, atol=2e-3), (rank, name)


# --------------------------------------------------------------------------- module.state_dict() under mixed precision


def _module_state_under_bf16(stage: int) -> dict[str, Any]:
    """nanoGPT's ``raw_model.state_dict()`` and Hugging Face's ``save_pretrained`` of
    ``model.module`` (every rank calling, rank 0 writing) after a bf16 step."""
    import tempfile

    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = shardpar.wrap(
        LlamaForCausalLM(config),
        stage=stage,
        mixed_precision="bf16",
        **({"wrap_policy": [LlamaDecoderLayer]} if stage == 3 else {}),
    )
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(C.get_rank()))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    full = model.full_state_dict()
    raw = model.module.state_dict()
    out: dict[str, Any] = {
        "raw_equal": sorted(k for k, v in full.items() if torch.equal(raw[k], v) and raw[k].dtype == v.dtype),
        "keys": sorted(full),
    }
    path = [tempfile.mkdtemp()] if C.get_rank() == 0 else [None]
    dist.broadcast_object_list(path, src=0)
    model.module.save_pretrained(path[0], is_main_process=C.get_rank() == 0)
    dist.barrier()
    saved = LlamaForCausalLM.from_pretrained(path[0], dtype=torch.float32).state_dict()
    out["saved_equal"] = sorted(k for k, v in saved.items() if torch.equal(v, full[k].float()))
    out["saved_keys"] = sorted(saved)
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_module_state_dict_under_bf16_gives_the_fp32_masters(stage: int) -> None:
    """Under mixed precision the parameters a script sees are bf16 compute copies; the module's
    own ``state_dict()`` (and so ``save_pretrained``) gives the fp32 masters instead, as
    ``full_state_dict()`` does: at stage 0 from what every rank holds (no collective), at stages
    1-3, where the masters are sharded, gathered (a collective, as ``model.state_dict()``).
    It used to give the bf16 copies at stages 0-2 (2e-3 off the masters after one step)."""
    for rank, out in enumerate(run_ranks(_module_state_under_bf16, 2, stage, timeout=180)):
        assert out["raw_equal"] == out["keys"], (rank, sorted(set(out["keys"]) - set(out["raw_equal"])))
        assert out["saved_equal"] == out["saved_keys"], (rank, sorted(set(out["saved_keys"]) - set(out["saved_equal"])))


def test_module_state_dict_on_rank_0_only_under_bf16_completes_at_stage_0() -> None:
    """At stage 0 every rank holds the full masters: no collective, so rank 0 alone may call it."""
    (count, state0), (nothing, state1) = run_ranks(_evaluate_on_rank_0_only, 2, 0, "state_dict", "bf16", timeout=60)
    assert count == len(state0) and nothing is None
    for name, value in state0.items():
        assert torch.equal(value, state1[name]), name


@pytest.mark.parametrize("stage", [1, 2])
def test_module_state_dict_on_rank_0_only_under_bf16_at_stages_1_2_names_the_missing_rank(stage: int) -> None:
    """There it gathers the sharded masters, so nanoGPT's rank-0-only ``raw_model.state_dict()``
    stops as at stage 3: every rank raises, naming the rank that did not come."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_evaluate_on_rank_0_only, 2, stage, "state_dict", "bf16", timeout=60)
    message = failure.value.failures[0]
    assert "RanksOutOfStep missing=[1]" in message and "rank 1: no report" in message, message[-3000:]


def _module_load_state_dict(stage: int, mixed_precision: Any) -> dict[str, Any]:
    """Other weights loaded through the wrapped module's own ``load_state_dict`` (all keys, then
    some with strict=False), then a step with lr=0."""
    torch.manual_seed(0)
    model = shardpar.wrap(
        _TiedFrozenBuffered(),
        stage=stage,
        mixed_precision=mixed_precision,
        **({"min_unit_params": 1} if stage == 3 else {}),
    )
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.0)
    torch.manual_seed(1)
    other = _TiedFrozenBuffered().state_dict()
    result = model.module.load_state_dict(other)
    partial = {"body.weight": torch.full((8, 8), 0.5)}
    partial_result = model.module.load_state_dict(partial, strict=False)
    tokens = torch.tensor([[1, 2, 3]])
    model(tokens).float().sum().backward()
    opt.step()
    state = model.full_state_dict()
    model.engine.close()
    want = {**other, **partial}
    return {
        "equal": sorted(k for k, v in want.items() if torch.equal(state[k], v)),
        "keys": sorted(want),
        "result": tuple(result),
        "partial_missing": sorted(partial_result.missing_keys),
    }


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_load_state_dict_of_the_wrapped_module_reaches_the_stored_values(stage: int, mixed_precision: Any) -> None:
    """``model.module.load_state_dict(sd)`` (a script that loads weights into the inner model
    after wrapping) is kept through the next step at every stage: under mixed precision it
    loads the fp32 masters and at stage 3 the shards, where it used to change only the bf16
    compute copies (lost at the next step) or raise at stage 3."""
    for rank, out in enumerate(run_ranks(_module_load_state_dict, 2, stage, mixed_precision, timeout=120)):
        assert out["equal"] == out["keys"], (rank, sorted(set(out["keys"]) - set(out["equal"])))
        assert out["result"] == ([], []) and "emb.weight" in out["partial_missing"], (rank, out)


def _submodule_load_state_dict(stage: int, mixed_precision: Any) -> dict[str, Any]:
    """A submodule's own ``load_state_dict`` after wrap (a backbone or head swapped in): the
    frozen-bias Linear ``body``, then the tied ``head`` through its alias, then ``body`` with a
    key missing (strict: torch's error, after loading the key present, as torch does); then a
    step with lr=0."""
    torch.manual_seed(0)
    model = shardpar.wrap(
        _TiedFrozenBuffered(),
        stage=stage,
        mixed_precision=mixed_precision,
        **({"min_unit_params": 1} if stage == 3 else {}),
    )
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.0)
    g = torch.Generator().manual_seed(1)
    body = {"weight": torch.randn(8, 8, generator=g), "bias": torch.randn(8, generator=g)}
    head = {"weight": torch.randn(10, 8, generator=g)}
    results = [tuple(model.module.body.load_state_dict(body)), tuple(model.module.head.load_state_dict(head))]
    last = torch.randn(8, 8, generator=g)
    try:
        model.module.body.load_state_dict({"weight": last})
        error = ""
    except RuntimeError as e:
        error = str(e)
    model(torch.tensor([[1, 2, 3]])).float().sum().backward()
    opt.step()
    state = model.full_state_dict()
    model.engine.close()
    want = {"body.weight": last, "body.bias": body["bias"], "emb.weight": head["weight"], "head.weight": head["weight"]}
    return {
        "unequal": sorted(k for k, v in want.items() if not torch.equal(state[k], v)),
        "results": results,
        "error": error,
    }


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_load_state_dict_of_a_submodule_reaches_the_stored_values(stage: int, mixed_precision: Any) -> None:
    """``model.module.body.load_state_dict(sd)`` is kept through the next step like a load of
    the whole module: before, under mixed precision at stages 0-2 it changed only the bf16
    compute copies (lost at the next step), and at stage 3 it raised the error for a sharded
    parameter's values. Torch's strict-mode error for a missing key is unchanged."""
    for rank, out in enumerate(run_ranks(_submodule_load_state_dict, 2, stage, mixed_precision, timeout=120)):
        assert out["unequal"] == [], (rank, out["unequal"])
        assert out["results"] == [([], []), ([], [])], (rank, out["results"])
        assert 'Missing key(s) in state_dict: "bias"' in out["error"], (rank, out["error"])


def _ddp_around_sharded(stage: int) -> str:
    model = _wrap(_net(), stage)
    try:
        DistributedDataParallel(model)
    except TypeError as error:
        return str(error)
    return "nothing raised"


@pytest.mark.parametrize("stage", [0, 3])
def test_ddp_around_a_sharded_module_is_refused_by_name(stage: int) -> None:
    """``DistributedDataParallel(shardpar.wrap(model))`` (what accelerate's ``prepare`` does to
    a model given to a plain Hugging Face Trainer) would reduce every gradient twice: refused on
    every rank before DDP's first collective, naming what to do."""
    for rank, message in enumerate(run_ranks(_ddp_around_sharded, 2, stage, timeout=60)):
        assert message.startswith("torch DistributedDataParallel around a model wrapped by shardpar"), (rank, message)
        assert "Pass the unwrapped model to DDP" in message and "ShardparTrainer" in message, message
