"""The share of a model's parameter bytes the largest rank holds under tensor parallelism, planned on the meta device
at each family's default (flagship-sized) transformers config: `autotp plan <config> --tp N --json`, its largest
`param_bytes_per_rank` over `unsharded_param_bytes` (ideal 1/N).

    python scripts/plan_fractions.py [--tp 8] [--write] [TYPE ...]

Without types, issue 51's families. `--write` records the figures in scripts/plan_fractions.json (merged with those
there), from which scripts/supported_models.py renders docs/supported-models.md's "a rank at tp 8" column.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoConfig

RESULTS = Path(__file__).resolve().parent / "plan_fractions.json"
# issue 51's families: its table (llama the control), then the types it names besides
FAMILIES = [
    "llama",
    "qwen3_next",
    "gpt_oss",
    "mamba2",
    "nemotron_h",
    "bamba",
    "zamba2",
    "falcon_h1",
    "recurrent_gemma",
    "lfm2",
    "jamba",
    "granitemoehybrid",
    "rwkv",
    "jetmoe",
    "mpt",
    "mamba",
    "falcon_mamba",
    "minimax",
    "kimi_linear",
]


def measure(model_type: str, tp: int) -> dict:
    """`autotp plan`'s figures for the type's default config at `tp`: the whole model's bytes, the largest rank's,
    their ratio, whether the vocabulary is split and the seconds it took; or why it was refused."""
    start = time.time()
    with tempfile.TemporaryDirectory() as folder:
        AutoConfig.for_model(model_type).save_pretrained(folder)
        command = [sys.executable, "-m", "autotp", "plan", folder, "--tp", str(tp), "--json"]
        run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        said = (run.stderr.strip().splitlines() or ["?"])[-1]
        return {"tp": tp, "refused": said[:200]}
    plan = json.loads(run.stdout)
    whole, largest = plan["unsharded_param_bytes"], max(plan["param_bytes_per_rank"])
    return {
        "tp": tp,
        "whole_bytes": whole,
        "largest_rank_bytes": largest,
        "fraction": round(largest / whole, 3),
        "vocab_parallel": plan["vocab_parallel"],
        "seconds": round(time.time() - start, 1),
    }


def line(model_type: str, r: dict) -> str:
    if "refused" in r:
        return f"{model_type:18s} refused: {r['refused']}"
    return (
        f"{model_type:18s} {r['whole_bytes'] / 2**30:7.1f} GiB  {r['largest_rank_bytes'] / 2**30:6.2f} GiB  "
        f"{r['fraction']:.3f}  vocab-parallel={r['vocab_parallel']}  ({r['seconds']:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--write", action="store_true", help=f"record the figures in {RESULTS.name}")
    parser.add_argument("types", nargs="*", help="model types (default: issue 51's families)")
    args = parser.parse_args()
    recorded = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for model_type in args.types or FAMILIES:
        found = measure(model_type, args.tp)
        print(line(model_type, found), flush=True)
        if args.write:
            recorded[model_type] = found
            RESULTS.write_text(json.dumps(dict(sorted(recorded.items())), indent=1) + "\n")


if __name__ == "__main__":
    main()
