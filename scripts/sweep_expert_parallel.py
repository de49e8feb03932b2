"""Expert parallelism over every causal-LM type of the installed transformers: the "ep 2" column of the page.

    python scripts/sweep_expert_parallel.py [--only TYPE ...] [--no-docs]

Each type is built tiny as tests/ep/ep_workers.py builds it (`moe_model`: the tiny builder, or a hand-written config
where transformers' defaults do not build small), then planned at ep_size=2 (`autotp.explain`, no process group).
A dense model (autotp finds no routed experts, and the config names no expert count) gets no entry: "-" on the page.
The others are trained as tests/ep/test_ep_families.py trains them: 3 AdamW steps in one process, and at ep 2 on 2
CPU ranks and tp 2 x ep 2 on 4, compared by `ep_workers.check` (loss, every gradient and parameter, every MoE
layer's top-k). Results:
  matched           parity holds at ep 2 and at tp 2 x ep 2
  refused           autotp refused ep_size=2, naming the module and the reason
  MISMATCH          parity failed: a silent wrong result (must never happen)
  run-time error    the wrapped model raised during training
  not built         the config names experts, but the tiny model does not build or run
  no experts found  the config names experts, but autotp finds none in the tiny model (its MoE layers dropped
                    with the layers, or experts autotp does not recognise)
The results go to scripts/sweep_results_ep.json, from which scripts/supported_models.py regenerates the page;
tests/ep/test_ep_families.py checks that every matched or refused type there is one it tests.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import transformers as tf

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ep")]

import supported_models  # noqa: E402

import autotp  # noqa: E402
from autotp.testing.spawn import run_ranks  # noqa: E402
from ep_workers import HAND_WRITTEN, check, ep_rank_run, moe_model, single_process  # noqa: E402

OUT = ROOT / "scripts" / "sweep_results_ep.json"
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
RANKS = ((2, 1), (4, 2))  # (world, tp) at ep 2


def names_experts(model_type: str) -> bool:
    """Whether `model_type`'s default config (or a sub-config of it) holds more than one routed expert."""
    try:
        config = tf.AutoConfig.for_model(model_type)
    except Exception:  # defaults its own checks refuse: nothing to tell from
        return False
    subs = [config.to_dict(), *(v for v in config.to_dict().values() if isinstance(v, dict))]  # DBRX's ffn_config
    return any(isinstance(sub.get(k), int) and sub[k] > 1 for sub in subs for k in EXPERT_COUNTS)


def first_clause(err: Exception) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}" if str(err) else type(err).__name__


def classify(model_type: str) -> dict | None:
    """This type's entry, or None for a dense model."""
    source = "hand-written tiny config" if model_type in HAND_WRITTEN else "tiny builder"
    try:
        model = moe_model(model_type)
    except Exception as err:
        return {"result": "not built", "note": first_clause(err)} if names_experts(model_type) else None
    try:
        autotp.explain(model, 1, ep_size=2)
    except (ValueError, NotImplementedError) as err:
        moe = names_experts(model_type)
        if "has no routed experts" in str(err):
            note = "autotp finds no routed experts in the tiny model, though its config names several"
            return {"result": "no experts found", "note": note, "config": source} if moe else None
        if not str(err).startswith("ep_size=2: "):  # the tiny model fails before EP (the TP plan's check run)
            return {"result": "not built", "note": first_clause(err)[:200]} if moe else None
        return {"result": "refused", "note": str(err).split(": ", 1)[-1][:300], "config": source}
    try:
        expected = single_process(model_type)
    except Exception as err:  # the tiny model does not train in one process
        return {"result": "not built", "note": first_clause(err)[:200], "config": source}
    for world, tp in RANKS:
        try:
            reports = run_ranks(ep_rank_run, world, model_type, tp, 2)
        except Exception as err:
            return {"result": "run-time error", "note": f"tp {tp} x ep 2: {first_clause(err)}", "config": source}
        try:
            for report in reports:
                check(report, expected)
        except AssertionError as err:
            return {"result": "MISMATCH", "note": f"tp {tp} x ep 2: {err}", "config": source}
    return {"result": "matched", "note": "ep 2 on 2 ranks, tp 2 x ep 2 on 4", "config": source}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="model types to sweep (default: every causal-LM type)")
    parser.add_argument("--no-docs", action="store_true", help="do not regenerate docs/supported-models.md")
    args = parser.parse_args()
    torch.set_num_threads(1)  # ranks are forked from this process
    types = args.only or sorted(tf.AutoModelForCausalLM._model_mapping._model_mapping)
    results = json.loads(OUT.read_text()) if args.only and OUT.exists() else {}  # a partial run updates the rest
    for i, model_type in enumerate(types, 1):
        start = time.monotonic()
        entry = classify(model_type)
        results.pop(model_type, None)
        if entry is not None:
            results[model_type] = entry
        print(
            f"[{i}/{len(types)}] {model_type}: {entry['result'] if entry else '-'} "
            f"({time.monotonic() - start:.1f}s) {entry.get('note', '') if entry else ''}",
            flush=True,
        )
    OUT.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if not args.no_docs:
        supported_models.write()
    sys.exit(1 if any(r["result"] in ("MISMATCH", "run-time error") for r in results.values()) else 0)


if __name__ == "__main__":
    main()
