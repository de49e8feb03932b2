"""benchmarks/save.py --quick runs to its table: save_pretrained, training checkpoints and loads beside their peers.

No timing is asserted (tests never time things): the benchmark's numbers are for people to read.
"""

from __future__ import annotations

import sys

import pytest

from readme_commands import ROOT, run

pytestmark = pytest.mark.slow  # spawns 2-rank jobs and one-process peers for each row (about half a minute)

ROWS = [
    "76 MiB: autotp.save_pretrained, new directory",
    "76 MiB: transformers save_pretrained, new directory",
    "76 MiB: autotp.save_pretrained, overwrite=True",
    "76 MiB: per rank: shard",
]
CHECKPOINT_ROWS = [
    "autotp.save_checkpoint |",
    "async_save=True), blocked",
    "async_save=True), until written",
    "torch.save, one process",
    "load_checkpoint at tp=2",
    "load_checkpoint at tp=1",
    "torch.load + load_state_dict",
]


def test_quick_benchmark_prints_its_table() -> None:
    out = run([sys.executable, str(ROOT / "benchmarks" / "save.py"), "--quick"], timeout=300)
    assert "| run | best s | median s | throughput ratio" in out, out
    lines = out.splitlines()
    for row in ROWS:
        assert any(line.startswith(f"| {row}") for line in lines), f"no row {row!r} in:\n{out}"
    if "training checkpoints skipped" not in out:
        for row in CHECKPOINT_ROWS:
            assert any(row in line for line in lines), f"no row {row!r} in:\n{out}"
