"""Frontier-stack models on shardpar, as docs/user-guide.md's "Frontier-stack models" section
describes them: PEFT/LoRA adapters on a frozen base, Hugging Face mixture-of-experts models, and
(in tests/test_init_reassign.py, tests/test_module_contract.py, tests/test_gradient_divide.py and
tests/test_compiled_model.py) torchtitan's habits.

The oracle is plain torch on the same module, one process, the concatenated batch: every rank's
parameters after a few AdamW steps equal its parameters to the parity tolerance, at stages 0-3,
world size 2. Each model is built from a config (no download) and tiny, so a run takes seconds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import RankFailure, run_ranks
from tests.support.parity import TOLERANCE, rel_error

STAGES = [0, 1, 2, 3]
VOCAB = 64
STEPS = 3
LR = 1e-2


def _tokens(step: int, rows: int, length: int) -> torch.Tensor:
    """The global batch of ``step``: a function of the step only, the same on every rank."""
    return torch.randint(1, VOCAB - 1, (rows, length), generator=torch.Generator().manual_seed(1000 + step))


def _rows(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    size = batch.shape[0] // world_size
    return batch[rank * size : (rank + 1) * size]


def _worst(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, list[str]]:
    """The largest relative error over the keys, and the keys missing on one side."""
    differ = sorted(set(actual) ^ set(expected))
    errors = [rel_error(actual[k], v) for k, v in expected.items() if k in actual]
    return max(errors, default=float("inf")), differ


# --------------------------------------------------------------------------- PEFT / LoRA


def _llama() -> Any:
    """A tiny Llama from a config (seed 0), no download."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=VOCAB - 1,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _lora_model(lora_seed: int = 0) -> Any:
    """A tiny Llama (base weights from seed 0) with LoRA adapters on q_proj and v_proj (their
    initial values from ``lora_seed``; ``init_lora_weights=False`` makes B nonzero, so both A and
    B get gradients from the first step)."""
    import peft

    base = _llama()
    torch.manual_seed(lora_seed)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(base, lora)


def _lora_wrap(module: nn.Module, stage: int, **options: Any) -> Any:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    policy: dict[str, Any] = {"wrap_policy": [LlamaDecoderLayer]} if stage == 3 else {}
    return shardpar.wrap(module, stage=stage, **policy, **options)


def _lora_train(model: Any, opt: Any, rank: int, world_size: int) -> None:
    for step in range(STEPS):
        batch = _rows(_tokens(step, 4, 8), rank, world_size)
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        opt.zero_grad()


def _lora(stage: int, load_stage: int, directory: str) -> dict[str, Any]:
    import peft
    from safetensors.torch import load_file

    rank, world_size = C.get_rank(), C.get_world_size()
    out: dict[str, Any] = {}
    plain = _lora_model()
    base_before = {k: v.clone() for k, v in plain.state_dict().items() if "lora_" not in k}
    reference_opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=LR)
    _lora_train(plain, reference_opt, 0, 1)

    module = _lora_model()
    model = _lora_wrap(module, stage)
    out["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=LR)  # params=None: the trainable ones
    out["trainable_numel"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    out["optimized_numel"] = sum(t.numel() for g in opt.param_groups for t in g["params"])  # this rank's pieces
    _lora_train(model, opt, rank, world_size)
    trained = model.full_state_dict()
    out["error"], out["keys_differ"] = _worst(trained, plain.state_dict())
    out["base_changed"] = sorted(k for k, v in base_before.items() if not torch.equal(trained[k], v))

    ours, theirs = Path(directory) / "ours", Path(directory) / "plain"
    module.save_pretrained(str(ours), is_main_process=rank == 0)  # every rank: a collective at stages 1-3
    if rank == 0:
        plain.save_pretrained(str(theirs))
    dist.barrier()
    saved = load_file(str(ours / "adapter_model.safetensors"))
    expected = load_file(str(theirs / "adapter_model.safetensors"))
    out["saved_keys"] = (sorted(saved), sorted(expected))
    out["saved_error"], _ = _worst(saved, expected)
    lora_trained = {k: v for k, v in trained.items() if "lora_" in k}
    out["saved_exact"] = peft.get_peft_model_state_dict(plain).keys() == saved.keys() and all(
        torch.equal(saved[k], lora_trained[k.replace(".weight", ".default.weight")]) for k in saved
    )
    model.engine.close()

    # Back into fresh models at another stage: adapters of another seed, replaced by the saved ones.
    fresh = _lora_model(lora_seed=5)
    other = _lora_wrap(fresh, load_stage)
    result: Any = peft.set_peft_model_state_dict(fresh, saved)
    out["unexpected"] = list(result.unexpected_keys)
    loaded = other.full_state_dict()
    out["set_error"] = max(rel_error(loaded[k], v) for k, v in trained.items())
    out["set_exact"] = all(torch.equal(loaded[k], v) for k, v in trained.items())
    unwrapped = _lora_model()
    unwrapped.load_state_dict(trained)  # the trained values in a plain module
    batch = _tokens(99, 2, 8)
    with torch.no_grad():
        out["forward_error"] = rel_error(other(input_ids=batch).logits, unwrapped(input_ids=batch).logits)
    other.engine.close()

    base = _lora_model().get_base_model()  # from_pretrained takes the base model, then wrap
    from_pretrained = peft.PeftModel.from_pretrained(base, str(ours), is_trainable=True)
    again = _lora_wrap(from_pretrained, load_stage)
    reloaded = again.full_state_dict()
    out["from_pretrained_exact"] = all(torch.equal(reloaded[k], v) for k, v in trained.items())
    out["from_pretrained_trainable"] = sorted(n for n, p in again.named_parameters() if p.requires_grad)
    again.engine.close()
    return out


@pytest.mark.parametrize("stage,load_stage", [(0, 3), (1, 2), (2, 0), (3, 1)])
def test_lora_trains_saves_and_reloads_like_plain_torch(tmp_path: Path, stage: int, load_stage: int) -> None:
    """LoRA on a frozen tiny Llama: ``shardpar.optimizer(model, AdamW)`` (params=None) updates
    the adapters only, and three steps equal plain torch's on the concatenated batch; the frozen
    base is bit-for-bit untouched. ``save_pretrained`` called on every rank (``is_main_process``
    on rank 0) writes the trained adapters exactly, equal to plain torch's adapters; they load
    back into a fresh wrapped model at another stage with ``set_peft_model_state_dict``, and with
    ``PeftModel.from_pretrained`` before wrapping, giving the trained values bit for bit."""
    results = run_ranks(_lora, 2, stage, load_stage, str(tmp_path), timeout=240)
    # the optimizer holds the adapters only: whole at stage 0, split between the ranks at 1-3
    optimized = [out["optimized_numel"] for out in results]
    assert (optimized[0] if stage == 0 else sum(optimized)) == results[0]["trainable_numel"], optimized
    for rank, out in enumerate(results):
        assert len(out["trainable"]) == 8 and all("lora_" in n for n in out["trainable"]), (rank, out["trainable"])
        assert out["keys_differ"] == [] and out["error"] <= TOLERANCE, (rank, out["error"], out["keys_differ"])
        assert out["base_changed"] == [], (rank, out["base_changed"])
        assert out["saved_keys"][0] == out["saved_keys"][1] and len(out["saved_keys"][0]) == 8, (
            rank,
            out["saved_keys"],
        )
        assert out["saved_error"] <= TOLERANCE, (rank, out["saved_error"])
        assert out["saved_exact"], rank
        assert out["unexpected"] == [], (rank, out["unexpected"])
        assert out["set_exact"], (rank, out["set_error"])
        assert out["forward_error"] <= 1e-6, (rank, out["forward_error"])
        assert out["from_pretrained_exact"] and out["from_pretrained_trainable"] == out["trainable"], rank


def _frozen_in_params(stage: int) -> dict[str, Any]:
    """Frozen parameters passed to the optimizer (``model.parameters()``) are accepted and never
    updated: the same training as passing only the trainable ones."""
    rank, world_size = C.get_rank(), C.get_world_size()
    plain = _lora_model()
    reference_opt = torch.optim.AdamW([p for p in plain.parameters() if p.requires_grad], lr=LR)
    _lora_train(plain, reference_opt, 0, 1)
    model = _lora_wrap(_lora_model(), stage)
    opt = shardpar.optimizer(model, torch.optim.AdamW, model.parameters(), lr=LR)
    _lora_train(model, opt, rank, world_size)
    error, differ = _worst(model.full_state_dict(), plain.state_dict())
    model.engine.close()
    return {"error": error, "differ": differ}


@pytest.mark.parametrize("stage", [0, 3])
def test_lora_optimizer_over_all_parameters_skips_the_frozen_ones(stage: int) -> None:
    for rank, out in enumerate(run_ranks(_frozen_in_params, 2, stage, timeout=180)):
        assert out["differ"] == [] and out["error"] <= TOLERANCE, (rank, out)


class Caught(Exception):
    """What a rank raised, as one JSON line for the parent."""


def _save_on_rank_0_only(stage: int, directory: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    rank, world_size = C.get_rank(), C.get_world_size()
    module = _lora_model()
    model = _lora_wrap(module, stage, timeout_s=60)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=LR)
    try:
        _lora_train(model, opt, rank, world_size)
        if rank == 0:  # nanoGPT's habit: `if master_process: save`
            module.save_pretrained(str(Path(directory) / "alone"))
        _lora_train(model, opt, rank, world_size)  # the others go on training
    except shardpar.RanksOutOfStep as error:
        raise Caught(json.dumps({"type": type(error).__name__, "message": str(error)})) from error
    model.engine.close()
    dist.barrier()
    alone = load_file(str(Path(directory) / "alone" / "adapter_model.safetensors"))
    return {"alone": alone}


def _save_on_every_rank_after_training(stage: int, directory: str) -> dict[str, Any]:
    """The adapters after the same three steps, saved by every rank (the reference for the
    rank-0-only save, which happens at that point)."""
    from safetensors.torch import load_file

    rank, world_size = C.get_rank(), C.get_world_size()
    module = _lora_model()
    model = _lora_wrap(module, stage)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=LR)
    _lora_train(model, opt, rank, world_size)
    module.save_pretrained(str(Path(directory) / "everyone"), is_main_process=rank == 0)
    model.engine.close()
    dist.barrier()
    return {"everyone": load_file(str(Path(directory) / "everyone" / "adapter_model.safetensors"))}


def test_save_pretrained_on_rank_0_alone_works_at_stage_0(tmp_path: Path) -> None:
    """At stage 0 the state dict reads the live parameters (no collective), as under DDP: rank 0
    saves alone, training goes on, and the file holds what every rank saving would have written."""
    alone = run_ranks(_save_on_rank_0_only, 2, 0, str(tmp_path), timeout=180)[0]["alone"]
    everyone = run_ranks(_save_on_every_rank_after_training, 2, 0, str(tmp_path), timeout=180)[0]["everyone"]
    assert sorted(alone) == sorted(everyone) and len(alone) == 8, (sorted(alone), sorted(everyone))
    assert all(torch.equal(alone[k], everyone[k]) for k in everyone)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_save_pretrained_on_rank_0_alone_is_named_at_stages_1_to_3(tmp_path: Path, stage: int) -> None:
    """At stages 1-3 the adapters' state dict gathers from every rank's shards: rank 0 saving
    alone while rank 1 trains on is ``RanksOutOfStep`` on every rank, naming full_state_dict."""
    with pytest.raises(RankFailure) as failure:
        run_ranks(_save_on_rank_0_only, 2, stage, str(tmp_path), timeout=120)
    for rank in range(2):
        match = re.search(r"Caught: (\{.*\})\s*$", failure.value.failures.get(rank, ""), re.MULTILINE)
        assert match, f"rank {rank} raised nothing named:\n{failure.value.failures.get(rank, '')[-3000:]}"
        caught = json.loads(match.group(1))
        assert caught["type"] == "RanksOutOfStep", (rank, caught)
        assert "rank 0 is in full_state_dict" in caught["message"], (rank, caught["message"])


# --------------------------------------------------------------------------- mixture of experts

EXPERTS = 4


def _moe_model(**config_options: Any) -> Any:
    """A tiny Mixtral (4 experts, top-2), fused 3-D expert weights as transformers builds them."""
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=EXPERTS,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=VOCAB - 1,
        pad_token_id=0,
        **config_options,
    )
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(config)


def _stage_3_options(policy: str) -> dict[str, Any]:
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    choices: dict[str, dict[str, Any]] = {
        "default": {},
        "layers": {"wrap_policy": [MixtralDecoderLayer]},
        "every_module": {"min_unit_params": 1},
    }
    return choices[policy]


def _record_routing(module: Any, into: list[list[set[int]]]) -> None:
    """Per forward, per layer: the experts this rank's tokens were routed to."""
    for index, layer in enumerate(module.model.layers):

        def hook(_: nn.Module, __: Any, output: Any, index: int = index) -> None:
            if index == 0:
                into.append([])
            into[-1].append(set(output[2].flatten().tolist()))  # the router's (logits, scores, indices)

        layer.mlp.gate.register_forward_hook(hook)


def _moe_train(model: Any, opt: Any, rank: int, world_size: int, slices: int = 1) -> None:
    """One sequence of 4 tokens per rank: 8 top-2 choices among 4 experts, so some expert gets
    none of a rank's tokens. The loss is the language-model loss only (the load-balancing loss
    of one rank's tokens is not a share of the global batch's). ``slices``: plain torch's loss
    is the mean of the losses of the ranks' slices of the batch (the same objective, every
    token's weight 1/8)."""
    for step in range(STEPS):
        batch = _rows(_tokens(step, 2, 4), rank, world_size)
        parts = [_rows(batch, index, slices) for index in range(slices)]
        torch.stack([model(input_ids=part, labels=part).loss for part in parts]).mean().backward()
        opt.step()
        opt.zero_grad()


def _moe(stage: int, policy: str, experts_implementation: str) -> dict[str, Any]:
    """[Note: MoE references] AdamW turns the last bits of a gradient into a full step for an
    element whose gradient is tiny (an expert's weights a token reaches with a small routing
    weight): plain torch on the concatenated batch in one forward and plain torch summing the
    ranks' halves differ by 2.5e-4 after three AdamW steps (and by 6e-8 with SGD), because the
    experts' products add the tokens of the batch in another grouping. So the AdamW run is
    compared with plain torch forwarding the ranks' halves of the concatenated batch and
    averaging their losses (tests/support/parity.py's ``chunked_reference``), and an SGD run with plain
    torch's one forward of the concatenated batch."""
    rank, world_size = C.get_rank(), C.get_world_size()
    options = {"experts_implementation": experts_implementation}
    wrap_options = _stage_3_options(policy) if stage == 3 else {}
    out: dict[str, Any] = {}
    for name, optimizer, slices in (("adamw", torch.optim.AdamW, world_size), ("sgd", torch.optim.SGD, 1)):
        plain = _moe_model(**options)
        _moe_train(plain, optimizer(plain.parameters(), lr=LR), 0, 1, slices)
        module = _moe_model(**options)
        routing: list[list[set[int]]] = []
        _record_routing(module, routing)
        model = shardpar.wrap(module, stage=stage, **wrap_options)
        _moe_train(model, shardpar.optimizer(model, optimizer, lr=LR), rank, world_size)
        out[name] = _worst(model.full_state_dict(), plain.state_dict())
        out[f"{name}_routing"] = [[sorted(s) for s in layers] for layers in routing]
        model.engine.close()
    return out


def _assert_moe_parity(results: list[dict[str, Any]], adamw_tolerance: float = TOLERANCE) -> None:
    for rank, out in enumerate(results):
        for name in ("adamw", "sgd"):
            error, differ = out[name]
            tolerance = adamw_tolerance if name == "adamw" else TOLERANCE
            assert differ == [] and error <= tolerance, (rank, name, error, differ)
    for name in ("adamw", "sgd"):  # the case this test is for: an expert unused on some ranks only
        routing = [out[f"{name}_routing"] for out in results]
        one_rank_only = [
            (step, layer, expert)
            for step in range(STEPS)
            for layer in range(2)
            for expert in range(EXPERTS)
            if (expert in routing[0][step][layer]) != (expert in routing[1][step][layer])
        ]
        assert one_rank_only, (name, routing)


@pytest.mark.parametrize(
    "stage,policy", [(0, "default"), (1, "default"), (2, "default"), (3, "default"), (3, "layers"), (3, "every_module")]
)
def test_moe_trains_like_plain_torch(stage: int, policy: str) -> None:
    """A tiny Mixtral, three AdamW steps and three SGD steps at world size 2, equal to plain torch
    on the concatenated batch (see [Note: MoE references]), while some expert gets tokens from
    one rank and none from the other. At stage 3 with the default policy, one unit per decoder
    layer, and every module with parameters its own unit (the router and the fused experts
    included)."""
    _assert_moe_parity(run_ranks(_moe, 2, stage, policy, "grouped_mm", timeout=240))


def test_moe_eager_experts_train_like_plain_torch_at_stage_3() -> None:
    """transformers' eager experts loop over the experts this rank's tokens hit only: the loop's
    length differs between ranks, inside one unit, and training still equals plain torch's.
    AdamW within 2 x TOLERANCE: on an Intel Xeon (2 cores) the AdamW run ends 1.05e-5 from the
    chunked reference, by the code before and after issue #44's stage-3 changes alike, where
    stages 0 and 2 end 0.0 from it and the SGD run 8.6e-8: the products read the gathered
    parameters, views of the flat buffer at other alignments than plain torch's tensors, so the
    CPU kernels may add in another order, and AdamW turns those last bits of the tiny expert
    gradients into whole steps ([Note: MoE references])."""
    _assert_moe_parity(run_ranks(_moe, 2, 3, "every_module", "eager", timeout=240), adamw_tolerance=2 * TOLERANCE)


def _moe_generate(policy: str) -> dict[str, Any]:
    rank = C.get_rank()
    plain = _moe_model().eval()
    module = _moe_model()
    model = shardpar.wrap(module, stage=3, timeout_s=5, **_stage_3_options(policy))
    model.eval()
    prompt = torch.tensor([[1 + rank, 2, 3]])
    options = {"max_new_tokens": 3 + 4 * rank, "do_sample": False, "pad_token_id": 0}  # different lengths
    with torch.no_grad():
        ours = module.generate(prompt, synced_gpus=True, **options)
        expected = plain.generate(prompt, **options)
    model.engine.close()
    return {"ours": ours.tolist(), "expected": expected.tolist()}


@pytest.mark.parametrize("policy", ["layers", "every_module"])
def test_moe_generate_of_different_lengths_with_synced_gpus_at_stage_3(policy: str) -> None:
    """Greedy ``generate(..., synced_gpus=True)`` with 3 new tokens on rank 0 and 7 on rank 1
    completes and gives each rank plain torch's tokens."""
    for rank, out in enumerate(run_ranks(_moe_generate, 2, policy, timeout=180)):
        assert out["ours"] == out["expected"], (rank, out)
        assert len(out["ours"][0]) == 3 + 3 + 4 * rank, (rank, out)


# --------------------------------------------------------------------------- torchtitan's loss


def _targets(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of the global batch (4 rows of 8), with a different
    number of ignored targets (-100, padding) per row: 8 valid in rows 0-1, 5 and 2 in rows 2-3,
    so the ranks hold 16 and 7 of the 23 tokens."""
    data = _tokens(step, 4, 9)
    inputs, targets = data[:, :-1], data[:, 1:].clone()
    targets[2, 5:] = -100
    targets[3, 2:] = -100
    return inputs, targets


def _global_token_mean(stage: int) -> dict[str, Any]:
    import torch.nn.functional as F

    rank, world_size = C.get_rank(), C.get_world_size()
    plain = _llama()
    reference_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    for step in range(STEPS):
        inputs, targets = _targets(step)
        logits = plain(input_ids=inputs).logits
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()  # the global mean
        reference_opt.step()
        reference_opt.zero_grad()
    units: dict[str, Any] = {"min_unit_params": 1} if stage == 3 else {}
    model = shardpar.wrap(_llama(), stage=stage, gradient_divide_factor=1.0, **units)
    opt = shardpar.optimizer(model, torch.optim.SGD, lr=0.5)
    for step in range(STEPS):
        inputs, targets = (_rows(t, rank, world_size) for t in _targets(step))
        tokens = (targets != -100).sum()
        dist.all_reduce(tokens)  # the global batch's token count
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum") / tokens
        loss.backward()
        opt.step()
        opt.zero_grad()
    error, differ = _worst(model.full_state_dict(), plain.state_dict())
    model.engine.close()
    return {"error": error, "differ": differ}


@pytest.mark.parametrize("stage", STAGES)
def test_summed_gradients_of_a_global_token_mean_equal_plain_torch(stage: int) -> None:
    """torchtitan's loss: each rank sums its token losses and divides by the global batch's token
    count, and ``gradient_divide_factor=1.0`` sums the ranks' gradients. With 16 tokens on rank 0
    and 7 on rank 1, three SGD steps (linear in the gradient, so a wrong scale shows) equal plain
    torch's per-token mean over the concatenated batch; the default mean of the ranks' own means
    would weight rank 1's tokens 16/7 times as much."""
    for rank, out in enumerate(run_ranks(_global_token_mean, 2, stage, timeout=180)):
        assert out["differ"] == [] and out["error"] <= TOLERANCE, (rank, out)
