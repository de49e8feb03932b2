"""A parallel dimension is one unit (`autotp.runtime.dimension.Dimension`): lasting checks on the source.

- Outside its own package and the modules that list every dimension by design, no module names a dimension as code:
  its options, its accessors, its group on the state or the mesh, its class, `dims["pp"]`, `group(model, "pp")`
  (strings and comments left out; `dimension_names` derives them from the code). What remains is a short allow-list,
  each line with its reason. The gradient sync, norm, FSDP, the DDP guard, saving, exporting and the Trainer loop
  over `TPState.dims` instead.
- Every package with a `dimension` module is listed once by `autotp.parallelize.steps`, in its order.
- CONTRIBUTING.md lists every member of the `Dimension` class, and docs/architecture.md's diagram numbers the steps
  in `autotp.parallelize`'s order.
"""

from __future__ import annotations

import ast
import inspect
import re
from dataclasses import fields
from pathlib import Path

import torch

import autotp
import autotp.accessors as accessors
import autotp.parallelize as parallelize
from autotp.mesh import AXES, EXPERT_AXES, Mesh
from autotp.options import WrapOptions
from autotp.runtime.dimension import Dimension
from autotp.state import TPState

PACKAGE = Path(autotp.__file__).parent
ROOT = PACKAGE.parent
# The modules that list every dimension by design: the options, the mesh's axes, the accessors of each axis, the CLI's
# flags, the public names, the steps in order, and the state's groups by axis.
LISTING = ("options.py", "mesh.py", "accessors.py", "cli.py", "__init__.py", "parallelize.py", "state.py")
# Tensor parallelism is the base every dimension extends (its group is every layer's); not counted.
BASE = "tp"

# The lines left, as "module (axis): the line's code" (without its comment), each with its reason; at most 4 lines.
PLANNER = (
    "the planner decides whether a plan has a vocab part (planning is below the dimensions): autotp.build_plan's "
    "argument, and plan_for, which passes wrap's options to it"
)
ALLOWED: dict[str, str] = {
    "planning/planner.py (vocab): vocab_parallel: bool = True,": PLANNER,
    "planning/planner.py (vocab): if not vocab_parallel:": PLANNER,
    "planning/planner.py (vocab): return build_plan(model, tp_size, options.policy, options.vocab_parallel or "
    "split_vocab, options.example_inputs)": PLANNER,
}

BRANCH = re.compile(r"\bstate\.(ep|context)\b|\bautotp_state\.(ep|context)\b")


def test_no_module_branches_on_the_old_dimension_fields() -> None:
    """`state.ep` / `state.context` were the per-dimension branches before `TPState.dims` (tests too)."""
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    found = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in files
        if f.relative_to(ROOT).parts[:2] not in (("autotp", "ep"), ("autotp", "cp")) and f != Path(__file__)
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if BRANCH.search(line)
    ]
    assert found == [], "loop over TPState.dims (autotp.runtime.dimension) instead of branching on one dimension"


def axis_functions() -> set[str]:
    """The functions and `Mesh` methods that take axes by name (`group(model, "pp")`, `mesh.size("cp")`)."""
    owners = [vars(accessors).items(), vars(Mesh).items()]
    return {
        name
        for items in owners
        for name, value in items
        if callable(value) and any(p.kind is p.VAR_POSITIONAL for p in inspect.signature(value).parameters.values())
    }


def dimension_names(dimension: Dimension) -> tuple[set[str], set[str]]:
    """The identifiers that name `dimension` as code, from the code: its `WrapOptions` fields (`pp_size`,
    `pp_schedule`), its accessors (`pp_group`), its class; and the attributes that hold its group (`state.cp_group`,
    `mesh.cp`)."""
    axis, prefix = dimension.name, dimension.name + "_"
    names = {f.name for f in fields(WrapOptions) if f.name.startswith(prefix)} | {type(dimension).__name__}
    names |= {name for name, value in vars(accessors).items() if name.startswith(prefix) and callable(value)}
    attributes = {name for owner in (TPState, Mesh) for name in dir(owner) if name == axis or name.startswith(prefix)}
    return names, names | attributes


def _text(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def code_names(tree: ast.AST, calls: set[str]) -> dict[tuple[str, str], set[int]]:
    """Each name in `tree`'s code, by kind, with its lines: ("id", identifier), ("attr", attribute), and ("axis",
    string) for an axis looked up by name (`state.dims["pp"]`, `state.dims.get("pp")`, `group(model, "pp")`, a
    call of `calls`); strings and comments otherwise left out."""
    found: dict[tuple[str, str], set[int]] = {}
    for node in ast.walk(tree):
        keys: list[tuple[str, str]] = []
        if isinstance(node, ast.Name):
            keys = [("id", node.id)]
        elif isinstance(node, ast.arg | ast.keyword) and node.arg:
            keys = [("id", node.arg)]
        elif isinstance(node, ast.alias):
            keys = [("id", node.name)]
        elif isinstance(node, ast.Attribute):
            keys = [("attr", node.attr)]
        elif isinstance(node, ast.Subscript) and _text(node.value).endswith("dims"):
            keys = [("axis", node.slice.value)] if isinstance(node.slice, ast.Constant) else []
        elif isinstance(node, ast.Call) and (
            _text(node.func) in calls
            or _text(node.func) == "get"
            and _text(getattr(node.func, "value", node)).endswith("dims")
        ):
            keys = [("axis", a.value) for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        line = node.value.lineno if isinstance(node, ast.keyword) else getattr(node, "lineno", 0)
        for key in keys:
            found.setdefault(key, set()).add(line)
    return found


def named_lines(code: dict[tuple[str, str], set[int]], axis: str, names: set[str], attributes: set[str]) -> set[int]:
    """The lines whose code (`code_names`) names the dimension `axis`."""
    keys = [("id", n) for n in names] + [("attr", n) for n in attributes] + [("axis", axis)]
    return set().union(*(code.get(key, set()) for key in keys))


def dimension_lines() -> dict[str, list[int]]:
    """Every line naming a dimension outside its package and the listing modules, as "module (axis): code" (the code
    without its comment) -> its line numbers."""
    calls, found = axis_functions(), {}
    sources = {f.relative_to(PACKAGE): f.read_text() for f in sorted(PACKAGE.rglob("*.py"))}
    codes = {
        path: code_names(ast.parse(source), calls)
        for path, source in sources.items()
        if path.name not in LISTING or path.parent.name  # the listing modules are autotp/*.py
    }
    for dimension in parallelize.dimensions():
        if dimension.name == BASE:
            continue
        names, attributes = dimension_names(dimension)
        for path, code in codes.items():
            if path.parts[0] == dimension.name:
                continue
            lines = sources[path].splitlines()
            for n in sorted(named_lines(code, dimension.name, names, attributes)):
                code_line = lines[n - 1].split("  # ")[0].strip()
                found.setdefault(f"{path.as_posix()} ({dimension.name}): {code_line}", []).append(n)
    return found


def test_no_module_names_a_dimension_outside_its_package() -> None:
    found = dimension_lines()
    listed = ALLOWED
    new = [f"{key} (line {', '.join(map(str, lines))})" for key, lines in found.items() if key not in listed]
    assert new == [], (
        "a dimension named outside its package: move the behaviour behind a hook of autotp.runtime.dimension."
        "Dimension (and loop over TPState.dims), or allow the line here with its reason:\n" + "\n".join(new)
    )
    assert [key for key in listed if key not in found] == [], "an allowed line no longer exists: delete its entry"
    assert sum(len(found[key]) for key in ALLOWED) <= 4, "at most 4 lines across all dimensions (issue 50)"
    assert all(ALLOWED.values())


def test_the_count_sees_each_kind_of_name() -> None:
    """The counter finds each form the issue names, and not the same words in strings or comments."""
    source = """
from ..accessors import pp_size
def f(model, state, options, pp_group):
    a = state.dims["pp"] or state.dims.get("pp") or state.dim(PipelineParallelism)
    b = group(model, "pp"), state.mesh.size("pp"), options.pp_schedule, wrap(model, pp_size=2)
    c = "pp_size" + f"{x} pp" # pp_size
    return plan.vocab, state.cp_group, state.mesh.cp, config.vocab_size, cp, dims["vocab"]
"""
    pp = next(d for d in parallelize.dimensions() if d.name == "pp")
    code = code_names(ast.parse(source), axis_functions())
    names, attributes = dimension_names(pp)
    assert {"pp_size", "pp_group", "pp_schedule", "PipelineParallelism"} <= names
    assert named_lines(code, "pp", names, attributes) == {2, 3, 4, 5}
    cp = next(d for d in parallelize.dimensions() if d.name == "cp")
    assert named_lines(code, "cp", *dimension_names(cp)) == {7}
    vocab = next(d for d in parallelize.dimensions() if d.name == "vocab")
    assert named_lines(code, "vocab", *dimension_names(vocab)) == {7}


def test_every_dimension_names_its_axis_and_is_a_step() -> None:
    dims = parallelize.dimensions()
    names = [dim.name for dim in dims]
    packages = sorted(f.parent.name for f in PACKAGE.glob("*/dimension.py") if f.parent.name != "runtime")
    assert sorted(names) == packages, "a package's Dimension is one line of autotp.parallelize.steps"
    assert names[:3] == ["tp", "vocab", "sp"] and names.index("ep") < names.index("cp")  # parallelize's docstring
    assert {"tp", "ep", "cp"} <= set(AXES) | set(EXPERT_AXES)  # those with groups of their own are mesh axes
    for dim in dims:
        assert type(dim).__module__.split(".")[1] == dim.name, f"{type(dim)} lives outside autotp/{dim.name}/"
    assert [type(d) for d in parallelize.dimensions()] == [type(d) for d in dims]  # new objects each wrap
    assert all(a is not b for a, b in zip(parallelize.dimensions(), dims))
    fields = set(TPState.__dataclass_fields__)
    assert {"ep", "context"} & fields == set() and "dims" in fields  # the old per-dimension branches stay gone


def test_a_dimension_hook_does_nothing_by_default() -> None:
    """A dimension implements only its parts: every other hook leaves the operation as it is."""
    base, params = Dimension(), []
    assert base.apply(None, None, None) == [] and base.split_plan(None, "plan", None) == ("plan", (), None)
    assert base.before_load(None, None) == () and base.owned(None) is None and base.collect(None, {}, None) is None
    assert base.norm(params, 2.0, None) == (params, None) and base.fully_shard({}, None) == {}
    assert base.split_group() is None and base.batch_group() is None and base.layout() == {} and base.allows_ddp
    assert not base.splits_sequence and base.sequence_length(7) == 7
    total = torch.ones(())
    assert base.reduce_norm(total, 2.0, None) is total
    for hook in (
        base.refuse(None, None, None),
        base.sync_gradients(None, None, 1, True),
        base.check_ddp(None, None),
        base.broadcast_replicas(None, None),
        base.refuse_export(None),
        base.after_wrap(None, None, frozenset()),
    ):
        assert hook is None


def test_contributing_lists_every_member_of_the_protocol() -> None:
    """CONTRIBUTING's list of what a dimension may override is the `Dimension` class's members, read from it."""
    section = (ROOT / "CONTRIBUTING.md").read_text().split("## Add a parallel dimension")[1].split("\n## ")[0]
    listed = [
        name for item in re.findall(r"^- (`\w+`[^:]*):", section, flags=re.M) for name in re.findall(r"`(\w+)`", item)
    ]
    members = [name for name in vars(Dimension) if not name.startswith("_") and name != "name"]
    assert sorted(listed) == sorted(members), "list each member of autotp.runtime.dimension.Dimension in CONTRIBUTING"
    assert len(listed) == len(set(listed))


def test_the_architecture_diagram_has_parallelizes_steps_in_order() -> None:
    """docs/architecture.md's diagram numbers the steps as `autotp.parallelize` runs them."""
    diagram = (ROOT / "docs" / "architecture.md").read_text().split("```mermaid")[1].split("```")[0]
    drawn = sorted((int(n), name) for n, name in re.findall(r"\bs\d+\[(\d+) (\w+)", diagram))
    steps = [
        "materialize" if isinstance(step, parallelize.Materialize) else type(step).__name__
        for step in parallelize.steps()
    ]
    assert [name for _, name in drawn] == steps + [f.__name__ for f in parallelize.integrations()]
    assert [n for n, _ in drawn] == list(range(1, len(drawn) + 1))
