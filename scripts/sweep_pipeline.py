"""Pipeline parallelism over every causal-LM type of the installed transformers: the "pp 2" column of the page.

    python scripts/sweep_pipeline.py [--only TYPE ...]

Each type is built tiny as `sweep_architectures.py` builds it (dims shrunk, dropout off) and trained 3 AdamW steps in
one process and at pp 2 on 2 CPU ranks (`wrap(model, 1, pp_size=2)`, 2 micro-batches of one row, 1F1B), both through
`autotp.forward_backward` (`parity.compare_training`): the loss of every step, the first step's gradients and the
parameters after the steps of everything each stage trains, at the fp32 parity tolerances; every parameter one process
trains must be trained on some stage. Results:
  matched           parity holds at pp 2
  refused           autotp refused pp_size=2 (at wrap, or at the first step), naming the reason
  MISMATCH          parity failed: a silent wrong result (must never happen)
  run-time error    the wrapped model raised during training
  not built         the type cannot be built tiny from its defaults
The results go to scripts/sweep_results_pp.json, from which scripts/supported_models.py regenerates the page. The exit
status is 1 when any type is MISMATCH.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from pathlib import Path

import supported_models
from sweep_architectures import batch, build, buildable, causal_types, within_tolerance

from autotp.testing import parity
from autotp.testing.spawn import run_ranks

TASK = "causal-lm"
OUT = Path(__file__).resolve().parent / supported_models.PP
REFUSED = (NotImplementedError, ValueError)  # autotp's refusals; anything else is a run-time error


def rank_job(rank: int, world: int, model_type: str, recipe: str) -> dict:
    model = build(model_type, recipe, task=TASK)
    ids, labels, inputs = batch(model)
    try:
        report = parity.compare_training(model, ids, 1, steps=3, labels=labels, inputs=inputs, pp_size=2)
    except REFUSED as err:
        if "pp_size" in str(err) or "pipeline" in str(err):
            return {"refused": str(err).splitlines()[0]}
        raise
    return report


def classify(model_type: str) -> tuple[str, str]:
    recipe, why = buildable(model_type, TASK)
    if recipe is None:
        return "not built", why
    try:
        reports = run_ranks(rank_job, 2, model_type, recipe)
    except Exception as err:  # noqa: BLE001 - a type that fails is reported, the sweep goes on
        return "run-time error", str(err).strip().splitlines()[-1][:160]
    if any("refused" in r for r in reports):
        return "refused", next(r["refused"] for r in reports if "refused" in r)[:200]
    trained = set().union(*(r["param"] for r in reports))
    checks = [within_tolerance(r) for r in reports]
    grad, param = max(c[1] for c in checks), max(c[2] for c in checks)
    loss = max(r["loss"] for r in reports)
    expected = reports[0]["reference_trained"]  # one process's parameters with a gradient: each on some stage
    ok = all(c[0] for c in checks) and len(trained) == expected
    note = f"loss {loss:.1e}, grad {grad:.1e}, param {param:.1e}, {len(trained)} of {expected} trained"
    return ("matched" if ok else "MISMATCH"), note


def main() -> None:
    types, only = causal_types(__doc__)
    results = json.loads(OUT.read_text()) if only and OUT.exists() else {}
    counts: collections.Counter = collections.Counter()
    for i, model_type in enumerate(types, 1):
        start = time.monotonic()
        result, note = classify(model_type)
        results[model_type] = {"result": result, "note": note}
        counts[result] += 1
        print(f"[{i}/{len(types)}] {model_type}: {result} ({time.monotonic() - start:.1f}s) {note}", flush=True)
        OUT.write_text(json.dumps(dict(sorted(results.items())), indent=1) + "\n")
    supported_models.write()
    print(", ".join(f"{n} {result}" for result, n in counts.most_common()))
    sys.exit(1 if counts["MISMATCH"] else 0)


if __name__ == "__main__":
    main()
