"""`autotp.parallelize` runs its steps in the order its docstring gives (the order that says why: gradient hooks after
the parameters are final, CP after vocab parallelism's loss, the replica broadcast last), so the two cannot drift."""

from __future__ import annotations

import re
from pathlib import Path

import autotp.parallelize
from autotp.testing import run_ranks
from models import tiny_model


def documented_steps() -> list[str]:
    """The step named first in each numbered item of the module docstring."""
    return re.findall(r"^\d+\. `(\w+)`", autotp.parallelize.__doc__, flags=re.M)


def steps_run(rank: int, world: int, path: str) -> list[str]:
    import autotp
    import autotp.api as api
    import autotp.parallelize as parallelize

    seen: list[str] = []

    def spy(name, step):
        def run(*args, **kwargs):
            seen.append(name)
            return step(*args, **kwargs)

        return run

    for name in documented_steps():
        step = getattr(parallelize, name, None)
        if isinstance(step, type):  # a step object of `parallelize.steps`: its `apply`
            step.apply = spy(name, step.apply)
        elif step is not None:  # an integration
            setattr(parallelize, name, spy(name, step))
    real = api.parallelize
    api.parallelize = lambda model, plan, groups, options, materialize: real(
        model, plan, groups, options, spy("materialize", materialize)
    )
    autotp.from_pretrained(path, world, sequence_parallel=True, check_inputs=True)
    return seen


def test_steps_run_in_the_documented_order(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    documented = documented_steps()
    assert len(documented) == 14, documented
    for seen in run_ranks(steps_run, 2, str(tmp_path)):
        assert seen == documented
