"""Planning a 70B-sized model with no shipped policy, on the meta device: time and peak RSS.

    python benchmarks/plan_memory.py

OLMo and Cohere configs at Llama-3-70B widths (hidden 8192, 80 layers, 64 query / 8 key-value
heads, MLP 28672, vocab 128256) have no shipped policy, so their plan comes from HF's
base_model_tp_plan and must be verified by running a structural twin. Each case runs in a fresh
process: its baseline is the peak RSS after building the meta model (what any meta-device tool
pays, transformers' own `tp_plan` included), then `autotp.explain(model, 8)` is timed and the
peak RSS read again. Targets: under 60 s and under 4 GB of RSS.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from load_memory import peak_rss  # benchmarks/ is on the path when a script there runs

WIDTHS = dict(
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
)


def measure(model_type: str) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import autotp
    from autotp.planning.plan import Replicated

    config = AutoConfig.for_model(model_type, **WIDTHS)
    start = time.monotonic()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    built, baseline = time.monotonic() - start, peak_rss()
    start = time.monotonic()
    plan = autotp.explain(model, 8)
    seconds = time.monotonic() - start
    unverified = sum(why.reason is Replicated.NOT_VERIFIED for _, why in plan.replicated)
    return {
        "model_type": model_type,
        "build_meta_s": round(built, 2),
        "plan_s": round(seconds, 2),
        "baseline_rss_gb": round(baseline / 2**30, 2),
        "peak_rss_gb": round(peak_rss() / 2**30, 2),
        "sharded_linears": len(plan.layers),
        "unverified_linears": unverified,
        "origin": plan.origin.name,
    }


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(measure(sys.argv[1])))
        return
    print(
        f"{'model':<8} {'meta build':>10} {'plan':>8} {'RSS before':>11} {'RSS peak':>9} {'sharded':>8} {'unverified':>10}"
    )
    for model_type in ("olmo", "cohere"):
        out = subprocess.run([sys.executable, __file__, model_type], capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{r['model_type']:<8} {r['build_meta_s']:>9}s {r['plan_s']:>7}s {r['baseline_rss_gb']:>9} GB "
            f"{r['peak_rss_gb']:>6} GB {r['sharded_linears']:>8} {r['unverified_linears']:>10}  ({r['origin']})"
        )


if __name__ == "__main__":
    main()
