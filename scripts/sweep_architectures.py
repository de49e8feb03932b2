"""Run the tp=2 parity check over every architecture of one task of the installed transformers.

    python scripts/sweep_architectures.py [--task causal-lm|image-text|seq2seq|masked-lm] [--only TYPE ...] [--no-docs]

Each architecture is built tiny from its config defaults (dims shrunk, sub-configs too, dropout
off), then trained 3 AdamW steps single-process and at tp=2 on CPU ranks, on `autotp.planning.probe`
inputs (an image with its tokens for vision-language models, decoder labels for seq2seq). Results:
  matched           parity holds and something is sharded
  replicated-only   parity holds, nothing could be sharded safely
  refused           autotp.wrap raised an error naming the module and the reason
  MISMATCH          parity failed: a silent wrong result (must never happen)
  run-time error    the wrapped model raised during training
Each matched type is also planned on the meta device (as from_pretrained and `autotp plan` see it);
that plan must equal the one wrap made. Each type that wraps is also saved with
autotp.save_pretrained and compared, file by file and tensor by tensor, with transformers' own save
of the one-process model. Architectures that cannot be built tiny from defaults are listed apart.
The details go to scripts/sweep_results[_TASK][_tpN].json, from which
scripts/supported_models.py regenerates docs/supported-models.md and the README's support summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import supported_models
import torch
import transformers as tf

import autotp
from autotp import Origin
from autotp.compat.hf import TASKS, model_class
from autotp.planning.components import components
from autotp.planning.plan import Replicated
from autotp.testing import parity
from autotp.testing.parity import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL
from autotp.testing.spawn import run_ranks
from autotp.testing.tiny import RECIPES, tiny_config

ROOT = Path(__file__).resolve().parents[1]
TP = 2
LOADS = "from_pretrained of transformers' save"
SAVES = "autotp.save_pretrained = transformers' save"
MAX_PARAMS = 20_000_000


# task (as `autotp plan --task` names it) -> (results file suffix, what the table calls it)
TABLES = {
    "causal-lm": ("", "causal-LM"),
    "image-text": ("-image-text", "vision-language (image-text-to-text)"),
    "seq2seq": ("-seq2seq", "sequence-to-sequence"),
    "masked-lm": ("-masked-lm", "masked-LM"),
}


def auto(task: str):
    """transformers' auto class for `task`, the one `autotp plan --task` builds."""
    return getattr(tf, TASKS[task])


def causal_types(doc: str) -> tuple[list[str], bool]:
    """The causal-LM types a per-type sweep runs (its `--only`, or every one), and whether `--only` chose them; the
    sweep's ranks are forked from this process, so it runs one thread."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="model types to sweep (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    return args.only or sorted(auto("causal-lm")._model_mapping._model_mapping), bool(args.only)


def build(model_type: str, recipe: str = "shrunk", seed: int = 0, task: str = "causal-lm"):
    torch.manual_seed(seed)
    return auto(task).from_config(tiny_config(model_type, recipe), dtype=torch.float32)


def batch(model) -> tuple[torch.Tensor | None, torch.Tensor, dict]:
    return parity.training_inputs(model, batch=2, seq=16, seed=1)


def rank_job(
    rank: int, world: int, model_type: str, recipe: str, dtype: torch.dtype = torch.float32, task: str = "causal-lm"
) -> dict:
    model = build(model_type, recipe, task=task).to(dtype)
    ids, labels, inputs = batch(model)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    try:
        report = parity.compare_training(model, ids, world, steps=3, labels=labels, inputs=inputs)
    except (ValueError, TypeError, NotImplementedError) as err:
        if "autotp" in "".join(_frames(err)):
            return {"refused": f"{type(err).__name__}: {err}"}
        raise
    report["source"] = model.config.model_type
    return report


def _frames(err: BaseException) -> list[str]:
    import traceback

    return [f.filename for f in traceback.extract_tb(err.__traceback__)][-1:]


def buildable(model_type: str, task: str) -> tuple[str | None, str]:
    """The first recipe under which the model builds small and trains single-process, or why none does."""
    whys = []
    for recipe in RECIPES:
        try:
            with torch.device("meta"):  # count first: some defaults stay huge even shrunk
                count = sum(p.numel() for p in auto(task).from_config(tiny_config(model_type, recipe)).parameters())
            if count > MAX_PARAMS:
                whys.append(f"{count / 1e6:.0f}M parameters under recipe '{recipe}'")
                continue
            model = build(model_type, recipe, task=task)
            ids, labels, inputs = batch(model)
            model(**({} if ids is None else {"input_ids": ids}), labels=labels, **inputs).loss.backward()
            return recipe, ""
        except Exception as err:
            whys.append(f"{type(err).__name__}: {str(err).splitlines()[0][:100]}" if str(err) else type(err).__name__)
    return None, whys[0]


def decisions(plan: autotp.Plan) -> autotp.Plan:
    """The plan without the wording of its reasons (a twin's error message quotes the twin's narrower shapes)."""
    return dataclasses.replace(plan, replicated=tuple(path for path, _ in plan.replicated))


def within_tolerance(report: dict) -> tuple[bool, float, float]:
    """(parity holds at the fp32 tolerances, worst gradient error, worst parameter difference) of a
    `compare_training` report."""
    worst_grad = max(report["grad"].values(), default=0.0)
    worst_param = max(report["param"].values(), default=0.0)
    return (
        report["loss"] <= LOSS_ATOL and worst_grad <= GRAD_RTOL and worst_param <= PARAM_ATOL,
        worst_grad,
        worst_param,
    )


def classify(model_type: str, task: str) -> dict:
    recipe, why = buildable(model_type, task)
    if recipe is None:
        return {"result": "not built", "note": why}
    model = build(model_type, recipe, task=task)
    try:
        plan = autotp.explain(model, TP)
    except Exception as err:
        return {"result": "refused", "note": f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"}
    with torch.device("meta"):  # what from_pretrained and `autotp plan` see
        meta_plan = autotp.explain(auto(task).from_config(tiny_config(model_type, recipe)), TP)
    same_plan = "yes" if decisions(meta_plan) == decisions(plan) else "NO"
    source = plan.source.split(" (")[0]
    kind = {
        Origin.SHIPPED: "policy",
        Origin.USER: "policy",
        Origin.HF_PLAN: "HF plan",
        Origin.HF_PLAN_FILLED: "HF plan + detection",
        Origin.DETECTED: "detection",
    }[plan.origin]
    try:
        report = run_ranks(rank_job, TP, model_type, recipe, torch.float32, task)[0]
    except AssertionError as err:
        return {"result": "run-time error", "plan": kind, "note": str(err).strip().splitlines()[-1][:160]}
    if "refused" in report:
        return {"result": "refused", "plan": kind, "note": report["refused"].splitlines()[0][:160]}
    ok, worst_grad, worst_param = within_tolerance(report)
    note = f"{report['sharded']} sharded tensors"
    parts = components(model)
    if parts:
        sharded_in = [path for path, _ in parts if any(layer.path.startswith(path + ".") for layer in plan.layers)]
        note += f" in {', '.join(sharded_in) or 'no sub-model'} of {len(parts)} sub-models"
        note += "; vocab-parallel" if plan.vocab is not None else ""
    if not ok:  # rounding that this model amplifies past the fp32 tolerance vanishes in fp64; a real error does not
        try:
            exact = run_ranks(rank_job, TP, model_type, recipe, torch.float64, task)[0]
            fp64 = max([exact["loss"], *exact["grad"].values(), *exact["param"].values()])
        except AssertionError as err:  # the model does not run in fp64: rounding cannot be told from an error
            fp64 = float("nan")
            print(f"{model_type}: the fp64 check could not run: {str(err).strip().splitlines()[-1][:160]}")
        ok = fp64 <= 1e-10
        note = (
            f"fp32 differences (loss {report['loss']:.2g}, grad {worst_grad:.2g}, param {worst_param:.2g}) "
            f"exceed the test tolerance; in fp64 they are {fp64:.1g}, so rounding only"
            if ok
            else f"loss {report['loss']:.2g}, grad {worst_grad:.2g}, param {worst_param:.2g}; fp64 {fp64:.2g}"
        )
    result = ("matched" if report["sharded"] else "replicated-only") if ok else "MISMATCH"
    loads = loads_like_wrap(model, task)
    saves = saves_like_transformers(model, model_type, recipe, task)
    if result == "replicated-only":
        reasons = {str(why) for _, why in plan.replicated if why.reason is Replicated.NOT_VERIFIED}
        note = next(iter(reasons), "no block the plan could shard")[:160]
    return {
        "result": result,
        "plan": kind,
        "source": source,
        "meta plan = wrap plan": same_plan,
        LOADS: loads,
        SAVES: saves,
        "note": note,
    }


def save_job(rank: int, world: int, model_type: str, recipe: str, task: str, path: str) -> str:
    """Runs on each rank: the tiny model wrapped and saved with autotp.save_pretrained; "" or why autotp refused."""
    try:
        autotp.save_pretrained(autotp.wrap(build(model_type, recipe, task=task), world), path)
    except NotImplementedError as err:
        return f"refused: {str(err).split(' when saving')[0].split('; ')[0][:140]}"
    return ""


def saves_like_transformers(model, model_type: str, recipe: str, task: str) -> str:
    """Whether autotp.save_pretrained at tp=TP writes what transformers' save_pretrained writes for the same
    one-process model (`model`, built from the same seed): the same files, names, shapes, dtypes, values and index."""
    import tempfile

    from safetensors import safe_open

    def files(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), "pt") as f:
                out[file.name] = {name: f.get_tensor(name) for name in f.keys()}
        return out

    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "ours", Path(tmp) / "theirs"
        try:
            model.save_pretrained(theirs)
        except Exception as err:
            return f"not saved by transformers ({type(err).__name__})"
        try:
            refused = run_ranks(save_job, TP, model_type, recipe, task, str(ours))[0]
        except AssertionError as err:
            return f"error: {str(err).strip().splitlines()[-1][:120]}"
        if refused:
            return refused
        mine, expected = files(ours), files(theirs)
        if list(mine) != list(expected):
            return f"NO: files {list(mine)} against {list(expected)}"
        for file, tensors in expected.items():
            if set(mine[file]) != set(tensors):
                return f"NO: {len(set(mine[file]) ^ set(tensors))} names differ in {file}"
            differ = [
                n
                for n, t in tensors.items()
                if mine[file][n].dtype != t.dtype or mine[file][n].shape != t.shape or not torch.equal(mine[file][n], t)
            ]
            if differ:
                return f"NO: {len(differ)} tensors differ, first {differ[0]}"
        index = "model.safetensors.index.json"
        if (theirs / index).exists() and (
            not (ours / index).exists()
            or json.loads((ours / index).read_text()) != json.loads((theirs / index).read_text())
        ):
            return "NO: the index differs"
    return "yes"


def loads_like_wrap(model, task: str) -> str:
    """Whether `autotp.from_pretrained` on transformers' own save equals wrap after transformers' load."""
    import tempfile

    with tempfile.TemporaryDirectory() as path:
        try:
            model.save_pretrained(path)
        except Exception as err:  # transformers refuses to save this tiny config: nothing of autotp's to check
            return f"not saved by transformers ({type(err).__name__})"
        lost = transformers_reload_loses(model, path, task)
        if lost:
            return lost
        try:
            report = run_ranks(parity.compare_loading, TP, path, task)[0]
        except AssertionError as err:
            return f"error: {str(err).strip().splitlines()[-1][:100]}"
    equal = report["keys"] and not report["unequal"] and not report["buffers"] and not report["grads"]
    return "yes" if equal and report["logits"] == 0.0 and report["loss"] == 0.0 else "NO"


def transformers_reload_loses(model, path: str, task: str) -> str:
    """Why transformers' own from_pretrained of its own save is not the saved model (then nothing of autotp's to check)."""
    try:
        with torch.no_grad():
            reloaded = model_class(model.config, task).from_pretrained(path).state_dict()
    except Exception as err:
        return f"not loaded by transformers ({type(err).__name__})"
    saved = model.state_dict()
    differ = [
        k
        for k in saved
        if k not in reloaded or reloaded[k].shape != saved[k].shape or not torch.equal(reloaded[k], saved[k])
    ]
    return f"transformers' own load of it differs from the saved model ({len(differ)} tensors)" if differ else ""


def main() -> None:
    global TP
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=sorted(TABLES), default="causal-lm")
    parser.add_argument(
        "--tp", type=int, default=TP, help="tensor-parallel size (the docs tables are at 2, with a tp=4 column)"
    )
    parser.add_argument("--only", nargs="*", help="model types to sweep (default: all)")
    parser.add_argument("--no-docs", action="store_true", help="do not regenerate docs/supported-models.md")
    args = parser.parse_args()
    TP = args.tp
    torch.set_num_threads(1)  # ranks are forked from this process
    types = args.only or sorted(auto(args.task)._model_mapping._model_mapping)  # model type -> class name
    results: dict = {}
    suffix = TABLES[args.task][0].replace("-", "_") + ("" if TP == 2 else f"_tp{TP}")
    out = ROOT / "scripts" / f"sweep_results{suffix}.json"
    for i, model_type in enumerate(types, 1):
        start = time.monotonic()
        results[model_type] = classify(model_type, args.task)
        print(
            f"[{i}/{len(types)}] {model_type}: {results[model_type]['result']} "
            f"({time.monotonic() - start:.1f}s) {results[model_type].get('note', '')}",
            flush=True,
        )
        _write(out, results, bool(args.only))  # after each type: a sweep stopped halfway keeps what it found
    if args.only and out.exists():  # a partial run updates the stored full sweep
        results = {**json.loads(out.read_text()), **results}
    if not args.no_docs:
        supported_models.write()
    bad = [
        t
        for t, r in results.items()
        if r["result"] == "MISMATCH"
        or r.get("meta plan = wrap plan") == "NO"
        or r.get(LOADS, "").startswith(("NO", "error"))
        or r.get(SAVES, "").startswith(("NO", "error"))
    ]
    sys.exit(1 if bad else 0)


def _write(out: Path, results: dict, partial: bool) -> None:
    """The results so far; a partial run (`--only`) updates the stored full sweep."""
    stored = json.loads(out.read_text()) if partial and out.exists() else {}
    out.write_text(json.dumps({**stored, **results}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
