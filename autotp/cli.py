"""Command line: `autotp plan`, `autotp verify`, `autotp consolidate` (also `python -m autotp ...`).

Bad input (a file that is not a config, an unknown model type, a model that is not a causal LM, an
incomplete checkpoint) is reported as one line, `autotp <command>: <message>`, with exit code 2; messages
name this command line's flags. On a terminal, `plan` and `verify` say on stderr what they are doing.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from torch import nn

from .compat.hf import TASKS, build_model, model_class
from .io.errors import CheckpointError
from .testing.parity import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from .planning.policy import Policy

# What bad input raises (JSONDecodeError, TOMLDecodeError and CheckpointError are ValueErrors, FileExistsError
# an OSError); main reports these in one line. A rank's failure in verify arrives as an AssertionError and
# keeps its traceback.
INPUT_ERRORS = (ValueError, OSError)
# The library's keyword arguments in messages raised by the functions the commands call -> the command line's flags
FLAG_WORDING = (
    (re.compile(r"\boverwrite=True\b"), "--overwrite"),
    (re.compile(r"\btp_size=(\d+)"), r"--tp \1"),
    (re.compile(r"\bep_size=(\d+)"), r"--ep \1"),
    (re.compile(r"(?<!['\"])\btp_size\b(?!['\"])"), "--tp"),
)  # not a quoted key name


def load_config(spec: str) -> PretrainedConfig:
    """A config from a local HF directory, a config.json file, or a model type name (tiny defaults)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    from .testing.tiny import tiny_config

    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: a directory without config.json")
        return AutoConfig.from_pretrained(path)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not a JSON config ({err})") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"{path}: not a transformers config (no model_type key)")
        if data["model_type"] not in CONFIG_MAPPING:
            raise ValueError(f"{path}: unknown model_type {data['model_type']!r}")
        return AutoConfig.for_model(**data)
    if spec not in CONFIG_MAPPING:
        raise ValueError(f"{spec}: no such file or directory, and not a transformers model type")
    return tiny_config(spec)


def read_policy(path: str | None) -> Policy | None:
    """The policy TOML file at `path` (None: autotp's own choice), with parse errors that name the file."""
    import tomllib

    from .planning.policy import load_policy

    if path is None:
        return None
    try:
        return load_policy(path)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML ({err})") from None


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def progress(command: str, text: str) -> None:
    """One line on stderr as a slow step starts (building, planning, training), when stderr is a terminal (as git
    and tqdm do): stdout keeps only the result, and a script reading stderr still gets one line per error."""
    if sys.stderr.isatty():
        print(f"autotp {command}: {text}", file=sys.stderr, flush=True)


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' log and warnings off while the commands build and plan models: its notes (BERT's is_decoder,
    once per build of the model and its twins) are about models the user never asked to build."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
            yield
    finally:
        hf_logging.set_verbosity(level)


def build(
    config: PretrainedConfig, device: str | None = None, task: str | None = None, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """The model of `config` for `task` (see `model_class`), random weights in `dtype` (or on the meta device), not
    in the config's own `torch_dtype`, so that the sizes printed are those of the dtype the command names."""
    with torch.device(device) if device else nullcontext():
        return build_model(config, task, dtype=dtype)


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan (or its JSON summary) for `args.model` at `args.tp`."""
    from .api import explain
    from .ep.regions import expert_layouts
    from .mesh import check_world
    from .options import WrapOptions
    from .planning.report import context_cost, expert_cost, expert_zero_bytes, summary
    from .pp.report import describe as pipeline_lines
    from .pp.report import pipeline_cost

    config, policy = load_config(args.model), read_policy(args.policy)
    # the layout wrap would refuse at this world (pp x dp x cp x tp ranks), with wrap's own error
    sizes = WrapOptions(tp_size=args.tp, cp_size=args.cp, ep_size=args.ep, pp_size=args.pp).sizes()
    check_world(sizes, args.pp * args.tp * args.cp * args.dp)
    with quiet_transformers():
        progress("plan", f"building {config.model_type} on the meta device in {args.dtype}")
        model = build(config, "meta", args.task, DTYPES[args.dtype])
        progress("plan", f"planning at tp {args.tp}, verifying each block on a small structural twin")
        plan = explain(model, args.tp, policy=policy, ep_size=args.ep)
    dense = replace(plan, regions=()) if args.ep > 1 else plan  # under EP the experts reduce nothing over TP
    info = {"dtype": args.dtype, **summary(model, dense, args.batch, args.seq, args.dp)}
    if args.ep > 1:
        layouts = [(e.path, e.names) for e in expert_layouts(model, plan, args.ep)]
        info["experts"] = e = expert_cost(model, plan, layouts, args.ep, args.batch, args.seq)
        # experts are split over EP and copied over expert-DP = world / ep
        e["expert_dp_size"] = max(1, args.tp * args.dp * args.cp // args.ep)
        info["zero_bytes_per_rank"] = expert_zero_bytes(
            max(e["param_bytes_per_rank"]) - e["expert_bytes_per_rank"],
            e["expert_bytes_per_rank"],
            args.dp * args.cp,
            e["expert_dp_size"],
        )
        info["param_bytes_per_rank"] = e["param_bytes_per_rank"]  # the summary's held every expert whole
        info["train_state_bytes_per_rank"] = [4 * b for b in e["param_bytes_per_rank"]]
    if args.cp > 1:
        info["context"] = [context_cost(model, plan, args.batch, args.seq, cp) for cp in sorted({1, args.cp})]
    if args.pp > 1:  # the experts split over ep whole (EP under a pipeline: `autotp.pp`'s refusals say if built yet)
        experts = frozenset(f"{p}.{n}" for p, names in layouts for n in names) if args.ep > 1 else frozenset()
        micro = args.microbatches or args.pp
        info["pipeline"] = pipeline_cost(model, dense, args.pp, micro, args.batch, args.seq, experts, args.ep)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    mib = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    if args.ep > 1:  # the experts whole, split by expert: the dense plan's lines, then the experts' and EP's bytes
        print(dense.describe())
        for path, names in layouts:
            for name in names:
                shape = tuple(model.get_submodule(path).get_parameter(name).shape)
                print(
                    f"  {'experts':<10} {path}.{name}  {shape} -> {shape[0] // args.ep} whole experts per rank "
                    f"(split by expert over ep {args.ep})"
                )
        print(
            f"  parameter bytes per rank: {' / '.join(mib(b) for b in info['param_bytes_per_rank'])}"
            f" (unsharded {mib(info['unsharded_param_bytes'])})"
        )
    else:
        print(plan.describe(model))
    print(f"  sizes in {args.dtype} (--dtype)")
    print(f"  with gradients and Adam moments: {' / '.join(mib(b) for b in info['train_state_bytes_per_rank'])}")
    print(f"  collectives per training step at batch {args.batch} x seq {args.seq}:")
    for c in info["collectives"]:
        print(f"    {c['phase']:<8} {c['count']} x {mib(c['bytes'])}  {c['where']}")
    print(f"    total {mib(info['collective_bytes_per_step'])} per step")
    if args.dp > 1 or args.zero is not None:
        gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        at = (
            f"tp {args.tp} x dp {args.dp}"
            + (f" x cp {args.cp}" if args.cp > 1 else "")
            + (f", experts over ep {args.ep} x expert-DP {info['experts']['expert_dp_size']}" if args.ep > 1 else "")
        )
        print(
            f"  per rank at {at} (largest TP rank; parameters, gradients, Adam moments in the parameter dtype, no "
            f"activations):"
        )
        stages = sorted({0, args.zero}) if args.zero is not None else [0, 1, 2, 3]
        for stage in stages:
            z = info["zero_bytes_per_rank"][stage]
            print(
                f"    zero {stage}: params {gib(z['params'])} + grads {gib(z['grads'])} + optimizer "
                f"{gib(z['optimizer'])} = {gib(z['total'])}   ({z['runs']})"
            )
    if args.ep > 1:
        e = info["experts"]
        print(
            f"  at tp {args.tp} x ep {args.ep}: experts {mib(e['expert_bytes_per_rank'])} per rank (of "
            f"{mib(e['expert_bytes'])}), parameters {' / '.join(mib(b) for b in e['param_bytes_per_rank'])} per rank; "
            f"{e['all_to_alls_per_step']} token all-to-alls per step move {mib(e['all_to_all_bytes_per_step'])} off "
            f"each rank at batch {args.batch} x seq {args.seq} (routing spread evenly)"
        )
    for c in info.get("context", []):
        print(
            f"  at tp {args.tp} x cp {c['cp_size']}, batch {args.batch} x seq {c['seq']}: activations ~"
            f"{mib(c['activation_bytes_per_rank'])} per rank (estimate); attention moves "
            f"{mib(c['attention_bytes_per_step'])} per rank per step in {c['attention_collectives_per_step']} "
            f"collectives (K/V all-gather forward, reduce-scatter backward)"
        )
    if args.pp > 1:
        print("\n".join(pipeline_lines(info["pipeline"], args.batch, args.seq)))
    for item in info["replicated"]:
        print(f"  warning: {item['path']} stays replicated ({item['why']})")
    return 0


def _verify_rank(rank: int, world: int, spec: str, steps: int, policy: str | None, task: str | None) -> dict:
    from .testing.parity import compare_training, training_inputs

    torch.manual_seed(0)
    path = Path(spec)
    config = load_config(spec)
    with quiet_transformers():
        if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
            cls: type[PreTrainedModel] = model_class(config, task)  # an auto class's model class
            model = cls.from_pretrained(path, dtype=torch.float32)
        else:
            model = build(config, task=task)
        ids, labels, inputs = training_inputs(model)
        return compare_training(model, ids, world, steps=steps, policy=policy, labels=labels, inputs=inputs)


def cmd_verify(args: argparse.Namespace) -> int:
    """Train on `args.tp` CPU ranks and in one process; print the error table and exit 1 on a mismatch."""
    from .api import explain
    from .testing.spawn import run_ranks

    # Bad input fails here, in one line, rather than as a traceback from every rank.
    config, policy = load_config(args.model), read_policy(args.policy)
    with quiet_transformers():
        progress(
            "verify",
            f"building {config.model_type} on the meta device and planning at tp {args.tp}, "
            f"verifying each block on a small structural twin",
        )
        explain(build(config, "meta", args.task), args.tp, policy=policy)
    progress("verify", f"training {args.steps} steps on {args.tp} CPU ranks and in one process, fp32")
    torch.set_num_threads(1)  # the ranks are forked from this process
    report = run_ranks(_verify_rank, args.tp, args.model, args.steps, args.policy, args.task)[0]
    if report["sharded"] == 0:
        print(
            f"NOTHING SHARDED: every layer of {args.model} stays replicated at tp={args.tp}, so the comparison is "
            f"trivially equal; wrap's log above says why (`autotp plan {args.model} --tp {args.tp}` shows the plan)"
        )
        return 1
    entries = [(err / GRAD_RTOL, "gradient", name, err) for name, err in report["grad"].items()]
    entries += [
        (err / PARAM_ATOL, f"param after {args.steps} steps", name, err) for name, err in report["param"].items()
    ]
    entries.sort(reverse=True)
    print(
        f"autotp verify: tp={args.tp}, {args.steps} AdamW steps, fp32; loss differs by {report['loss']:.3g} "
        f"(tolerance {LOSS_ATOL})"
    )
    print(f"{'ratio to tolerance':>18}  {'what':<22} {'error':>10}  parameter")
    for ratio, what, name, err in entries[: args.top]:
        print(f"{ratio:>18.3g}  {what:<22} {err:>10.3g}  {name}")
    bad = [row for row in entries if row[0] > 1] + ([("loss",)] if report["loss"] > LOSS_ATOL else [])
    if bad:
        first = bad[0]
        print(
            f"MISMATCH: {len(bad)} checks over tolerance; worst: {first[1] if len(first) > 1 else 'loss'} of "
            f"{first[2] if len(first) > 2 else 'the model'}"
        )
        return 1
    print(f"OK: {len(report['grad'])} gradients and {len(report['param'])} parameters match one process")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    """Write a full HF checkpoint from a training checkpoint (either format)."""
    from .io.checkpoint.consolidate import consolidate

    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_dir():
        raise CheckpointError(f"{checkpoint}: no such directory")
    if (checkpoint / "autotp_checkpoint.json").is_file() and not (checkpoint / "config.json").is_file():
        raise CheckpointError(f"{checkpoint}: no config.json, so the model cannot be rebuilt")
    consolidate(checkpoint, args.out, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    print(f"wrote {args.out}")
    return 0


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The `autotp` argument parser with its three subcommands."""
    parser = argparse.ArgumentParser(prog="autotp", description="autotp tools")
    sub = parser.add_subparsers(dest="command", required=True, help="what to do")
    plan = sub.add_parser("plan", help="print the plan wrap would apply (meta device, no process group)")
    plan.add_argument("model", help="local HF directory, config.json, or a model type name (tiny defaults)")
    plan.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel size")
    plan.add_argument("--batch", type=positive_int, default=4, help="batch size for the collective bytes")
    plan.add_argument("--seq", type=positive_int, default=128, help="sequence length for the collective bytes")
    plan.add_argument(
        "--dp", type=positive_int, default=1, help="data-parallel size, for the per-rank bytes by ZeRO stage"
    )
    plan.add_argument(
        "--cp",
        type=positive_int,
        default=1,
        help="context-parallel size: activation memory per rank and the attention's bytes per step at --seq",
    )
    plan.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="expert-parallel size: per-rank bytes with the "
        "experts split by expert, and the all-to-all bytes of one step",
    )
    plan.add_argument("--pp", type=positive_int, default=1, help="pipeline stages: bytes per stage, bubble, in flight")
    plan.add_argument("--microbatches", type=positive_int, help="micro-batches of --batch under --pp (default: --pp)")
    plan.add_argument("--zero", type=int, choices=[0, 1, 2, 3], help="ZeRO stage to price against DDP (default: all)")
    plan.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="parameter dtype for the sizes (default float32; a config's torch_dtype is not used)",
    )
    plan.add_argument("--policy", help="a policy TOML file")
    plan.add_argument(
        "--task", choices=sorted(TASKS), help="model head to build (default: from config.architectures, else causal-lm)"
    )
    plan.add_argument("--json", action="store_true", help="print a JSON summary instead of the text")
    plan.set_defaults(run=cmd_plan)
    verify = sub.add_parser("verify", help="train on N CPU ranks and on one process; compare everything")
    verify.add_argument("model", help="local HF directory (with or without weights), config.json, or a model type")
    verify.add_argument("--tp", type=positive_int, required=True, help="tensor-parallel size (CPU ranks)")
    verify.add_argument("--steps", type=positive_int, default=3, help="AdamW steps before comparing parameters")
    verify.add_argument("--policy", help="a policy TOML file")
    verify.add_argument(
        "--task", choices=sorted(TASKS), help="model head to build (default: from config.architectures, else causal-lm)"
    )
    verify.add_argument("--top", type=positive_int, default=15, help="rows of the error table")
    verify.set_defaults(run=cmd_verify)
    cons = sub.add_parser("consolidate", help="turn a per-rank training checkpoint into a full HF checkpoint")
    cons.add_argument("checkpoint", help="directory written by autotp.save_checkpoint")
    cons.add_argument("out", help="where to write the HF checkpoint (config, safetensors, index)")
    cons.add_argument(
        "--max-shard-size", type=shard_size, default="5GB", help="largest safetensors file, such as 5GB or 500MB"
    )
    cons.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    cons.set_defaults(run=cmd_consolidate)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one `autotp` command; bad input is one line on stderr and exit code 2."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except INPUT_ERRORS as err:
        lines = str(err).strip().splitlines() or [type(err).__name__]
        print(f"autotp {args.command}: {cli_wording(lines[0])}", file=sys.stderr)
        return 2


def cli_wording(message: str) -> str:
    """`message` with the library's keyword arguments named as this command line's flags (`--overwrite`, `--tp`)."""
    for pattern, flag in FLAG_WORDING:
        message = pattern.sub(flag, message)
    return message


def shard_size(text: str) -> int | str:
    """argparse type: a size such as 5GB or 500MB (transformers' units), or a number of bytes."""
    if not re.fullmatch(r"\d+|\d+(\.\d+)?\s*[KMGT]B", text.strip(), re.IGNORECASE):
        raise argparse.ArgumentTypeError(f"a size such as 5GB or 500MB (units KB, MB, GB, TB), got {text!r}")
    return int(text) if text.strip().isdigit() else text
