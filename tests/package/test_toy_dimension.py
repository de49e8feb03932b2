"""Adding a dimension is what CONTRIBUTING.md says: a do-nothing toy dimension, added to a copy of autotp with exactly
the edits CONTRIBUTING lists (`toy_dimension.EDITS`: its package, one option, one mesh axis, one line of
`parallelize.steps`), wraps, trains a step as one process does, saves and resumes at 2 ranks."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import toy_dimension

import autotp

ROOT = Path(autotp.__file__).parent.parent
WORKER = Path(toy_dimension.__file__)


def contributing_files() -> set[str]:
    """The files CONTRIBUTING.md says a new dimension touches (its "Add a parallel dimension" list)."""
    section = (ROOT / "CONTRIBUTING.md").read_text().split("## Add a parallel dimension")[1].split("\n## ")[0]
    return set(re.findall(r"^- `(autotp/[^`]+)`", section, flags=re.M))


def add_toy(tmp: Path) -> set[str]:
    """A copy of autotp with the toy dimension in `tmp`; returns the files it added or changed."""
    shutil.copytree(ROOT / "autotp", tmp / "autotp", ignore=shutil.ignore_patterns("__pycache__"))
    (tmp / "policies").symlink_to(ROOT / "policies")
    for path, text in toy_dimension.PACKAGE.items():
        (tmp / path).parent.mkdir(exist_ok=True)
        (tmp / path).write_text(text)
    for path, edits in toy_dimension.EDITS.items():
        source = (tmp / path).read_text()
        for anchor, line in edits:
            assert source.count(anchor) == 1, f"{path}: the anchor {anchor!r} of the toy's edit moved"
            source = source.replace(anchor, anchor + line)
        (tmp / path).write_text(source)
    return {str(Path(path).parent) + "/" for path in toy_dimension.PACKAGE} | set(toy_dimension.EDITS)


def test_contributing_lists_the_files_the_toy_dimension_touches(tmp_path: Path) -> None:
    assert add_toy(tmp_path) == {f.replace("<axis>", "toy") for f in contributing_files()}


@pytest.mark.slow  # a copy of autotp imported in a fresh interpreter, then 2 ranks: 25 s on the loaded 2-core machine
def test_a_toy_dimension_wraps_trains_saves_and_resumes(tmp_path: Path) -> None:
    add_toy(tmp_path)
    paths = [str(tmp_path), str(ROOT / "tests")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    run = subprocess.run(
        [sys.executable, str(WORKER), str(tmp_path / "checkpoint")],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for report in json.loads(run.stdout.strip().splitlines()[-1]):
        assert report["autotp"].startswith(str(tmp_path))  # the copy with the toy, not this checkout
        assert "toy" in report["dims"], report["dims"]
        assert report["toy_group"] and report["saved"] == 1 and report["resumed"]
        one, wrapped = report["loss"]
        assert (
            abs(one - wrapped) < 1e-5
        )  # fp32, tp 2: only the order of sums differs (autotp.testing.parity's tolerance)
