"""Imports flow one way: every autotp module imports only from its own layer or the layers below.

The layers are read from the package docstring, so the documented architecture and this check
cannot drift apart. Every import counts, those inside functions included.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import autotp

PACKAGE = Path(autotp.__file__).parent


def layers() -> dict[str, int]:
    """Module name (relative to autotp, dotted) -> layer number, from the numbered list in autotp's docstring."""
    out: dict[str, int] = {}
    for number, text in re.findall(r"^(\d+)\. (.*(?:\n   .*)*)", autotp.__doc__, flags=re.M):
        for name in re.findall(r"`([\w.]+)`", text):
            assert name not in out, f"{name} is listed in two layers"
            out[name] = int(number)
    return out


def modules() -> dict[str, Path]:
    """Every module file of the package, by dotted name relative to autotp (a package is its __init__)."""
    out = {}
    for file in PACKAGE.rglob("*.py"):
        parts = file.relative_to(PACKAGE).with_suffix("").parts
        if parts[-1] == "__init__" and len(parts) > 1:
            parts = parts[:-1]
        out[".".join(parts)] = file
    return out


def imports(name: str, file: Path, known: set[str]) -> set[str]:
    """The autotp modules `name` imports anywhere in its file (function bodies included)."""
    package = name.split(".")[:-1] if file.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package = []
    found: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and node.module.split(".")[0] == "autotp":
                base = node.module.split(".")[1:]
            else:
                continue
            target = ".".join(base)
            if target in known:
                found.add(target)
            for alias in node.names:  # `from . import parity` names a module
                if f"{target}.{alias.name}".strip(".") in known:
                    found.add(f"{target}.{alias.name}".strip("."))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "autotp" and ".".join(parts[1:]) in known:
                    found.add(".".join(parts[1:]))
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    files = modules()
    return {name: imports(name, file, set(files)) for name, file in files.items()}


def test_every_module_is_in_exactly_one_documented_layer() -> None:
    documented, present = layers(), set(modules())
    assert present - set(documented) == set(), "modules missing from autotp's layer list"
    assert set(documented) - present == set(), "the layer list names modules that do not exist"


def test_no_upward_import() -> None:
    layer = layers()
    upward = [
        f"{a} (layer {layer[a]}) imports {b} (layer {layer[b]})"
        for a, targets in graph().items()
        for b in targets
        if layer[b] > layer[a]
    ]
    assert upward == []


def test_no_import_cycle() -> None:
    edges = graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt) :] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    layer = layers()
    for number in sorted(set(layer.values())):
        names = sorted(n for n in layer if layer[n] == number)
        print(f"layer {number}: " + ", ".join(f"{n} <- {sorted(edges[n])}" for n in names))


DIMENSIONS = ("tp", "vocab", "sp", "cp", "dp", "ep")  # one package per parallelism dimension
BASE = "tp"  # the layers every other dimension extends (the vocab head is a column layer; SP splits around them)
SHARED = ("mesh", "state", "options", "runtime", "planning", "compat")


def test_dimensions_meet_only_through_the_mesh_runtime_and_state() -> None:
    """A dimension can be read, and removed, alone: it imports no other dimension (only tp, the base), and the
    shared tiers import none."""
    crossing = []
    for a, targets in graph().items():
        home = a.split(".")[0]
        for b in targets:
            there = b.split(".")[0]
            if there in DIMENSIONS and there != home and (home in SHARED or (home in DIMENSIONS and there != BASE)):
                crossing.append(f"{a} imports {b}")
    assert crossing == []
