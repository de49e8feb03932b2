"""benchmarks/pipeline.py --quick runs to its tables: autotp's five schedules and torch.distributed.pipelining driven by
hand at pp 2, against one process.

No timing is asserted (tests never time things): the figures are for people to read. What is asserted is what the
benchmark counts: the bytes the stages sent equal the count from the shapes, 1F1B keeps fewer activations than GPipe on
the first stage, the zero-bubble schedules' theoretical bubble is below 1F1B's, and the hand-made stages compute one
process's loss (so both pipelines do the same work).
"""

from __future__ import annotations

import re
import sys

import pytest

from readme_commands import ROOT, run

RUNS = (
    "autotp GPipe",
    "autotp 1F1B",
    "autotp Interleaved1F1B",
    "autotp ZBVZeroBubble",
    "autotp DualPipeV",
    "torch by hand, Schedule1F1B",
)


@pytest.mark.slow  # spawns 2 ranks that run seven pipelines of a tiny Llama (about 20 s)
def test_quick_benchmark_prints_its_tables() -> None:
    out = run([sys.executable, str(ROOT / "benchmarks" / "pipeline.py"), "--quick"], timeout=120)
    assert "| run | speed vs one process, wall |" in out and "| run | bubble, theory |" in out, out
    cells = [line.strip("| ").split(" | ") for line in out.splitlines() if line.startswith("| pp 2: ")]
    speed = {row[0]: row for row in cells if len(row) == 6}
    shape = {row[0]: row for row in cells if len(row) == 7}
    for name in RUNS:
        assert f"pp 2: {name}" in speed and f"pp 2: {name}" in shape, f"no rows for {name}:\n{out}"
    for row in shape.values():  # the bytes the stages sent, counted, equal the count from the shapes
        assert float(row[5]) > 0 and row[5] == row[6], row
    for name in ("ZBVZeroBubble", "DualPipeV"):  # the theory column: their own order, F = I = W
        assert float(shape[f"pp 2: autotp {name}"][1]) < float(shape["pp 2: autotp 1F1B"][1]), shape
    stage0 = shape["pp 2: autotp 1F1B"][4].split(" ")[0]
    assert 0 < float(stage0) < 1, shape  # 1F1B's first stage keeps less than GPipe's for the backward
    hand, reference = re.search(r"torch by hand's first loss ([\d.]+), one process's ([\d.]+)", out).groups()
    assert abs(float(hand) - float(reference)) < 1e-5, out
