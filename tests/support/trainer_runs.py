"""What the ranks of ``tests/test_transformers_trainer.py`` run: a tiny Llama built from a
config (nothing downloaded), an in-memory dataset, and runs of the Hugging Face ``Trainer``
(the DDP oracle: accelerate wraps the model in torch's DDP) or of ``ShardparTrainer`` at a stage,
with the same arguments. Imported on the ranks only: importing transformers takes seconds.

Data: 32 rows of 16 tokens, read in order (``train_sampling_strategy="sequential"``);
accelerate deals batches of ``per_device_train_batch_size`` rows round-robin, so at world size
2 with 4 rows per device step ``s`` trains on global rows 8s..8s+7, what one process with 8
rows per device trains on at world size 1.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Trainer, TrainingArguments

from shardpar.integrations.transformers import ShardparTrainer

ROWS, TOKENS, VOCAB, BATCH = 32, 16, 64, 4
UNIT_PARAMS = 1000
"""``min_unit_params`` at stage 3: each decoder layer and the embedding is a unit of its own."""


def config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TOKENS,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )


def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(config())


def rows(count: int = ROWS, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(3, VOCAB, (count, TOKENS), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the vocabulary ``t0 .. t63`` built in memory (TRL's
    SFTTrainer wants one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(VOCAB)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, pad_token="t0", bos_token="t1", eos_token="t2", unk_token="t0"
    )


def arguments(output_dir: str, **overrides: Any) -> TrainingArguments:
    values: dict[str, Any] = dict(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        num_train_epochs=2,
        learning_rate=1e-2,
        weight_decay=0.1,
        logging_steps=1,
        max_grad_norm=0.3,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        use_cpu=True,
        seed=7,
    )
    values.update(overrides)
    return TrainingArguments(**values)


def trainer(
    name: str,
    output_dir: str,
    *,
    cls: type | None = None,
    trainer_options: dict[str, Any] | None = None,
    **overrides: Any,
) -> Trainer:
    """``name``: "ddp" (the plain Trainer) or "stageK" (ShardparTrainer at stage K)."""
    options = dict(trainer_options or {})
    options.setdefault("model", model())
    options.setdefault("train_dataset", rows())
    options.setdefault("eval_dataset", rows(8, seed=2))
    if name == "ddp":
        return (cls or Trainer)(args=arguments(output_dir, **overrides), **options)
    stage = int(name.removeprefix("stage"))
    wrap_options = {"min_unit_params": UNIT_PARAMS} if stage == 3 else {}
    return (cls or ShardparTrainer)(
        args=arguments(output_dir, **overrides), shardpar_stage=stage, shardpar_options=wrap_options, **options
    )


def params(run: Trainer) -> dict[str, torch.Tensor]:
    """The model's full parameters (a collective under shardpar at stages 1-3: every rank)."""
    return {name: value.detach().clone() for name, value in run.model.state_dict().items()}


def synchronising_backwards(model: Any) -> int | None:
    """How many backward passes reduced gradients (one all-reduce of the used-parameter flags
    each; passes under ``no_sync`` reduce nothing); None for a model shardpar did not wrap."""
    stats = model.comm_stats() if hasattr(model, "comm_stats") else None
    return None if stats is None else stats.get("used_flags", {}).get("calls", 0)


def summary(run: Trainer) -> dict[str, Any]:
    history = run.state.log_history
    return {
        "losses": [entry["loss"] for entry in history if "loss" in entry],
        "steps": [entry["step"] for entry in history if "loss" in entry],
        "grad_norms": [float(entry["grad_norm"]) for entry in history if "grad_norm" in entry],
        "lrs": [entry["learning_rate"] for entry in history if "learning_rate" in entry],
        "global_step": run.state.global_step,
        "params": params(run),
        "wrapped": type(run.model_wrapped).__name__,
        "synchronising_backwards": synchronising_backwards(run.model_wrapped),
        "model": type(run.model).__name__,
    }


def fit(
    name: str, output_dir: str, *, evaluate: bool = True, resume_from: str | None = None, **overrides: Any
) -> dict[str, Any]:
    run = trainer(name, output_dir, **overrides)
    run.train(resume_from_checkpoint=resume_from)
    result = summary(run)
    if evaluate:
        result["eval_loss"] = run.evaluate()["eval_loss"]
        prediction = run.predict(rows(8, seed=3))
        result["test_loss"] = prediction.metrics["test_loss"]
        result["logits"] = torch.as_tensor(prediction.predictions)
    return result


def forward_dtypes(run: Trainer) -> list[str]:
    """The dtypes the decoder's first projection computes in, seen by a hook on one forward."""
    seen: list[str] = []
    layer = run.model.model.layers[0].self_attn.q_proj
    handle = layer.register_forward_hook(lambda module, args, output: seen.append(str(output.dtype)))
    try:
        run.evaluate()
    finally:
        handle.remove()
    return sorted(set(seen))


def fit_bf16(name: str, output_dir: str, **overrides: Any) -> dict[str, Any]:
    run = trainer(name, output_dir, bf16=True, **overrides)
    run.train()
    result = summary(run)
    result["eval_loss"] = run.evaluate()["eval_loss"]
    result["compute_dtypes"] = forward_dtypes(run)
    return result


def save_and_reload(name: str, output_dir: str) -> dict[str, Any]:
    """Train, ``save_model`` on every rank, and read the directory back with
    ``from_pretrained`` (on every rank, after the save)."""
    run = trainer(name, output_dir, num_train_epochs=1)
    run.train()
    saved = os.path.join(output_dir, "saved")
    run.save_model(saved)
    trained = params(run)
    torch.distributed.barrier()
    reloaded = LlamaForCausalLM.from_pretrained(saved)
    return {
        "trained": trained,
        "reloaded": {k: v.detach().clone() for k, v in reloaded.state_dict().items()},
        "files": sorted(os.listdir(saved)),
        "tied": reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr(),
    }


def error_of(run: Any, *args: Any, **kwargs: Any) -> str:
    """``type: message`` of what ``run(*args, **kwargs)`` raised (on this rank)."""
    try:
        run(*args, **kwargs)
    except Exception as error:  # the tests read the message
        return f"{type(error).__name__}: {error}"
    return "nothing raised"


def sft(name: str, output_dir: str, max_grad_norm: float = 0.3) -> dict[str, Any]:
    """TRL's ``SFTTrainer`` (the oracle, "ddp") or ``ShardparTrainer`` mixed into it, on text
    it tokenises itself with the in-memory tokenizer.

    ``weight_decay=0.1``, as :func:`arguments` gives the plain Trainer: with SFTConfig's 0.0
    this run is ill-conditioned under clipping. A change of the clip coefficient in its 7th
    digit (the last bit of the fp32 norm, e.g. ``max_grad_norm=0.3000001`` for DDP itself)
    moves one weight by 4% after 4 steps; with weight decay the same change stays at 1e-6.
    shardpar's norm at stages 1-3 can differ from torch's in that last bit (its per-piece sum
    is fp64: [Note: a norm per piece] in shardpar/core/clipping.py), so only a run that does
    not amplify it can be held to 1e-5."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    class ShardparSFTTrainer(ShardparTrainer, SFTTrainer):
        pass

    ids = torch.randint(3, VOCAB, (ROWS, TOKENS - 2), generator=torch.Generator().manual_seed(4))
    text = Dataset.from_dict({"text": [" ".join(f"t{i}" for i in row.tolist()) for row in ids]})
    args = SFTConfig(
        output_dir=output_dir,
        per_device_train_batch_size=BATCH,
        num_train_epochs=1,
        learning_rate=1e-2,
        weight_decay=0.1,
        logging_steps=1,
        max_grad_norm=max_grad_norm,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        use_cpu=True,
        seed=7,
        max_length=TOKENS,
        packing=False,
        dataset_num_proc=None,
    )
    options: dict[str, Any] = dict(model=model(), args=args, train_dataset=text, processing_class=tokenizer())
    if name == "ddp":
        run = SFTTrainer(**options)
    else:
        run = ShardparSFTTrainer(shardpar_stage=int(name.removeprefix("stage")), **options)
    run.train()
    return summary(run)


def refusals(output_dir: str) -> dict[str, str]:
    """The naive patterns and bad options, refused by name (each on every rank)."""
    import shardpar

    refused = {
        "sharded_model": error_of(trainer, "stage2", output_dir, trainer_options={"model": shardpar.wrap(model())}),
        "unknown_option": error_of(
            ShardparTrainer, model=model(), args=arguments(output_dir), shardpar_options={"bucket_cap": 1}
        ),
        "bad_stage": error_of(ShardparTrainer, model=model(), args=arguments(output_dir), shardpar_stage=4),
    }
    run = trainer("stage0", output_dir)
    refused["ddp_around"] = error_of(run.accelerator.prepare_model, run.sharded_model)  # accelerate's DDP around it
    plain = trainer("ddp", output_dir, trainer_options={"model": shardpar.wrap(model())})
    refused["plain_trainer"] = error_of(plain.train)  # the plain Trainer given a ShardedModule: the same DDP
    return refused
