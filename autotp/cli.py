"""Command line: `python -m autotp consolidate CHECKPOINT_DIR OUT_DIR`."""

from __future__ import annotations

import argparse
import sys

from .loading import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotp", description="autotp tools")
    sub = parser.add_subparsers(dest="command", required=True)
    cons = sub.add_parser("consolidate", help="turn a per-rank training checkpoint into a full HF checkpoint")
    cons.add_argument("checkpoint", help="directory written by autotp.save_checkpoint")
    cons.add_argument("out", help="where to write the HF checkpoint (config, safetensors, index)")
    cons.add_argument("--max-shard-size", default="5GB")
    cons.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        from .resume import consolidate

        try:
            consolidate(args.checkpoint, args.out, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
        except (CheckpointError, FileExistsError) as err:
            print(f"autotp consolidate: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}")
    return 0
