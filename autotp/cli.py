"""Command line: `autotp plan`, `autotp verify`, `autotp consolidate` (also `python -m autotp ...`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

from .io.errors import CheckpointError
from .testing.parity import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL


def load_config(spec: str):
    """A config from a local HF directory, a config.json file, or a model type name (tiny defaults)."""
    from transformers import AutoConfig

    from .testing.tiny import tiny_config

    path = Path(spec)
    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    if path.is_file():
        data = json.loads(path.read_text())
        return AutoConfig.for_model(**data)
    return tiny_config(spec)


def build(config, device: str | None = None) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if device == "meta":
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def cmd_plan(args: argparse.Namespace) -> int:
    from .api import explain
    from .report import summary

    model = build(load_config(args.model), "meta")
    plan = explain(model, args.tp, policy=args.policy)
    info = summary(model, plan, args.batch, args.seq)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    print(plan.describe(model))
    print(f"  with gradients and Adam moments: {' / '.join(mib(b) for b in info['train_state_bytes_per_rank'])}")
    print(f"  collectives per training step at batch {args.batch} x seq {args.seq}:")
    for c in info["collectives"]:
        print(f"    {c['phase']:<8} {c['count']} x {mib(c['bytes'])}  {c['where']}")
    print(f"    total {mib(info['collective_bytes_per_step'])} per step")
    for item in info["replicated"]:
        print(f"  warning: {item['path']} stays replicated ({item['why']})")
    return 0


def _verify_rank(rank: int, world: int, spec: str, steps: int, policy: str | None) -> dict:
    from transformers import AutoModelForCausalLM

    from .testing.parity import compare_training

    torch.manual_seed(0)
    path = Path(spec)
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        model = build(load_config(spec))
    vocab = getattr(model.config, "vocab_size", 256)
    ids = torch.randint(0, min(vocab, 1000), (2, 16), generator=torch.Generator().manual_seed(1))
    return compare_training(model, ids, world, steps=steps, policy=policy)


def cmd_verify(args: argparse.Namespace) -> int:
    from .testing.spawn import run_ranks

    torch.set_num_threads(1)  # the ranks are forked from this process
    report = run_ranks(_verify_rank, args.tp, args.model, args.steps, args.policy)[0]
    rows = [(err / GRAD_RTOL, "gradient", name, err) for name, err in report["grad"].items()]
    rows += [(err / PARAM_ATOL, f"param after {args.steps} steps", name, err) for name, err in report["param"].items()]
    rows.sort(reverse=True)
    print(f"autotp verify: tp={args.tp}, {args.steps} AdamW steps, fp32; loss differs by {report['loss']:.3g} "
          f"(tolerance {LOSS_ATOL})")
    print(f"{'ratio to tolerance':>18}  {'what':<22} {'error':>10}  parameter")
    for ratio, what, name, err in rows[: args.top]:
        print(f"{ratio:>18.3g}  {what:<22} {err:>10.3g}  {name}")
    bad = [row for row in rows if row[0] > 1] + ([("loss",)] if report["loss"] > LOSS_ATOL else [])
    if bad:
        first = bad[0]
        print(f"MISMATCH: {len(bad)} checks over tolerance; worst: {first[1] if len(first) > 1 else 'loss'} of "
              f"{first[2] if len(first) > 2 else 'the model'}")
        return 1
    print(f"OK: {len(report['grad'])} gradients and {len(report['param'])} parameters match one process")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    from .io.resume import consolidate

    try:
        consolidate(args.checkpoint, args.out, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    except (CheckpointError, FileExistsError) as err:
        print(f"autotp consolidate: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="autotp", description="autotp tools")
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="print the plan wrap would apply (meta device, no process group)")
    plan.add_argument("model", help="local HF directory, config.json, or a model type name (tiny defaults)")
    plan.add_argument("--tp", type=int, required=True)
    plan.add_argument("--batch", type=int, default=4)
    plan.add_argument("--seq", type=int, default=128)
    plan.add_argument("--policy", help="a policy TOML file")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(run=cmd_plan)
    verify = sub.add_parser("verify", help="train on N CPU ranks and on one process; compare everything")
    verify.add_argument("model", help="local HF directory (with or without weights), config.json, or a model type")
    verify.add_argument("--tp", type=int, required=True)
    verify.add_argument("--steps", type=int, default=3)
    verify.add_argument("--policy", help="a policy TOML file")
    verify.add_argument("--top", type=int, default=15, help="rows of the error table")
    verify.set_defaults(run=cmd_verify)
    cons = sub.add_parser("consolidate", help="turn a per-rank training checkpoint into a full HF checkpoint")
    cons.add_argument("checkpoint", help="directory written by autotp.save_checkpoint")
    cons.add_argument("out", help="where to write the HF checkpoint (config, safetensors, index)")
    cons.add_argument("--max-shard-size", default="5GB")
    cons.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    cons.set_defaults(run=cmd_consolidate)
    args = parser.parse_args(argv)
    return args.run(args)
