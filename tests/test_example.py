"""The README's demo launch line runs the example to completion on 2 CPU ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from autotp.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


def test_readme_demo_command_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    launch = re.search(r"(torchrun --nproc-per-node 2 examples/train\.py)", readme)
    assert launch, "README lost its demo launch line"
    argv = launch.group(1).split()
    argv[0] = str(Path(sys.executable).with_name("torchrun"))  # the torchrun of the environment under test
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port())}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "logits match" in done.stdout
