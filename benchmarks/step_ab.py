"""autotp's training step at two revisions, alternated: did a change make the step slower?

    python benchmarks/step_ab.py BEFORE [AFTER] [--pairs 8] [--steps 24]

BEFORE and AFTER are git revisions (AFTER defaults to the working tree). Each revision is checked out into a
temporary worktree; the pairs alternate ABBA (before-after, then after-before, ...) so neither side always runs
second on a shared machine. Every run is `benchmarks/peers.py`'s autotp peer (its model, batch, 2 gloo ranks x 1
thread) in fresh processes, importing autotp from that revision. Reported: each pair's after / before ratio of the
slower rank's median step time, their median and geometric mean, and the all-reduces per step on each side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
ONE_RUN = """
import sys
import torch.multiprocessing as mp
sys.path.insert(0, {benchmarks!r})
import peers
from autotp.testing.spawn import free_port
assert __import__("autotp").__file__.startswith({tree!r})
out = mp.get_context("spawn").SimpleQueue()
mp.start_processes(peers.rank_main, args=(2, "autotp", {model!r}, free_port(), {steps}, 2, out), nprocs=2,
                   start_method="spawn")
results = [out.get()[1] for _ in range(2)]
print(max(r["median"] for r in results), results[0]["collectives"])
"""


def checkout(revision: str | None, into: Path) -> Path:
    """The tree at `revision` (a detached worktree under `into`), or this working tree for None."""
    if revision is None:
        return ROOT
    tree = into / revision.replace("/", "_")
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), revision], check=True, capture_output=True
    )
    return tree


def one_run(tree: Path, model: str, steps: int) -> tuple[float, int]:
    """The slower rank's median step time and the all-reduces per step, autotp imported from `tree`."""
    code = ONE_RUN.format(benchmarks=str(ROOT / "benchmarks"), tree=str(tree), model=model, steps=steps)
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tree,
        env={**_env(), "PYTHONPATH": str(tree)},
        check=True,
        capture_output=True,
        text=True,
    )
    median, collectives = done.stdout.split()[-2:]
    return float(median), int(collectives)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after", nargs="?")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import peers
    from transformers import AutoModelForCausalLM, LlamaConfig

    work = Path(tempfile.mkdtemp(prefix="autotp-ab-"))
    model = str(work / "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**peers.CONFIG)).save_pretrained(model)
    trees = {"before": checkout(args.before, work), "after": checkout(args.after, work)}
    ratios, collectives = [], {}
    try:
        for pair in range(args.pairs):
            order = ("before", "after") if pair % 2 == 0 else ("after", "before")
            times = {}
            for side in order:
                times[side], collectives[side] = one_run(trees[side], model, args.steps)
            ratios.append(times["after"] / times["before"])
            print(
                f"pair {pair + 1} ({order[0]} first): before {times['before']:.3f} s, after {times['after']:.3f} s, "
                f"after / before {ratios[-1]:.3f}",
                flush=True,
            )
    finally:
        for tree in trees.values():
            if tree != ROOT:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    print(
        f"\nafter / before over {len(ratios)} pairs: median {statistics.median(ratios):.3f}, geometric mean "
        f"{statistics.geometric_mean(ratios):.3f}, range {min(ratios):.3f}-{max(ratios):.3f}; all-reduces per step "
        f"before {collectives['before']}, after {collectives['after']}"
    )


if __name__ == "__main__":
    main()
