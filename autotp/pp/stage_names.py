"""A training checkpoint under a pipeline: each rank saves and loads only what its stages own.

Each stage holds its own layers, the embedding on the first stage and the final norm and the head on the last
(`autotp.pp.release` frees the others; a tied head keeps the embedding's weight). `autotp.pp.cut.owner` names the stage that trains and saves each
tensor: a rank saves (and loads) the tensors its stages own, and the optimizer state of the parameters it trains,
each under its full name, so the checkpoint holds the keys one process's holds, each once, and any layout (another
pp, another cut, one process) reads it. A tied embedding is one process's two names of one weight: the first stage
saves it as the embedding, the last as the head, and both load it with its optimizer state. The pipeline's `owned`
hook (`autotp.runtime.dimension.Part`), which `autotp.io.checkpoint` calls.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ..mesh import Group, named_failure
from .cut import Cut, owner, trainers


class StageNames:
    """The names this rank's `stages` own of `model`, cut at `cut` into the stages of a pipeline of `pp` ranks."""

    def __init__(self, model: nn.Module, cut: Cut, stages: list[int], pp: int):
        self.model, self.cut, self.stages, self.pp = model, cut, stages, pp
        self.stage, self.mine = owner(model, cut), set(stages)
        self.where, self.whole = f"under a pipeline (pp_size={pp})", "pp_size=1"

    def holds(self, name: str) -> bool:
        """Whether this rank saves and loads the tensor of that state-dict name."""
        return self.stage(name) in self.mine

    def elsewhere(self, name: str) -> bool:
        """Whether a saved name is another stage's: in a layer another stage runs (absent here), or outside the layers
        and owned by another stage. A loader checks the rest against the model."""
        cut = self.cut
        others, root = cut.prefixes(self.stages), f"{cut.base}.{cut.layers}." if cut.base else f"{cut.layers}."
        return name.startswith(others) or (not name.startswith(root) and not self.holds(name))

    def trained(self, names: list[list[str]]) -> list[list[str]]:
        """The parameters of each optimizer group (by `optimizer_names`) whose state this rank loads: those it trains,
        that is any of whose names its stages own (the last stage trains a tied embedding under the head's name)."""
        by_id, params = trainers(self.model, self.cut), dict(self.model.named_parameters())
        return [[n for n in group if by_id[id(params[n])].intersection(self.stages)] for group in names]

    def optimizer_names(self, names: list[list[str]], group: Group) -> list[list[str]]:
        """The optimizer's parameter names as one process's optimizer holds them, for the checkpoint's record: each
        rank's own (`names` its stages own) gathered over `group` (the world) and put in stage order."""
        mine = [[(self.stage(n), n) for n in g if self.holds(n)] for g in names]
        every: list[list[list[tuple[int, str]]]] = [[] for _ in range(dist.get_world_size())]
        assert group is not None  # always: a pipeline runs under torch.distributed
        with named_failure(group, "autotp.save_checkpoint's gather of the optimizer's parameter names over the stages"):
            dist.all_gather_object(every, mine, group=group)
        counts = sorted({len(groups) for groups in every})
        if len(counts) > 1:
            raise ValueError(
                f"autotp.save_checkpoint at pp_size={self.pp}: the "
                f"optimizers of the ranks hold {counts} parameter groups; each stage's optimizer must hold the same "
                f"groups (as one process's, built the same way on every rank), so that they name one optimizer"
            )
        merged = []
        for index in range(counts[0]):
            pairs = dict.fromkeys(pair for groups in every for pair in groups[index])  # replicas and TP ranks: once
            merged.append([n for _, n in sorted(pairs, key=lambda pair: pair[0])])  # stable: each stage's own order
        return merged
