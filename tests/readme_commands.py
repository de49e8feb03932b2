"""Run the README's and the guides' launch commands exactly as written, with launchers from the environment under test."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from autotp.testing.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


def readme_command(pattern: str) -> list[str]:
    """The command matching `pattern` in the README or a guide under docs/, with its launcher taken from the
    environment under test (the guides hold the commands the short README no longer shows)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = next((m for page in pages if (m := re.search(pattern, page.read_text()))), None)
    assert found, f"README.md and docs/ lost the command {pattern!r}"
    argv = found.group(0).split()
    argv[0] = str(Path(sys.executable).with_name(argv[0]))
    return argv


def run(argv: list[str], timeout: int = 300) -> str:
    """Run from the repository root on CPU threads of one each and a free rendezvous port; returns stdout."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port())}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
