"""Sharded shardpar checkpoint -> Hugging Face safetensors layout, without a process group.

    python tools/consolidate.py CKPT_DIR OUT_DIR [--max-shard-size 5GB] [--dtype bf16]

Writes OUT_DIR/model.safetensors, or model-0000k-of-0000n.safetensors plus
model.safetensors.index.json, one bounded chunk at a time (never the whole model in memory).
"""

from __future__ import annotations

from _common import DTYPES, Parser, run


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt_dir", help="checkpoint directory written by shardpar.save_checkpoint")
    parser.add_argument("out_dir", help="output directory (created if missing)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file, decimal units (default 5GB)")
    parser.add_argument("--dtype", default=None, choices=DTYPES, help="cast floating-point tensors")
    args = parser.parse_args()

    from shardpar.checkpoint.offline import consolidate

    files = consolidate(args.ckpt_dir, args.out_dir, args.max_shard_size, args.dtype)
    print(f"wrote {len(files)} file(s) to {args.out_dir}: {', '.join(files)}")


if __name__ == "__main__":
    run(main)
