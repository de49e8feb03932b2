"""The README's torchrun lines run the example to completion on 2 and 4 CPU ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autotp.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("line", [
    r"torchrun --nproc-per-node 2 examples/train\.py",  # the demo: tp=2
    r"torchrun --nproc-per-node 4 examples/train\.py --tp 2",  # 2 replicas x tp=2
])
def test_readme_torchrun_command_runs(line: str) -> None:
    launch = re.search(line + r"(?=\s)", (ROOT / "README.md").read_text())
    assert launch, f"README lost the launch line {line!r}"
    argv = launch.group(0).split()
    argv[0] = str(Path(sys.executable).with_name("torchrun"))  # the torchrun of the environment under test
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port())}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "logits match" in done.stdout
