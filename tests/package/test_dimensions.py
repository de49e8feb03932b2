"""A parallel dimension is one unit (`autotp.runtime.dimension.Dimension`): lasting checks on the source.

- No module outside a dimension's own package branches on that dimension's state: the gradient sync, norm, FSDP, the
  DDP guard, saving, exporting and the Trainer loop over `TPState.dims` instead (`state.ep` / `state.context` were
  the branches).
- Every package with a `dimension` module is listed once by `parallelize`, in the pipeline's order.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

import autotp
import autotp.parallelize as pipeline
from autotp.mesh import AXES, EXPERT_AXES
from autotp.runtime.dimension import Dimension
from autotp.state import TPState

PACKAGE = Path(autotp.__file__).parent
ROOT = PACKAGE.parent
BRANCH = re.compile(r"\bstate\.(ep|context)\b|\bautotp_state\.(ep|context)\b")


def test_no_module_branches_on_a_dimension_outside_its_package() -> None:
    files = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").rglob("*.py")]
    found = [
        f"{f.relative_to(ROOT)}:{n}"
        for f in files
        if f.relative_to(ROOT).parts[:2] not in (("autotp", "ep"), ("autotp", "cp")) and f != Path(__file__)
        for n, line in enumerate(f.read_text().splitlines(), 1)
        if BRANCH.search(line)
    ]
    assert found == [], "loop over TPState.dims (autotp.runtime.dimension) instead of branching on one dimension"
    fields = set(TPState.__dataclass_fields__)
    assert {"ep", "context"} & fields == set() and "dims" in fields


def test_every_dimension_names_its_axis_and_is_a_pipeline_line() -> None:
    dims = pipeline.dimensions()
    names = [dim.name for dim in dims]
    packages = sorted(f.parent.name for f in PACKAGE.glob("*/dimension.py") if f.parent.name != "runtime")
    assert sorted(names) == packages, "a package's Dimension is one line of autotp.parallelize.parallelisms"
    assert names[:3] == ["tp", "vocab", "sp"] and names.index("ep") < names.index("cp")  # parallelize's docstring
    assert {"tp", "ep", "cp"} <= set(AXES) | set(EXPERT_AXES)  # those with groups of their own are mesh axes
    for dim in dims:
        assert type(dim).__module__.split(".")[1] == dim.name, f"{type(dim)} lives outside autotp/{dim.name}/"
    assert [type(d) for d in pipeline.dimensions()] == [type(d) for d in dims]  # new objects each wrap
    assert all(a is not b for a, b in zip(pipeline.dimensions(), dims))


def test_a_dimension_hook_does_nothing_by_default() -> None:
    """A dimension implements only its parts: every other hook leaves the operation as it is."""
    base, params = Dimension(), []
    assert base.apply(None, None, None) == [] and base.split_plan(None, "plan", None) == ("plan", (), None)
    assert base.before_load(None, None) == () and base.owned(None) is None and base.collect(None, {}, None) is None
    assert base.norm(params, 2.0, None) == (params, None) and base.fully_shard({}, None) == {}
    assert base.split_group() is None and base.layout() == {} and base.allows_ddp
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
