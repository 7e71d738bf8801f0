"""Per-rank memory at start-up, for the three ways to start a model, measured.

    python tools/startup_memory.py                 # 2 ranks, a Llama of about 34M parameters
    python tools/startup_memory.py --layers 8 --hidden 768 --world-size 2 --out /tmp/startup.md

Writes a Hugging Face directory (``save_pretrained`` of a randomly initialised
``LlamaForCausalLM`` built from a config; nothing is downloaded), then for each way and stage
launches a fresh ``torchrun`` job whose ranks each report the growth of their peak resident
memory (VmHWM) while the model starts, from after imports and a warm-up wrap to the end of
``wrap`` (and ``load_pretrained``):

- *built*: the model built on CPU by its constructor, then ``shardpar.wrap``;
- *meta + init*: built under ``torch.device("meta")``, ``wrap(..., init_fn=model._init_weights)``;
- *meta + pretrained*: the same, then ``shardpar.load_pretrained(model, DIR)``.

Each row also gives the model state a rank holds afterwards (``memory_stats()``: parameters
and gradients; the optimizer state comes at the first step) and the planner's start-up
figures (``estimate_memory(...).startup_built`` / ``.startup_meta``). Large blocks are always
mmapped in the jobs (``MALLOC_MMAP_THRESHOLD_``), so freed memory leaves the resident set and
the peak is what was live at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

import torch  # noqa: E402

WAYS = ("built", "meta + init", "meta + pretrained")
MIB = 2**20


def _config(args: argparse.Namespace):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def worker(way: str, stage: int, directory: str, out: str) -> None:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import shardpar

    torch.distributed.init_process_group("gloo")
    config = transformers.AutoConfig.from_pretrained(directory)
    with torch.device("meta"):  # warm-up: the first wrap loads code, whatever the model
        warm = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
            )
        )
    shardpar.wrap(warm, stage=stage, init_fn=warm._init_weights).engine.close()
    del warm
    torch.manual_seed(0)
    before = _rss_kib("VmRSS:")
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # the peak (VmHWM) restarts from the current resident set
    options = {"wrap_policy": [LlamaDecoderLayer]} if stage == 3 else {}
    if way == "built":
        module = transformers.LlamaForCausalLM(config)
        model = shardpar.wrap(module, stage=stage, **options)
    else:
        with torch.device("meta"):
            module = transformers.LlamaForCausalLM(config)
        model = shardpar.wrap(module, stage=stage, init_fn=module._init_weights, **options)
        if way == "meta + pretrained":
            shardpar.load_pretrained(model, directory)
    peak = _rss_kib("VmHWM:")
    stats = model.memory_stats()
    rank = torch.distributed.get_rank()
    Path(f"{out}-{rank}.json").write_text(
        json.dumps({"peak_increase": (peak - before) * 1024, "state": stats["params"] + stats["grads"]})
    )
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stages", default="0,3")
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument("--worker", nargs=4, metavar=("WAY", "STAGE", "DIR", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        way, stage, directory, out = args.worker
        worker(way, int(stage), directory, out)
        return

    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import shardpar

    work = Path(tempfile.mkdtemp(prefix="startup-memory-"))
    config = _config(args)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(work / "hf")
    with torch.device("meta"):
        shape = transformers.LlamaForCausalLM(config)
    count = sum(p.numel() for p in shape.parameters())
    lines = [
        f"Llama, {args.layers} layers, hidden {args.hidden}, vocab {args.vocab} (tied): {count / 1e6:.1f}M parameters, "
        f"{count * 4 / MIB:.0f} MiB in fp32; {args.world_size} ranks, gloo, CPU. Command: "
        f"`python tools/startup_memory.py --layers {args.layers} --hidden {args.hidden} --vocab {args.vocab} "
        f"--world-size {args.world_size}`.",
        "",
        "| way | stage | peak growth during start-up, MiB (max over ranks) | model state after, MiB (params + grads) "
        "| planner's start-up estimate, MiB |",
        "|---|---:|---:|---:|---:|",
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576", "OMP_NUM_THREADS": "1"}
    for stage in (int(s) for s in args.stages.split(",")):
        options = {"wrap_policy": [LlamaDecoderLayer]} if stage == 3 else {}
        estimate = shardpar.estimate_memory(shape, args.world_size, stage, **options)
        for way in WAYS:
            out = work / f"{way.replace(' ', '_').replace('+', '')}-{stage}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node",
                    str(args.world_size),
                    __file__,
                    "--worker",
                    way,
                    str(stage),
                    str(work / "hf"),
                    str(out),
                ],
                check=True,
                env=env,
                stdout=subprocess.DEVNULL,
            )
            ranks = [json.loads(Path(f"{out}-{r}.json").read_text()) for r in range(args.world_size)]
            planned = estimate.startup_built if way == "built" else estimate.startup_meta
            lines.append(
                f"| {way} | {stage} | {max(r['peak_increase'] for r in ranks) / MIB:.0f} | "
                f"{max(r['state'] for r in ranks) / MIB:.0f} | {planned / MIB:.0f} |"
            )
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
