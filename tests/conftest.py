"""Fixtures every test module may use, and the quick tier's rule for parametrised tests (one case each). Shared
non-fixture helpers live in tests/models.py (a helper module), a package's own rank workers beside its tests
(tests/io/resume_workers.py, tests/cp/cp_workers.py); test modules never import each other
(tests/package/test_suite_hygiene.py checks)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

# Ranks are forked from this process: keep it single-threaded so no OpenMP pool is forked mid-use.
torch.set_num_threads(1)

# wrap imports PEFT when it is installed (autotp.io.rollout.adapters); importing it here once spares every forked rank the ~2 s.
import peft  # noqa: E402,F401


@dataclass
class CliResult:
    """What one `autotp ...` command gave: its exit code and what it printed."""

    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def autotp_cli(capsys: pytest.CaptureFixture[str]):
    """`autotp_cli("plan", "llama", "--tp", "2")` runs `autotp.cli.main` in this process and returns a `CliResult`.

    argparse's usage errors exit (SystemExit); a test expecting one wraps the call in `pytest.raises(SystemExit)` and
    reads the message with `capsys`. tests/package/test_cli_errors.py runs `python -m autotp` itself once.
    """
    from autotp.cli import main

    def run(*args: str) -> CliResult:
        capsys.readouterr()  # only this command's output
        code = main(list(args))
        out, err = capsys.readouterr()
        return CliResult(code, out, err)

    return run


@pytest.fixture
def gloo_group_of_one():
    """A one-rank gloo process group in this process (no port: an in-memory store), destroyed after the test so that
    ranks forked later start without one."""
    import torch.distributed as dist

    assert not dist.is_initialized(), "a process group was left initialised"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.hookimpl(tryfirst=True)  # before pytest's own `-m` deselection reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The quick tier keeps one case of each parametrised test, its first case not already `slow`; the other cases
    are `slow` too. CI runs both tiers, so every case still runs there; the quick tier stays a few minutes.
    `AUTOTP_EVERY_CASE=1` keeps every case in the tier that marks name (CI's newest-torch leg runs the torch-facing
    quick tests so, as before this rule)."""
    if os.environ.get("AUTOTP_EVERY_CASE") == "1":
        return
    kept: set[tuple[str, str]] = set()
    for item in items:
        if getattr(item, "callspec", None) is None or item.get_closest_marker("slow"):
            continue
        test = (str(item.path), getattr(item, "originalname", item.name))
        if test in kept:
            item.add_marker(pytest.mark.slow)
        else:
            kept.add(test)
