"""The package stays small-moduled and encapsulated: lasting checks on the source, not on behaviour.

- No module of `autotp/` exceeds 400 lines: split a module when it grows past the cap.
- No autotp module reads another autotp module's private attribute (`obj._x` where `_x` is set or defined in
  another module) or imports its private names; the `autotp/compat/` boundaries are exempt, since touching
  privates is what they are for (of the dependencies, not of autotp).
- No autotp module sets another autotp module's global (`collectives.X = f`): a hook one module installs in
  another is an upward dependency the import check cannot see; pass it as an argument.
- docs/architecture.md names every module, so the map a newcomer reads cannot fall behind the package.
- Every dotted `autotp.x.y` the package's source or docs/ names resolves, so a moved module leaves no stale name.
- Gathered mode has one mechanism: `.gathered` is read only in `state.py` (which owns it) and
  `tp/apply.py` (which switches it); hooks go through `TPState.sharded_only`.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import tomllib
from pathlib import Path

from torch import nn

import autotp

PACKAGE = Path(autotp.__file__).parent
MAX_LINES = 400
TORCH_MODULE = set(vars(nn.Module())) | set(dir(nn.Module))  # torch's `_modules`, `_parameters`, ...: not ours


def sources() -> dict[str, ast.Module]:
    return {str(f.relative_to(PACKAGE)): ast.parse(f.read_text()) for f in sorted(PACKAGE.rglob("*.py"))}


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def defined_privates(tree: ast.Module) -> set[str]:
    """Private names a module owns: attributes it assigns on `self`, methods, classes, functions and globals."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and private(node.name):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and private(node.attr):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and private(node.id):
            names.add(node.id)
    return names


def test_no_module_exceeds_the_line_cap() -> None:
    long = {
        name: n
        for name, n in ((str(f.relative_to(PACKAGE)), len(f.read_text().splitlines())) for f in PACKAGE.rglob("*.py"))
        if n > MAX_LINES
    }
    assert long == {}, f"split these modules (cap {MAX_LINES} lines): {long}"


def test_no_module_reads_another_modules_private_attributes() -> None:
    trees = sources()
    owners: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for name in defined_privates(tree):
            owners.setdefault(name, set()).add(module)
    found = []
    for module, tree in trees.items():
        if module.startswith("compat/"):
            continue
        own = defined_privates(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and private(node.attr) and node.attr not in own | TORCH_MODULE:
                base = node.value
                if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                    continue
                others = owners.get(node.attr, set()) - {module}
                if others:
                    found.append(f"{module}:{node.lineno} reads .{node.attr}, owned by {sorted(others)}")
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("autotp")):
                found += [
                    f"{module}:{node.lineno} imports {alias.name} from {node.module}"
                    for alias in node.names
                    if private(alias.name)
                ]
    assert found == []


def test_no_module_sets_another_modules_globals() -> None:
    found = []
    for module, tree in sources().items():
        imported = {
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("autotp"))
            for alias in node.names
        }
        imported |= {
            (alias.asname or alias.name).split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if alias.name.startswith("autotp")
        }
        found += [
            f"{module}:{node.lineno} sets {ast.unparse(node)}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in imported
        ]
    assert found == [], "pass the value to the function that uses it instead of installing it in that module"


def test_gathered_mode_is_read_only_where_it_is_owned_and_switched() -> None:
    allowed = {"state.py", "tp/apply.py"}
    reads = [
        f"{module}:{node.lineno}"
        for module, tree in sources().items()
        if module not in allowed
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr == "gathered" and isinstance(node.ctx, ast.Load)
    ]
    assert reads == [], "use TPState.sharded_only for a hook, or TPState.is_gathered for a decision"


def test_the_architecture_page_names_every_module() -> None:
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`([\w.]+)`", page))
    dotted = {
        ".".join(f.relative_to(PACKAGE).with_suffix("").parts): f for f in PACKAGE.rglob("*.py") if f.stem != "__init__"
    }  # by dotted path: `tp.apply`, `vocab.apply` and `cp.apply` are three modules
    missing = sorted(name for name in dotted if name not in named)
    assert missing == [], f"docs/architecture.md's module table lacks {missing}"


def resolves(dotted: str) -> bool:
    """Whether `autotp.x.y...` is a module or an attribute reachable from one."""
    found: object = autotp
    parts = dotted.split(".")[1:]
    for i, part in enumerate(parts):
        if hasattr(found, part):
            found = getattr(found, part)
            continue
        module = ".".join(["autotp", *parts[: i + 1]])
        try:
            found = importlib.import_module(module)
        except ImportError:  # a short name reaches the vLLM modules too: they exist here, but import vLLM
            return i == len(parts) - 1 and importlib.util.find_spec(module) is not None
    return True


def named_in(text: str) -> set[str]:
    """The autotp names a text gives: full `autotp.x.y` paths, and short ones in backticks that start at one of the
    package's sub-packages (`ep.dispatch`, `io.rollout.export`), read as `autotp.` + the name."""
    packages = {d.name for d in PACKAGE.iterdir() if (d / "__init__.py").is_file()}
    short = {f"autotp.{name}" for name in re.findall(r"`(\w+(?:\.\w+)+)", text) if name.split(".")[0] in packages}
    return set(re.findall(r"\bautotp(?:\.\w+)+", text)) | short


def test_every_autotp_name_in_the_source_and_docs_resolves() -> None:
    files = [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "docs").glob("*.md"), PACKAGE.parent / "CONTRIBUTING.md"]
    stale = sorted(
        {
            f"{f.relative_to(PACKAGE.parent)}: {name}"
            for f in files
            for name in named_in(f.read_text())
            if not resolves(name)
        }
    )
    assert stale == [], "name the module where it lives now"


def test_short_dotted_names_resolve_too() -> None:
    """A short name is checked like a full one: a stale `ep.dispatch` fails as `autotp.ep.dispatch` would."""
    assert named_in("`ep.dispatch` and `io.rollout.export.export_weights`, not `model.config` or `x.y`") == {
        "autotp.ep.dispatch",
        "autotp.io.rollout.export.export_weights",
    }
    assert resolves("autotp.io.rollout.export") and not resolves("autotp.ep.no_such_module")


COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "gather_object",
    "scatter_object_list",
    "reduce",
}


def test_every_blocking_collective_goes_through_named_failure() -> None:
    """A failed or hung collective names its group's ranks and what to do (`autotp.mesh.named_failure`); posted
    isend / irecv are waited on inside it, so only blocking calls are checked here."""
    found = []
    for module, tree in sources().items():
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in COLLECTIVES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "dist"
            ):
                continue
            named, function, at = False, None, node
            while at in parents:
                at = parents[at]
                if isinstance(at, ast.With) and any(
                    isinstance(item.context_expr, ast.Call)
                    and getattr(item.context_expr.func, "id", None) == "named_failure"
                    for item in at.items
                ):
                    named = True
                if isinstance(at, (ast.FunctionDef, ast.AsyncFunctionDef)) and function is None:
                    function = at.name
            if not named:
                found.append(f"{module}:{node.lineno} dist.{node.func.attr} in {function}")
    assert found == [], "wrap these in autotp.mesh.named_failure"


def test_every_package_ships_in_the_wheel() -> None:
    """pyproject.toml lists the packages setuptools builds: a folder left out would be missing from the wheel (and a
    listed folder that is gone fails the install)."""
    listed = set(tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    present = {".".join(("autotp", *f.parent.relative_to(PACKAGE).parts)) for f in PACKAGE.rglob("__init__.py")}
    assert listed - {"autotp.policies"} == present
