"""The suite's own rules: test modules never import each other (shared helpers live in tests/conftest.py,
tests/models.py, a helper module beside the tests of one package such as tests/cp/cp_workers.py, or
`autotp.testing`), every test runs under a timeout, and the quick/slow tiers are registered."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
PYPROJECT = TESTS.parent / "pyproject.toml"
TEST_MODULES = sorted(TESTS.rglob("test_*.py"))


def imported_modules(path: Path) -> list[str]:
    """Every module `path` imports, at any depth (function-local imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
    return names


def test_the_check_sees_test_modules_and_their_imports() -> None:
    assert len(TEST_MODULES) > 20 and Path(__file__).resolve() in TEST_MODULES
    source = TESTS / "models.py"
    assert "torch" in imported_modules(source) and "autotp.testing" in imported_modules(source)


@pytest.mark.parametrize("path", TEST_MODULES, ids=lambda p: str(p.relative_to(TESTS)))
def test_no_test_module_imports_another(path: Path) -> None:
    others = [name for name in imported_modules(path) if name.split(".")[0].startswith("test_")]
    assert not others, (
        f"{path.name} imports the test module(s) {others}: move what it needs to tests/models.py, "
        f"a helper module beside its package's tests (tests/cp/cp_workers.py), a conftest.py fixture, "
        f"or autotp.testing"
    )


def ini_options() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["pytest"]["ini_options"]


def test_every_test_runs_under_the_global_timeout(pytestconfig: pytest.Config) -> None:
    """pytest-timeout's `timeout = 300` in pyproject.toml bounds every test that does not set its own (a test hung
    in a collective otherwise waits forever); per-test marks may only lower it, never switch it off (0)."""
    assert ini_options()["timeout"] == 300
    assert float(pytestconfig.getini("timeout")) == 300, "pytest-timeout is not installed or not reading pyproject"
    for path in TEST_MODULES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "pytest.mark.timeout":
                (seconds,) = [ast.literal_eval(arg) for arg in node.args] or [node.keywords[0].value.value]
                assert 0 < seconds <= 300, f"{path.name}:{node.lineno}: timeout({seconds})"


def test_the_quick_and_slow_tiers_are_registered() -> None:
    markers = [line.split(":")[0] for line in ini_options()["markers"]]
    assert {"gpu", "slow"} <= set(markers), markers
