"""The docs stay true: their Python blocks run, their links resolve, the site builds strict, the README stays short.

Convention for the guides (docs/*.md): every fenced ```python block runs here, in a fresh namespace
of this process, unless the line just before its fence is an HTML comment

    <!-- not run: REASON -->

(MkDocs renders it invisibly). Use it only for blocks that cannot run on CPU in a test: they need
GPUs, several nodes, a real hub model path or a launcher. A runnable block must be self-contained:
a tiny model built from a config, at tp_size=1 in-process or on forked CPU ranks through
`autotp.testing.run_ranks`.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
NOT_RUN = re.compile(r"<!-- not run: \S.* -->")


def python_blocks() -> list[tuple[str, int, str | None, str]]:
    """(page, line of the fence, the not-run reason or None, code) for every ```python block in docs/."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                marker = NOT_RUN.fullmatch(lines[i - 1].strip()) if i else None
                found.append((page.name, i + 1, marker.group(0) if marker else None, "\n".join(lines[i + 1 : end])))
                i = end
            i += 1
    return found


RUNNABLE = [pytest.param(code, id=f"{page}:{line}") for page, line, reason, code in python_blocks() if reason is None]


def test_the_guides_have_runnable_blocks() -> None:
    """Guards the parser: a convention that silently matched nothing would pass every block."""
    assert len(RUNNABLE) >= 4, RUNNABLE


@pytest.mark.timeout(60)
@pytest.mark.parametrize("code", RUNNABLE)
def test_docs_python_block_runs(code: str) -> None:
    exec(compile(code, "<docs block>", "exec"), {"__name__": "__docs__"})


def test_supported_models_page_is_what_the_sweep_results_generate() -> None:
    """docs/supported-models.md and the README's support summary cannot drift from scripts/sweep_results*.json."""
    spec = importlib.util.spec_from_file_location("supported_models", ROOT / "scripts" / "supported_models.py")
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    fix = "run `python scripts/supported_models.py` and commit the result"
    assert (DOCS / "supported-models.md").read_text() == generator.render(), fix
    readme = (ROOT / "README.md").read_text()
    assert "<!-- support:start -->" in readme
    assert generator.readme_block(readme) == readme, fix


def test_readme_is_at_most_300_lines() -> None:
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_point_to_existing_files(page: Path) -> None:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code is not links
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    broken = [t for t in targets if not re.match(r"[a-z]+:|#", t) and not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.slow  # mkdocs (about 3 s); CI also runs `mkdocs build --strict` itself
@pytest.mark.timeout(120)
def test_mkdocs_build_is_strict_clean(tmp_path: Path) -> None:
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed: pip install -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's notice about its successor, not a build warning
    done = subprocess.run(
        [mkdocs, "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "WARNING" not in done.stderr, done.stderr[-3000:]
