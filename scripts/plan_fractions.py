"""The share of a model's parameter bytes the largest rank holds under tensor parallelism, planned on the meta device
at each family's default (flagship-sized) transformers config: `autotp plan <config> --tp N --json`, its largest
`param_bytes_per_rank` over `unsharded_param_bytes` (ideal 1/N).

    python scripts/plan_fractions.py [--tp 8] TYPE [TYPE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time

from transformers import AutoConfig


def fraction(model_type: str, tp: int) -> str:
    """One line: the whole model's bytes, the largest rank's, their ratio and whether the vocabulary is split."""
    start = time.time()
    with tempfile.TemporaryDirectory() as folder:
        AutoConfig.for_model(model_type).save_pretrained(folder)
        command = [sys.executable, "-m", "autotp", "plan", folder, "--tp", str(tp), "--json"]
        run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode:
        said = (run.stderr.strip().splitlines() or ["?"])[-1]
        return f"{model_type:18s} refused: {said[:200]}"
    plan = json.loads(run.stdout)
    whole, largest = plan["unsharded_param_bytes"], max(plan["param_bytes_per_rank"])
    return (
        f"{model_type:18s} {whole / 2**30:7.1f} GiB  {largest / 2**30:6.2f} GiB  {largest / whole:.3f}  "
        f"vocab-parallel={plan['vocab_parallel']}  ({time.time() - start:.0f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("types", nargs="+")
    args = parser.parse_args()
    for model_type in args.types:
        print(fraction(model_type, args.tp), flush=True)


if __name__ == "__main__":
    main()
