"""Summarise a shardpar checkpoint; with --verify, check every checksum, shape and piece.

python tools/inspect_ckpt.py CKPT_DIR [--verify]
"""

from __future__ import annotations

from _common import Parser, run


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt_dir", help="checkpoint directory written by shardpar.save_checkpoint")
    parser.add_argument("--verify", action="store_true", help="read every file: sha256, tensor shapes, coverage")
    args = parser.parse_args()

    from shardpar.checkpoint.format import read_manifest
    from shardpar.checkpoint.offline import format_table, summary, verify

    manifest = read_manifest(args.ckpt_dir)  # validates structure and piece coverage
    print(format_table(summary(manifest)))
    if args.verify:
        verify(manifest)
        print(f"verify: OK ({len(manifest.files)} files: sha256, tensor shapes, piece coverage)")


if __name__ == "__main__":
    run(main)
