"""A wrapped model keeps torch's module contract for state dicts and for weights read or written
outside forward ([Note: full values in the module] in shardpar/facade/module_state.py).

The oracle is plain torch on the same module class: every state-dict hook of the user's modules
runs (torchtitan's fused QKV attention splits ``wqkv`` into ``wq``/``wk``/``wv`` in a state-dict
post-hook and fuses them back in a load pre-hook), keys, missing and unexpected keys are torch's,
and what a load matched reaches the model -- the silent wrong load this file guards against
reported "All keys matched successfully" and kept the old fused weight. ``model.gathered()``
gives full parameters outside forward, as FSDP's ``summon_full_params``; PEFT's
``merge_and_unload()`` inside it gives plain torch's merged weights bit for bit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardpar
from tests.support.harness import RankFailure, run_ranks
from tests.support.parity import rel_error

STAGES = [0, 1, 2, 3]
DIM = 8
CALLS: dict[str, int] = {}
"""How often each user hook ran on this rank (reset by every rank function)."""


def _split_qkv(module: nn.Module, state: dict, prefix: str, local_metadata: Any) -> None:
    """torchtitan's pattern: the fused weight is saved as three."""
    CALLS["split"] = CALLS.get("split", 0) + 1
    fused = state.pop(prefix + "wqkv.weight")
    for name, part in zip(("wq", "wk", "wv"), fused.chunk(3)):
        state[f"{prefix}{name}.weight"] = part


def _fuse_qkv(state: dict, prefix: str, *args: Any) -> None:
    """... and fused back before torch matches keys."""
    CALLS["fuse"] = CALLS.get("fuse", 0) + 1
    names = [f"{prefix}{name}.weight" for name in ("wq", "wk", "wv")]
    if all(name in state for name in names):
        state[prefix + "wqkv.weight"] = torch.cat([state.pop(name) for name in names])


def _after_load(module: nn.Module, incompatible: Any) -> None:
    CALLS["post"] = CALLS.get("post", 0) + 1


class FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM)
        self._register_state_dict_hook(_split_qkv)
        self._register_load_state_dict_pre_hook(_fuse_qkv)
        self.register_load_state_dict_post_hook(_after_load)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.wqkv(x).chunk(3, dim=-1)
        weights = torch.softmax(q @ k.transpose(-2, -1) / DIM**0.5, dim=-1)
        return x + self.wo(weights @ v)


class HookedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.a = FusedAttention()
        self.b = FusedAttention()
        self.head = nn.Linear(DIM, 3)
        self.register_buffer("scale", torch.arange(DIM) * 0.25 + 0.5)  # exact in bf16: buffers compute in it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(self.a(self.inp(x))) * self.scale)


def _wrap(module: nn.Module, stage: int, **options: Any) -> Any:
    return shardpar.wrap(module, stage=stage, **({"min_unit_params": 1} if stage == 3 else {}), **options)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys whose values differ (or are missing on one side)."""
    return sorted(k for k in set(a) | set(b) if k not in a or k not in b or not torch.equal(a[k], b[k]))


def _random_like(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """New values of the same shapes, exact in bf16 (where buffers are kept under mixed precision)."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g).to(torch.bfloat16).to(v.dtype) for k, v in state.items()}


def _hooked_state_dicts(stage: int, mixed_precision: Any) -> dict[str, Any]:
    CALLS.clear()
    torch.manual_seed(0)
    plain = HookedNet()
    torch.manual_seed(0)
    model = _wrap(HookedNet(), stage, mixed_precision=mixed_precision)
    out: dict[str, Any] = {}
    reference = plain.state_dict()
    out["keys"] = (list(model.state_dict()), list(reference))
    out["unequal_read"] = {
        "state_dict": _equal(model.state_dict(), reference),
        "full_state_dict": _equal(model.full_state_dict(), reference),
        "module": _equal(model.module.state_dict(), reference),
        "submodule": _equal(model.module.a.state_dict(), plain.a.state_dict()),
    }
    out["splits"] = CALLS.get("split", 0)

    new = _random_like(reference, 1)
    out["strict"] = (tuple(model.load_state_dict(new)), tuple(plain.load_state_dict(new)))
    out["unequal_strict"] = _equal(model.full_state_dict(), plain.state_dict())
    with model.gathered():
        out["fused_loaded"] = torch.equal(model.module.a.wqkv.weight, plain.a.wqkv.weight)

    partial = {k: v for k, v in _random_like(reference, 2).items() if not k.startswith("b.wq")}
    out["partial"] = (
        tuple(model.load_state_dict(partial, strict=False)),
        tuple(plain.load_state_dict(partial, strict=False)),
    )
    out["unequal_partial"] = _equal(model.full_state_dict(), plain.state_dict())

    inner = _random_like(reference, 3)
    out["inner"] = (tuple(model.module.load_state_dict(inner)), tuple(plain.load_state_dict(inner)))
    sub = _random_like(plain.b.state_dict(), 4)
    out["sub"] = (tuple(model.module.b.load_state_dict(sub)), tuple(plain.b.load_state_dict(sub)))
    out["unequal_inner"] = _equal(model.full_state_dict(), plain.state_dict())
    out["post_hooks"] = CALLS.get("post", 0)

    # A step from the loaded weights is plain torch's step from them (fp32 only: bf16 computes apart).
    if mixed_precision is None:
        opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
        reference_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        x = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(7))
        rank, world = model.engine.rank, model.engine.world_size
        model(x[rank * 2 : rank * 2 + 2]).square().mean().backward()
        opt.step()
        plain(x).square().mean().backward()
        reference_opt.step()
        trained = model.full_state_dict()
        out["step_error"] = max(rel_error(trained[k], v) for k, v in plain.state_dict().items())
        assert world == 2
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_state_dict_hooks_run_on_full_values_like_plain_torch(stage: int, mixed_precision: Any) -> None:
    """A fused weight split by a post-hook and fused by a pre-hook: every state dict (the
    ShardedModule's, full_state_dict, the module's own and a submodule's) equals plain torch's,
    keys and values; a strict load, a non-strict load with keys missing, the module's own and a
    submodule's load report torch's keys and leave the model equal to plain torch after the same
    loads (the fused weight included), and a step from there is plain torch's step."""
    for rank, out in enumerate(run_ranks(_hooked_state_dicts, 2, stage, mixed_precision, timeout=180)):
        assert out["keys"][0] == out["keys"][1] and "a.wq.weight" in out["keys"][0], (rank, out["keys"])
        assert all(not bad for bad in out["unequal_read"].values()), (rank, out["unequal_read"])
        assert out["splits"] >= 8, (rank, out["splits"])  # 2 blocks x 4 state dicts, on full values
        assert out["strict"][0] == out["strict"][1] == ([], []), (rank, out["strict"])
        assert out["unequal_strict"] == [] and out["fused_loaded"], (rank, out["unequal_strict"])
        assert out["partial"][0] == out["partial"][1], (rank, out["partial"])
        assert out["partial"][0][0] == ["b.wqkv.weight"], out["partial"]  # torch: the fuse hook found no wq
        assert out["unequal_partial"] == [], (rank, out["unequal_partial"])
        assert out["inner"][0] == out["inner"][1] and out["sub"][0] == out["sub"][1], (rank, out)
        assert out["unequal_inner"] == [], (rank, out["unequal_inner"])
        # two blocks x three whole loads + one submodule load, for plain torch and for shardpar alike
        assert out["post_hooks"] == 2 * (2 * 3 + 1), (rank, out["post_hooks"])
        if mixed_precision is None:
            assert out["step_error"] <= 1e-6, (rank, out["step_error"])


def _checkpoint_across_stages(save_stage: int, load_stage: int, path: str) -> dict[str, Any]:
    torch.manual_seed(0)
    model = _wrap(HookedNet(), save_stage)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    model(torch.randn(2, 5, 4)).sum().backward()
    opt.step()
    saved = model.full_state_dict()
    shardpar.save_checkpoint(path, model, opt)
    model.engine.close()
    torch.manual_seed(1)
    other = _wrap(HookedNet(), load_stage)
    other_opt = shardpar.optimizer(other, torch.optim.AdamW, lr=1e-2)
    shardpar.load_checkpoint(path, other, other_opt)
    out = {"unequal": _equal(other.full_state_dict(), saved)}
    other.engine.close()
    return out


@pytest.mark.parametrize("save_stage,load_stage", [(3, 1), (1, 3), (0, 3), (2, 0)])
def test_checkpoints_of_a_hooked_model_are_keyed_by_parameters_and_load_at_any_stage(
    tmp_path: Path, save_stage: int, load_stage: int
) -> None:
    """shardpar's own checkpoints hold parameters, not the hooks' keys: saving a hooked model at
    stage 3 works (it used to run the split hook on a sharded parameter) and loads at stage 1."""
    for rank, out in enumerate(
        run_ranks(_checkpoint_across_stages, 2, save_stage, load_stage, str(tmp_path / "ckpt"), timeout=180)
    ):
        assert out["unequal"] == [], (rank, out["unequal"])


def _export_and_import(stage: int, path: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    torch.manual_seed(0)
    plain = HookedNet()
    torch.manual_seed(0)
    model = _wrap(HookedNet(), stage)
    shardpar.checkpoint.save_full(path, model)
    written = load_file(str(Path(path) / "model.safetensors"))
    out: dict[str, Any] = {"unequal_written": _equal(written, plain.state_dict())}
    torch.manual_seed(1)
    other = _wrap(HookedNet(), stage)
    report = shardpar.load_pretrained(other, path)
    out["report"] = (report.missing_keys, report.unexpected_keys)
    out["unequal_loaded"] = _equal(other.full_state_dict(), plain.state_dict())
    model.engine.close()
    other.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_save_full_and_load_pretrained_run_the_hooks(tmp_path: Path, stage: int) -> None:
    """The Hugging Face layout holds what ``state_dict()`` gives (the split keys, as
    ``save_pretrained`` of the plain module writes), and ``load_pretrained`` of it runs the fuse
    hook: the model equals plain torch's."""
    for rank, out in enumerate(run_ranks(_export_and_import, 2, stage, str(tmp_path / "hf"), timeout=180)):
        assert out["unequal_written"] == [], (rank, out["unequal_written"])
        assert out["report"] == ([], []), (rank, out["report"])
        assert out["unequal_loaded"] == [], (rank, out["unequal_loaded"])


# --------------------------------------------------------------------------- weights outside forward


def _edits_inside_gathered(stage: int, mixed_precision: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    plain = HookedNet()
    torch.manual_seed(0)
    model = _wrap(HookedNet(), stage, mixed_precision=mixed_precision)
    out: dict[str, Any] = {}

    def edit(module: nn.Module) -> None:
        with torch.no_grad():
            module.a.wo.weight.mul_(2.0)  # in place
            module.b.wqkv.weight.data = module.b.wqkv.weight.data.flip(0).clone()  # re-assigned
            module.scale.add_(1.0)  # a buffer

    edit(plain)
    with model.gathered():
        out["dtype"] = model.module.inp.weight.dtype
        edit(model.module)
    out["unequal"] = _equal(model.full_state_dict(), plain.state_dict())
    with model.gathered(model.module.head, writeback=False):
        model.module.head.weight.data.zero_()  # not written back
        out["scoped_read"] = torch.equal(model.module.head.bias, plain.head.bias)
    out["unequal_after_readonly"] = _equal(model.full_state_dict(), plain.state_dict())
    x = torch.randn(2, 5, 4)
    out["forward_error"] = rel_error(model(x).float(), plain(x)) if mixed_precision is None else 0.0
    try:
        with model.gathered():
            model.module.head.weight.data = torch.zeros(2, 2)
        out["shape_error"] = ""
    except ValueError as error:
        out["shape_error"] = str(error)
    try:
        with model.gathered(nn.Linear(2, 2)):
            pass
        out["foreign_error"] = ""
    except ValueError as error:
        out["foreign_error"] = str(error)
    out["unequal_after_errors"] = _equal(model.full_state_dict(), plain.state_dict())
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_gathered_gives_full_values_and_writes_them_back(stage: int, mixed_precision: Any) -> None:
    """Inside ``model.gathered()`` the parameters hold their full fp32 values on every rank
    (stage 3 too, outside forward); what is written in place, re-assigned through ``.data`` or
    put in a buffer reaches every stage's storage, as the same edit of plain torch's module;
    ``writeback=False`` and a submodule scope keep the model as it was; a new shape or a module
    from elsewhere is refused by name."""
    for rank, out in enumerate(run_ranks(_edits_inside_gathered, 2, stage, mixed_precision, timeout=180)):
        assert out["dtype"] == torch.float32, (rank, out["dtype"])
        assert out["unequal"] == [] and out["unequal_after_readonly"] == [], (rank, out)
        assert out["scoped_read"], rank
        assert out["forward_error"] <= 1e-6, (rank, out["forward_error"])
        assert "parameter 'head.weight' was given shape (2, 2), not its (3, 8)" in out["shape_error"], out
        assert "not in it" in out["foreign_error"], out["foreign_error"]
        assert out["unequal_after_errors"] == [], (rank, out["unequal_after_errors"])


def _peft_merge(stage: int) -> dict[str, Any]:
    import peft  # a dev dependency: installed in CI

    def build() -> nn.Module:
        torch.manual_seed(0)
        base = nn.Sequential()
        base.add_module("fc1", nn.Linear(6, 8))
        base.add_module("act", nn.GELU())
        base.add_module("fc2", nn.Linear(8, 4))
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"], init_lora_weights=False)
        return peft.get_peft_model(base, config)

    plain = build()
    model = _wrap(build(), stage)
    opt = shardpar.optimizer(model, torch.optim.AdamW, [p for p in model.parameters() if p.requires_grad], lr=1e-2)
    reference_opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=1e-2)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    rank = model.engine.rank
    model(x[rank * 2 : rank * 2 + 2]).square().mean().backward()
    opt.step()
    plain(x).square().mean().backward()
    reference_opt.step()
    merged_reference = {k: v.clone() for k, v in plain.merge_and_unload().state_dict().items()}
    with model.gathered():
        merged = model.module.merge_and_unload()
        ours = {k: v.detach().clone() for k, v in merged.state_dict().items()}
    out = {
        "keys": sorted(ours) == sorted(merged_reference) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"],
        "error": max(rel_error(ours[k], v) for k, v in merged_reference.items()),
    }
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_peft_merge_and_unload_inside_gathered_equals_plain_torch(stage: int) -> None:
    """PEFT LoRA on a frozen base, one AdamW step, then ``merge_and_unload()`` inside
    ``model.gathered()``: plain torch's merged weights (at stage 3 it used to raise that a
    sharded parameter was read). The step is data parallel, so the merged weights agree to the
    parity tolerance; the merge itself adds no error."""
    for rank, out in enumerate(run_ranks(_peft_merge, 2, stage, timeout=180)):
        assert out["keys"], rank
        assert out["error"] <= 1e-6, (rank, out["error"])


def _gathered_on_one_rank(stage: int) -> None:
    model = _wrap(HookedNet(), stage, timeout_s=3)
    try:
        if model.engine.rank == 0:
            with model.gathered():
                pass
        dist.barrier()  # the script's own "wait for rank 0"
    except shardpar.RanksOutOfStep as error:
        raise RuntimeError(f"RanksOutOfStep missing={error.missing}: {error}") from error


def test_gathered_on_one_rank_only_is_named_at_stage_3() -> None:
    """A collective where the values are sharded: a rank that enters alone is told which rank
    did not come, within the timeout of a rare phase, instead of hanging."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_gathered_on_one_rank, 2, 3, timeout=90)
    message = failure.value.failures[0]
    assert "RanksOutOfStep missing=[1]" in message and "full_state_dict" in message, message[-3000:]


def _checkpoint_wrapped_blocks(stage: int) -> dict[str, Any]:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build() -> nn.Module:
        torch.manual_seed(0)
        blocks = nn.Sequential(
            *[checkpoint_wrapper(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, DIM))) for _ in range(2)]
        )
        return nn.Sequential(nn.Linear(4, DIM), blocks, nn.Linear(DIM, 3))

    plain = build()
    model = _wrap(build(), stage)
    reference = plain.state_dict()  # the wrapper's hook strips "_checkpoint_wrapped_module."
    out: dict[str, Any] = {
        "keys": list(model.state_dict()) == list(reference),
        "unequal": _equal(model.full_state_dict(), reference),
    }
    new = _random_like(reference, 5)
    out["load"] = (tuple(model.load_state_dict(new)), tuple(plain.load_state_dict(new)))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    rank = model.engine.rank
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.1)
    reference_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    model(x[rank * 2 : rank * 2 + 2]).square().mean().backward()
    opt.step()
    plain(x).square().mean().backward()
    reference_opt.step()
    trained = model.full_state_dict()
    out["step_error"] = max(rel_error(trained[k], v) for k, v in plain.state_dict().items())
    model.engine.close()
    return out


@pytest.mark.parametrize("stage", STAGES)
def test_torch_checkpoint_wrapper_state_dicts_like_plain_torch(stage: int) -> None:
    """torch's own ``checkpoint_wrapper`` renames its entries in a state-dict hook (it strips
    ``_checkpoint_wrapped_module.``): state dicts and loads are plain torch's at every stage (at
    stage 3 they used to read a sharded parameter), and activation checkpointing trains equal."""
    for rank, out in enumerate(run_ranks(_checkpoint_wrapped_blocks, 2, stage, timeout=120)):
        assert out["keys"] and out["unequal"] == [], (rank, out)
        assert out["load"][0] == out["load"][1] == ([], []), (rank, out["load"])
        assert out["step_error"] <= 1e-6, (rank, out["step_error"])
