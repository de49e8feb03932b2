"""Which causal-LM types take `recompute_glu`'s path: the gated-MLP products the row layers recompute.

    python scripts/count_recompute_glu.py

Every type that `scripts/sweep_results.json` lists as matched is built tiny (as the sweep builds it), wrapped at
tp=1 (the same layers as at any tp, no process group) and run through one training step. Printed: each type's
number of recomputed products in that step, then how many types have any. About 2 minutes.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import sweep_architectures as sweep
import transformers as tf

import autotp
from autotp.tp import layers


def main() -> None:
    tf.logging.set_verbosity_error()
    results = json.loads((Path(__file__).parent / "sweep_results.json").read_text())
    matched = [model_type for model_type, row in results.items() if row["result"] == "matched"]
    calls: collections.Counter = collections.Counter()
    real = layers.glu_linear

    def counted(*args, **kwargs):
        calls[current] += 1
        return real(*args, **kwargs)

    layers.glu_linear = counted
    counts: dict[str, int | str] = {}
    for current in matched:
        try:
            model = autotp.wrap(sweep.build(current, sweep.buildable(current, "causal-lm")[0]), 1)
            model.train()
            ids, labels, inputs = sweep.batch(model)
            model(**({} if ids is None else {"input_ids": ids}), labels=labels, **inputs).loss.backward()
            counts[current] = calls[current]
        except Exception as err:  # a type that no longer builds here is reported, not counted
            counts[current] = f"{type(err).__name__}: {str(err)[:100]}"
        print(f"{current}: {counts[current]}", flush=True)
    taking = sorted(t for t, n in counts.items() if isinstance(n, int) and n > 0)
    print(f"{len(taking)} of {len(matched)} matched causal-LM types recompute a gated MLP product: {', '.join(taking)}")


if __name__ == "__main__":
    main()
