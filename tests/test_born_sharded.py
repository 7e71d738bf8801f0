"""Models that start on the meta device, and Hugging Face weights loaded straight into shards.

- ``wrap`` of a meta-built model equals, bit for bit, the model built on CPU and then
  ``torch.manual_seed(s); model.apply(init)`` in one process, at stages 0-3 and world sizes
  1-3: a GPT with tied embeddings (each module's ``reset_parameters``, plus an init for its
  position table), Hugging Face Llama (tied) and GPT-2 with their ``_init_weights``.
- A parameter or buffer no init sets is named in a ValueError on every rank.
- The wrap-time peak of a meta-built stage-3 model stays within its shards plus one unit
  (measured as the process's peak resident memory, in a fresh process per rank).
- ``load_pretrained`` equals ``from_pretrained``: same parameters bit for bit and the same
  logits at every stage, from one file and from an index with shards; a checkpoint
  consolidated by ``tools/consolidate.py`` loads back exactly; bad directories are
  ``CheckpointError``\\ s naming the tensor or file, on every rank.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardpar
from shardpar.comm import collectives as C
from tests.support.harness import run_ranks, run_script
from tests.support.models import TinyTransformer

SEED = 7

# --------------------------------------------------------------------------- models


def _init_tiny(module: nn.Module) -> None:
    """TinyTransformer's init: its position table, and every layer's reset_parameters."""
    if isinstance(module, TinyTransformer):
        nn.init.normal_(module.pos, std=0.02)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


def _llama_config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )


def _gpt2_config() -> Any:
    import transformers

    return transformers.GPT2Config(
        vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0, eos_token_id=0
    )


def _build(kind: str) -> tuple[nn.Module, Callable[[nn.Module], Any] | None, dict[str, Any]]:
    """The model (on the current default device), its init function, its wrap options."""
    import transformers

    if kind == "gpt":
        model = TinyTransformer()
        return model, _init_tiny, {"wrap_policy": [type(model.blocks[0])]}
    if kind == "llama":
        model = transformers.LlamaForCausalLM(_llama_config())
        return model, model._init_weights, {"min_unit_params": 1}
    model = transformers.GPT2LMHeadModel(_gpt2_config())
    return model, model._init_weights, {"min_unit_params": 1}


def _reference(kind: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model, init, _ = _build(kind)
    torch.manual_seed(SEED)
    model.apply(init)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _meta_wraps(kind: str, stages: tuple[int, ...], extra: tuple = ()) -> list[dict[str, torch.Tensor]]:
    """Meta-built wraps at each of ``stages`` (``extra``: more wrap options), their full states."""
    out = []
    for stage in stages:
        with torch.device("meta"):
            module, init, options = _build(kind)
        torch.manual_seed(SEED + C.get_rank())  # every rank must get rank 0's values anyway
        model = shardpar.wrap(module, stage=stage, init_fn=init, **options, **dict(extra))
        out.append(model.full_state_dict())
        model.engine.close()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("kind", ["gpt", "llama", "gpt2"])
def test_a_meta_built_wrap_equals_one_process_init_at_every_stage(kind: str, world_size: int) -> None:
    expected = _reference(kind)
    for rank, states in enumerate(run_ranks(_meta_wraps, world_size, kind, (0, 1, 2, 3), timeout=120)):
        for stage, state in enumerate(states):
            assert state.keys() == expected.keys()
            differ = [k for k, v in expected.items() if not torch.equal(state[k], v)]
            assert not differ, f"{kind}, N={world_size}, stage {stage}, rank {rank}: {differ}"


def _meta_default_init() -> str:
    with torch.device("meta"):
        module = TinyTransformer()
    try:
        shardpar.wrap(module, stage=3, wrap_policy=[type(module.blocks[0])])
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_parameter_no_init_sets_is_named_on_every_rank() -> None:
    """TinyTransformer's position table is a bare Parameter of the root: no reset_parameters."""
    for rank, message in enumerate(run_ranks(_meta_default_init, 2, timeout=60)):
        assert "reset_parameters() (no init_fn was given) left parameter(s) pos without values" in message, (
            f"rank {rank}: {message}"
        )


class WithComputedBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("freqs", torch.arange(4.0), persistent=False)


def _meta_unset_buffer(stage: int) -> str:
    with torch.device("meta"):
        module = WithComputedBuffer()
    try:
        shardpar.wrap(module, stage=stage, min_unit_params=1)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("stage", [0, 3])
def test_a_buffer_no_init_sets_is_named(stage: int) -> None:
    for message in run_ranks(_meta_unset_buffer, 2, stage, timeout=60):
        assert "no initialisation set the buffer(s) freqs" in message, message


def test_init_fn_on_a_model_that_is_not_on_meta_is_refused() -> None:
    with pytest.raises(ValueError, match="init_fn initialises a model built on the meta device"):
        shardpar.wrap(nn.Linear(2, 2), stage=0, init_fn=lambda m: None)


# --------------------------------------------------------------------------- wrap-time peak

PEAK_SCRIPT = r"""
import json, sys, torch
from torch import nn
import shardpar

def rss_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])

class Big(nn.Module):
    def __init__(self, blocks, width):
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Linear(width, width) for _ in range(blocks)))
    def forward(self, x):
        return self.blocks(x)

blocks, width, meta = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "meta"
torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
with torch.device("meta"):  # warm-up: the first wrap loads code (about 75 MiB), whatever the model
    warm = Big(1, 8)
shardpar.wrap(warm, stage=3, wrap_policy=[nn.Linear]).engine.close()
before = rss_kib("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
if meta:
    with torch.device("meta"):
        module = Big(blocks, width)
else:
    module = Big(blocks, width)
model = shardpar.wrap(module, stage=3, wrap_policy=[nn.Linear])
peak = rss_kib("VmHWM:")
rank = torch.distributed.get_rank()
with open(f"{sys.argv[4]}-{rank}.json", "w") as out:
    stats = model.memory_stats()
    json.dump({"rank": rank, "peak_increase": (peak - before) * 1024, "params": stats["params"],
               "state": stats["total"]}, out)
torch.distributed.destroy_process_group()
"""


def test_the_wrap_time_peak_of_a_meta_model_is_its_shards_plus_one_unit(tmp_path: Path) -> None:
    """8 units of 16 MiB (a 2048 x 2048 fp32 Linear each), 2 ranks. Born sharded, a rank's
    peak grows by its final model state (64 MiB of parameter shards and 64 MiB of gradient
    shards) plus one unit being initialised; built in full first it would also hold the whole
    128 MiB model."""
    script = tmp_path / "peak.py"
    script.write_text(PEAK_SCRIPT)
    unit = 2048 * 2048 * 4 + 2048 * 4
    results = {}
    for how in ("meta", "full"):
        # Large blocks always mmapped, so a freed one leaves the resident set at once (glibc's
        # adaptive threshold would otherwise keep freed 16 MiB blocks in the heap).
        run = run_script(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node",
                "2",
                str(script),
                "8",
                "2048",
                how,
                str(tmp_path / how),
            ],
            timeout=120,
            env={"MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": "1"},
        )
        assert run.returncode == 0, run.stderr[-3000:]
        results[how] = [json.loads((tmp_path / f"{how}-{rank}.json").read_text()) for rank in range(2)]
    slack = 8 * 2**20  # the allocator, bookkeeping
    with torch.device("meta"):
        shape = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(8)))
    planned = shardpar.estimate_memory(shape, 2, 3, wrap_policy=[nn.Linear])
    assert planned.startup_meta == 8 * unit + unit  # the planner's start-up figure is this bound
    for rank in results["meta"]:
        assert rank["params"] == 4 * unit and rank["state"] == 8 * unit, rank
        assert rank["peak_increase"] <= rank["state"] + unit + slack, (
            f"rank {rank['rank']}: peak grew by {rank['peak_increase'] / 2**20:.1f} MiB"
        )
    for rank in results["full"]:
        assert rank["peak_increase"] >= 8 * unit, "the comparison run did not hold the full model"


# --------------------------------------------------------------------------- load_pretrained


def _save_pretrained(kind: str, directory: Path, **options: Any) -> None:
    torch.manual_seed(0)
    model, _, _ = _build(kind)
    model.save_pretrained(directory, **options)


def _hf_reference(kind: str, directory: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        logits = model(input_ids=_tokens()).logits
    return {k: v.clone() for k, v in model.state_dict().items()}, logits


def _tokens() -> torch.Tensor:
    return torch.arange(12).view(2, 6) % 60


def _meta_wrap_and_load(kind: str, stage: int, directory: str) -> dict[str, Any]:
    with torch.device("meta"):
        module, init, options = _build(kind)
    torch.manual_seed(SEED)
    model = shardpar.wrap(module, stage=stage, init_fn=init, **options)
    result = shardpar.load_pretrained(model, directory)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=_tokens()).logits
    return {
        "missing": result.missing_keys,
        "unexpected": result.unexpected_keys,
        "state": model.full_state_dict(),
        "logits": logits,
    }


@pytest.mark.parametrize("sharded_files", [False, True])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_load_pretrained_equals_from_pretrained_at_every_stage(kind: str, sharded_files: bool, tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    _save_pretrained(kind, directory, **({"max_shard_size": "20KB"} if sharded_files else {}))
    assert (directory / "model.safetensors.index.json").exists() == sharded_files
    expected, expected_logits = _hf_reference(kind, directory)
    for stage in (0, 1, 2, 3):
        for rank, got in enumerate(run_ranks(_meta_wrap_and_load, 2, kind, stage, str(directory), timeout=120)):
            what = f"{kind}, stage {stage}, rank {rank}"
            assert got["missing"] == [] and got["unexpected"] == [], what
            differ = [k for k, v in expected.items() if not torch.equal(got["state"][k], v)]
            assert not differ, f"{what}: {differ}"
            torch.testing.assert_close(got["logits"], expected_logits, rtol=0, atol=1e-5, msg=what)


def _train_save(directory: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module, _, options = _build("llama")
    model = shardpar.wrap(module, stage=3, **options)
    opt = shardpar.optimizer(model, torch.optim.AdamW, lr=1e-2)
    model(input_ids=_tokens(), labels=_tokens()).loss.backward()
    opt.step()
    shardpar.save_checkpoint(directory, model, opt)
    return model.full_state_dict()


def _load_consolidated(stage: int, directory: str) -> dict[str, torch.Tensor]:
    return _meta_wrap_and_load("llama", stage, directory)["state"]


def test_consolidate_then_load_pretrained_round_trips(tmp_path: Path) -> None:
    from shardpar.checkpoint.offline import consolidate

    trained = run_ranks(_train_save, 2, str(tmp_path / "ckpt"), timeout=120)[0]
    consolidate(tmp_path / "ckpt", tmp_path / "hf", max_shard_size="30KB")
    for stage, world_size in ((1, 3), (3, 1)):
        for rank, state in enumerate(
            run_ranks(_load_consolidated, world_size, stage, str(tmp_path / "hf"), timeout=120)
        ):
            differ = [k for k, v in trained.items() if not torch.equal(state[k], v)]
            assert not differ, f"stage {stage}, N={world_size}, rank {rank}: {differ}"


def _load_bad(directory: str, strict: bool) -> str:
    with torch.device("meta"):
        module, init, options = _build("llama")
    model = shardpar.wrap(module, stage=3, init_fn=init, **options)
    try:
        result = shardpar.load_pretrained(model, directory, strict=strict)
    except shardpar.CheckpointError as error:
        return f"CheckpointError: {error}"
    return f"missing={result.missing_keys} unexpected={result.unexpected_keys}"


def _break(directory: Path, how: str) -> None:
    from safetensors.torch import load_file, save_file

    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    if how == "shape":
        name = "model.layers.0.mlp.up_proj.weight"
        file = directory / index["weight_map"][name]
        tensors = load_file(file)
        tensors[name] = torch.zeros(3, 3)
        save_file(tensors, file, metadata={"format": "pt"})
    elif how == "missing file":
        (directory / index["weight_map"]["model.norm.weight"]).unlink()
    elif how == "traversal":
        index["weight_map"]["model.norm.weight"] = "../outside.safetensors"
        index_path.write_text(json.dumps(index))
    elif how == "missing key":
        name = "model.layers.1.post_attention_layernorm.weight"
        file = directory / index["weight_map"][name]
        tensors = load_file(file)
        del tensors[name]
        save_file(tensors, file, metadata={"format": "pt"})
        del index["weight_map"][name]
        index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "how, expected",
    [
        (
            "shape",
            r"model\.layers\.0\.mlp\.up_proj\.weight' has shape \[3, 3\] in .*model-000\d\d-of-000\d\d\.safetensors, "
            r"the model expects \[64, 32\]",
        ),
        ("missing file", r"CheckpointError: .*model-000\d\d-of-000\d\d\.safetensors"),
        ("traversal", r"CheckpointError: .*\.\./outside\.safetensors"),
        ("missing key", r"CheckpointError: .*missing keys \['model\.layers\.1\.post_attention_layernorm\.weight'\]"),
    ],
)
def test_a_bad_hugging_face_directory_is_named_on_every_rank(how: str, expected: str, tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    _save_pretrained("llama", directory, max_shard_size="20KB")
    _break(directory, how)
    for rank, message in enumerate(run_ranks(_load_bad, 2, str(directory), True, timeout=120)):
        assert message.startswith("CheckpointError") and __import__("re").search(expected, message), (
            f"rank {rank}: {message}"
        )


def test_missing_keys_are_returned_without_strict(tmp_path: Path) -> None:
    directory = tmp_path / "hf"
    _save_pretrained("llama", directory, max_shard_size="20KB")
    _break(directory, "missing key")
    for message in run_ranks(_load_bad, 2, str(directory), False, timeout=120):
        assert message == "missing=['model.layers.1.post_attention_layernorm.weight'] unexpected=[]", message
