"""Rewrite a shardpar checkpoint for another world size (offline, no process group).

    python tools/reshard.py CKPT_DIR OUT_DIR --world-size M [--stage S]

Any checkpoint loads at any world size already; resharding makes each of M ranks read
mostly one file of about 1/M of the checkpoint.
"""

from __future__ import annotations

from _common import Parser, run


def main() -> None:
    parser = Parser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt_dir", help="checkpoint directory written by shardpar.save_checkpoint")
    parser.add_argument("out_dir", help="new checkpoint directory (replaced atomically if it is a checkpoint)")
    parser.add_argument("--world-size", type=int, required=True, help="number of rank files to write")
    parser.add_argument(
        "--stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=None,
        help="stage recorded in the manifest (default: unchanged)",
    )
    args = parser.parse_args()

    from shardpar.checkpoint.offline import reshard

    out = reshard(args.ckpt_dir, args.out_dir, args.world_size, args.stage)
    print(f"wrote {out} for world size {args.world_size}")


if __name__ == "__main__":
    run(main)
