"""Fine-tune a Hugging Face causal LM with the Hugging Face ``Trainer``, sharded by shardpar.

    torchrun --standalone --nproc_per_node 2 recipes/finetune_trainer.py --stage 2
    torchrun --standalone --nproc_per_node 2 recipes/finetune_trainer.py --stage 3 --model-dir path/to/hf_model
    torchrun --standalone --nproc_per_node 2 recipes/finetune_trainer.py --stage 1 --resume   # from output-dir

A Trainer script as any other: ``TrainingArguments``, a dataset of ``input_ids``/``labels``
rows, ``train()``, ``evaluate()``, ``save_model()``. The one line shardpar changes is marked
``# shardpar``: ``ShardparTrainer(..., shardpar_stage=N)`` where the script had ``Trainer(...)``.
Without ``--model-dir`` the model is the recipes' small Llama (random init, tied embeddings)
on the recipes' character corpus, so the script runs with nothing downloaded. Checkpoints go
to ``--output-dir/checkpoint-N/`` every ``--save-steps``; ``--resume`` continues from the
newest one, at any world size and stage.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `recipes` and `shardpar` without installing

import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from recipes.data import load_dataset
from recipes.hf_llama import hf_llama
from shardpar.integrations.transformers import ShardparTrainer  # shardpar


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--model-dir", help="a Hugging Face model directory (default: the recipes' small Llama)")
    parser.add_argument("--output-dir", default="trainer-out")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=8, help="rows per rank per step")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast, as TrainingArguments(bf16=True)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --output-dir")
    return parser.parse_args()


def blocks(ids: torch.Tensor, block_size: int) -> list[dict[str, torch.Tensor]]:
    """The token stream cut into rows of ``block_size``; the model shifts the labels itself."""
    rows = ids[: len(ids) // block_size * block_size].view(-1, block_size)
    return [{"input_ids": row, "labels": row.clone()} for row in rows]


def main() -> None:
    args = parse()
    data = load_dataset()
    if args.model_dir:
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        model = hf_llama(block_size=args.block_size).lm  # the LlamaForCausalLM inside the recipes' adapter
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        warmup_steps=args.steps // 10,
        lr_scheduler_type="cosine",
        weight_decay=0.1,
        max_grad_norm=1.0,
        bf16=args.bf16,
        logging_steps=10,
        save_strategy="steps",
        save_steps=args.save_steps,
        eval_strategy="steps",
        eval_steps=args.save_steps,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        use_cpu=not torch.cuda.is_available(),  # accelerate takes the torchrun ranks as CPU ranks only when told
    )
    trainer = ShardparTrainer(  # shardpar: was Trainer(
        model=model,
        args=training,
        train_dataset=blocks(data.train, args.block_size),
        eval_dataset=blocks(data.val, args.block_size)[:64],
        shardpar_stage=args.stage,  # shardpar
    )
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()
    trainer.save_model(f"{args.output_dir}/final")  # every rank: gathers, then rank 0 writes the HF layout
    if trainer.is_world_process_zero():
        print(
            f"stage {args.stage}: step {trainer.state.global_step}, eval loss {metrics['eval_loss']:.4f}, "
            f"model in {args.output_dir}/final"
        )


if __name__ == "__main__":
    main()
