"""Sequence parallelism over every causal-LM architecture of the installed transformers, at tp=2.

    python scripts/sweep_sequence_parallel.py [--only TYPE ...]

Each architecture is built tiny as `sweep_architectures.py` builds it (dims shrunk, dropout off).
`wrap(..., sequence_parallel=True)` either refuses it before any change (MoE, ALiBi, replicated
weights between the sharded blocks) or it trains 3 AdamW steps against one process with the parity
tolerances. Results: refused, matched, MISMATCH (a silent wrong result: must never happen),
run-time error, not built. The exit status is 1 when any type is MISMATCH.
"""

from __future__ import annotations

import collections
import sys
import time

from sweep_architectures import batch, build, buildable, causal_types, within_tolerance

from autotp.testing import parity
from autotp.testing.spawn import run_ranks

TASK = "causal-lm"


def rank_job(rank: int, world: int, model_type: str, recipe: str) -> dict:
    model = build(model_type, recipe, task=TASK)
    ids, labels, inputs = batch(model)
    try:
        return parity.compare_training(model, ids, world, steps=3, labels=labels, inputs=inputs, sequence_parallel=True)
    except ValueError as err:
        if "sequence_parallel" in str(err):
            return {"refused": str(err).splitlines()[0]}
        raise


def classify(model_type: str) -> tuple[str, str]:
    recipe, why = buildable(model_type, TASK)
    if recipe is None:
        return "not built", why
    try:
        report = run_ranks(rank_job, 2, model_type, recipe)[0]
    except Exception as err:  # noqa: BLE001 - a type that fails is reported, the sweep goes on
        return "run-time error", str(err).strip().splitlines()[-1][:160]
    if "refused" in report:
        return "refused", report["refused"][:160]
    ok, grad, param = within_tolerance(report)
    return ("matched" if ok else "MISMATCH"), f"loss {report['loss']:.1e}, grad {grad:.1e}, param {param:.1e}"


def main() -> None:
    types, only = causal_types(__doc__)
    counts: collections.Counter = collections.Counter()
    for i, model_type in enumerate(types, 1):
        start = time.monotonic()
        result, note = classify(model_type)
        counts[result] += 1
        print(f"[{i}/{len(types)}] {model_type}: {result} ({time.monotonic() - start:.1f}s) {note}", flush=True)
    print(", ".join(f"{n} {result}" for result, n in counts.most_common()))
    sys.exit(1 if counts["MISMATCH"] else 0)


if __name__ == "__main__":
    main()
