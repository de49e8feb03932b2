"""The toy dimension `tests/package/test_toy_dimension.py` adds to a copy of autotp, and what it runs with it.

`EDITS` are the edits beside the package itself, each an (anchor, text inserted after it) in one file: the list
CONTRIBUTING.md gives for a new dimension. Run as a script on that copy: wrap, a training step, save and resume at
2 ranks with the toy's option given; prints the ranks' reports as JSON.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

PACKAGE = {
    "autotp/toy/__init__.py": '"""A do-nothing dimension (tests/package/test_toy_dimension.py)."""\n',
    "autotp/toy/dimension.py": '''"""The toy `Dimension`: active at every size, it records itself and its layout, and changes nothing else."""

from __future__ import annotations

from torch import nn

from ..planning.plan import Plan
from ..runtime.dimension import Dimension
from ..runtime.rollback import Removable
from ..state import TPState


class ToyParallelism(Dimension):
    name = "toy"

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        state.dims[self.name] = self
        self.size = state.options.toy_size
        return []

    def layout(self) -> dict[str, int]:
        return {"toy_size": self.size}
''',
}
EDITS = {
    "autotp/options.py": [
        ("    pp_size: int = 1\n", "    toy_size: int = 1\n"),  # WrapOptions' field
        ("    pp_size: int\n", "    toy_size: int\n"),  # WrapKwargs' key
    ],
    "autotp/mesh.py": [
        (
            '    "pp": Axis("dense", "pipeline parallel", "PP", ("pp",)),\n',
            '    "toy": Axis("dense", "toy", "TOY", ("toy",)),\n',
        )
    ],
    "autotp/parallelize.py": [
        ("from .tp.float8 import scale_over_dp\n", "from .toy.dimension import ToyParallelism\n"),
        ("        PipelineParallelism(),\n", "        ToyParallelism(),\n"),
    ],
}


def run(rank: int, world: int, directory: str) -> dict:
    import torch

    import autotp
    from models import batch, tiny_model

    reference = tiny_model("llama")
    model = autotp.wrap(copy.deepcopy(reference), 2, toy_size=1)
    ids = batch()
    losses = []
    for m in (reference, model):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        if m is model:
            autotp.allreduce_gradients(m)
            autotp.clip_grad_norm_(m, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    autotp.save_checkpoint(directory, model, optimizer, step=1)
    resumed = autotp.wrap(tiny_model("llama", seed=1), 2, toy_size=1)
    user = autotp.load_checkpoint(directory, resumed, torch.optim.AdamW(resumed.parameters(), lr=1e-3))
    trained, loaded = model.state_dict(), resumed.state_dict()
    return {
        "autotp": autotp.__file__,
        "dims": list(model.autotp_state.dims),
        "toy_group": autotp.group(model, "toy") is None and autotp.size(model, "toy") == 1,
        "loss": losses,
        "resumed": user == {"step": 1} and all(torch.equal(trained[k], loaded[k]) for k in trained),
        "saved": json.loads((Path(directory) / "autotp_checkpoint.json").read_text()).get("toy_size"),
    }


if __name__ == "__main__":
    from autotp.testing import run_ranks

    print(json.dumps(run_ranks(run, 2, sys.argv[1])))
