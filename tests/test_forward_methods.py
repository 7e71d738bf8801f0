"""Methods other than ``forward`` ([Note: forward methods] in shardpar/facade/forward_methods.py),
against plain torch (one process, the concatenated batch), stages 0-3:

- a method of the root that calls a unit's submodules (a block's norm and linears, never the
  block's own forward) trains like plain torch with no declaration: calling any module of a
  unit gathers it. Before: at stage 3 it raised (the block's parameters were sharded),
  although the error said values exist "while a forward ... of a module of that unit runs";
- a method that reads its module's parameters directly (the root's position table, a block's
  gate) trains and greedy-decodes like plain torch once declared with
  ``shardpar.register_forward_method`` (the root's on the ``ShardedModule``, the blocks' on
  the submodules, one of them before ``wrap``); undeclared, at stage 3, the read raises an
  error naming the parameter and ``register_forward_method``;
- FSDP2's documented use, ``generate`` of a Hugging Face model declared (it calls the model's
  forward per token inside), gives the plain model's tokens at stage 3;
- declaring: errors for a bad module or name, idempotent, harmless on a module shardpar does
  not manage, and ``copy.deepcopy`` / ``torch.save`` of the module still give plain copies
  (with the class's own methods).
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from shardpar.facade.forward_methods import ForwardMethod
from tests.support.harness import run_ranks

STAGES = (0, 1, 2, 3)
STEPS = 3
VOCAB, DIM, SEQ, BATCH = 32, 16, 6, 6  # the batch divides by 2 and 3
MIN_UNIT_PARAMS = 1000  # a block (1,120 parameters) is a unit; the embedding, head and norms go with the root
TOL = 1e-5


class GatedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, DIM))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sigmoid(self.gate) * self.mlp(x)

    def refine(self, x: torch.Tensor) -> torch.Tensor:
        """Another entry point reading the block's own parameter first (registered)."""
        scale = torch.sigmoid(self.gate)
        return x + scale * self.mlp(x)


class GenLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1)
        self.blocks = nn.ModuleList(GatedBlock() for _ in range(3))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def features(self, tokens: torch.Tensor) -> torch.Tensor:
        """Calls modules only, a block's submodules included: needs no declaration."""
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block.fc2(F.gelu(block.fc1(block.ln(h))))
        return self.head(self.norm(h))

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Reads the root's own parameter, then the blocks' ``refine`` (declared)."""
        h = self.pos[: tokens.shape[1]] + self.embed(tokens)
        for block in self.blocks:
            h = block.refine(h)
        return self.head(self.norm(h))

    def greedy(self, prompt: torch.Tensor, new_tokens: int, method: str) -> torch.Tensor:
        tokens = prompt
        for _ in range(new_tokens):
            tokens = torch.cat([tokens, getattr(self, method)(tokens)[:, -1:].argmax(-1)], dim=1)
        return tokens


def _build() -> GenLM:
    torch.manual_seed(0)
    return GenLM()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
    )


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _prompt() -> torch.Tensor:
    return torch.tensor([[1, 2], [3, 4]])


OPTIMIZERS = {
    "features": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "decode": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
}
"""SGD: some elements' gradients here are ~1e-8, whose rounding Adam would divide by them
(tests/test_entry_modules.py trains with AdamW)."""


def _reference(method: str) -> dict[str, Any]:
    model = _build()
    optimizer_class, options = OPTIMIZERS[method]
    opt = optimizer_class(model.parameters(), **options)
    states = []
    for step in range(STEPS):
        x, y = _batch(step)
        _loss(getattr(model, method)(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    with torch.no_grad():
        tokens = model.greedy(_prompt(), 3, method)
    return {"states": states, "tokens": tokens}


def _train(method: str, stage: int, declare: bool) -> dict[str, Any]:
    rank, world_size = C.get_rank(), C.get_world_size()
    module = _build()
    if declare:
        shardpar.register_forward_method(module.blocks[0], "refine")  # before wrap: looked up at each call
    model = shardpar.wrap(module, stage=stage, min_unit_params=MIN_UNIT_PARAMS)
    if declare:
        shardpar.register_forward_method(model, "decode")  # the ShardedModule: its module's method
        for block in module.blocks[1:]:
            shardpar.register_forward_method(block, "refine")
    units = [unit.name for unit in model.engine.storage.units] if stage == 3 else []
    optimizer_class, options = OPTIMIZERS[method]
    opt = shardpar.optimizer(model, optimizer_class, **options)
    share = BATCH // world_size
    states = []
    try:
        for step in range(STEPS):
            x, y = _batch(step)
            rows = slice(rank * share, (rank + 1) * share)
            _loss(getattr(model, method)(x[rows]), y[rows]).backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            states.append(model.full_state_dict())
        with torch.no_grad():
            tokens = module.greedy(_prompt(), 3, method)
    except RuntimeError as error:
        return {"error": str(error)}
    finally:
        model.engine.close()
    return {"states": states, "tokens": tokens, "units": units}


def _all(world_size_unused: int = 0) -> dict[tuple, Any]:
    out = {}
    for stage in STAGES:
        out[("features", stage)] = _train("features", stage, declare=False)
        out[("decode", stage)] = _train("decode", stage, declare=True)
    out[("decode, undeclared", 3)] = _train("decode", 3, declare=False)
    return out


_cache: dict[int, list[dict]] = {}


def _results(world_size: int) -> list[dict]:
    if world_size not in _cache:
        _cache[world_size] = run_ranks(_all, world_size, timeout=300)
    return _cache[world_size]


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12))


def _assert_like_plain_torch(result: dict[str, Any], expected: dict[str, Any], what: str) -> None:
    assert "error" not in result, f"{what}: {result.get('error')}"
    for step, (state, reference) in enumerate(zip(result["states"], expected["states"])):
        for name, value in reference.items():
            error = _rel_error(state[name], value)
            assert error <= TOL, f"{what}, step {step}: {name} off by {error:.2e}"
    assert torch.equal(result["tokens"], expected["tokens"]), what


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_a_method_calling_a_units_submodules_trains_like_plain_torch(stage: int, world_size: int) -> None:
    expected = _reference("features")
    for rank, results in enumerate(_results(world_size)):
        result = results[("features", stage)]
        if stage == 3:
            assert "blocks.0" in result["units"] and "<root>" in result["units"], result["units"]
        _assert_like_plain_torch(result, expected, f"stage {stage}, rank {rank}")


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("stage", STAGES)
def test_declared_methods_train_and_decode_like_plain_torch(stage: int, world_size: int) -> None:
    expected = _reference("decode")
    for rank, results in enumerate(_results(world_size)):
        _assert_like_plain_torch(results[("decode", stage)], expected, f"stage {stage}, rank {rank}")


def test_an_undeclared_method_reading_parameters_names_register_forward_method() -> None:
    for rank, results in enumerate(_results(2)):
        error = results[("decode, undeclared", 3)].get("error", "no error")
        assert "parameter 'pos' of stage-3 unit '<root>'" in error, (rank, error)
        assert "shardpar.register_forward_method(module, 'method_name')" in error, (rank, error)


# --------------------------------------------------------------------------- declaring


def test_declaring_checks_its_arguments_and_is_idempotent() -> None:
    module = _build()
    with pytest.raises(TypeError, match="module must be an nn.Module, got str"):
        shardpar.register_forward_method("model", "decode")
    with pytest.raises(ValueError, match="GenLM has no method 'generate'"):
        shardpar.register_forward_method(module, "generate")
    with pytest.raises(ValueError, match="GenLM has no method 'blocks'"):
        shardpar.register_forward_method(module, "blocks")
    with pytest.raises(ValueError, match="'forward' runs shardpar's hooks already"):
        shardpar.register_forward_method(module, "forward")
    shardpar.register_forward_method(module, "decode")
    declared = module.decode
    shardpar.register_forward_method(module, "decode")
    assert module.decode is declared
    # On a module no engine manages (as FSDP2's, so one script serves both): the plain method.
    x, _ = _batch(0)
    assert torch.equal(module.decode(x), GenLM.decode(module, x))


def test_copies_of_a_module_with_declared_methods_are_plain() -> None:
    module = _build()
    model = shardpar.wrap(module, stage=3, min_unit_params=MIN_UNIT_PARAMS)
    shardpar.register_forward_method(model, "decode")
    for block in module.blocks:
        shardpar.register_forward_method(block, "refine")
    x, _ = _batch(0)
    with torch.no_grad():
        expected = module.decode(x)
        copied = copy.deepcopy(module)
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        for plain in (copied, loaded):  # plain modules: the class's methods
            assert "decode" not in plain.__dict__ and "refine" not in plain.blocks[0].__dict__
            assert torch.equal(plain.decode(x), expected)
    assert isinstance(module.__dict__["decode"], ForwardMethod)  # the wrapped module keeps them
    model.engine.close()


# --------------------------------------------------------------------------- FSDP2's own example


def _hf_generate_declared() -> dict[str, Any]:
    """FSDP2's documented use, ``register_fsdp_forward_method(model, "generate")`` on a Hugging
    Face model, ported as is: ``generate`` calls the model's forward once per token inside."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=63
    )
    torch.manual_seed(0)
    plain = transformers.GPT2LMHeadModel(config).eval()
    torch.manual_seed(0)
    model = shardpar.wrap(transformers.GPT2LMHeadModel(config), stage=3, min_unit_params=1, timeout_s=10)
    shardpar.register_forward_method(model, "generate")
    model.eval()
    prompt = torch.tensor([[1 + C.get_rank(), 2, 3]])
    options = dict(max_new_tokens=3 + 2 * C.get_rank(), do_sample=False, pad_token_id=0)  # ranks stop apart
    with torch.no_grad():
        ours = model.generate(prompt, synced_gpus=True, **options)
        expected = plain.generate(prompt, **options)
    model.engine.close()
    return {"ours": ours.tolist(), "expected": expected.tolist()}


def test_hugging_face_generate_declared_as_under_fsdp2_gives_the_plain_tokens() -> None:
    pytest.importorskip("transformers")
    for rank, result in enumerate(run_ranks(_hf_generate_declared, 2, timeout=120)):
        assert result["ours"] == result["expected"], rank
