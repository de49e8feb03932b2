"""The README's torchrun lines run the example to completion on 2 and 4 CPU ranks."""

from __future__ import annotations

import pytest

from readme_commands import readme_command, run

pytestmark = pytest.mark.slow  # launches torchrun, as test_launchers.py does


@pytest.mark.parametrize("line", [
    r"torchrun --nproc-per-node 2 examples/train\.py(?=\s)",  # the demo: tp=2
    r"torchrun --nproc-per-node 4 examples/train\.py --tp 2(?=\s)",  # 2 replicas x tp=2
])
def test_readme_torchrun_command_runs(line: str) -> None:
    assert "logits match" in run(readme_command(line), timeout=240)
