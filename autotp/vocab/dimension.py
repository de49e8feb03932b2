"""Vocabulary parallelism as a `Dimension` (`autotp.runtime.dimension`): the LM head and embedding by vocabulary."""

from __future__ import annotations

from torch import nn

from ..planning.plan import Plan
from ..runtime.dimension import Dimension
from ..runtime.rollback import Removable
from ..state import TPState
from .apply import vocab_parallel


class VocabParallelism(Dimension):
    """Over the TP group; active when the plan splits the vocabulary. Its hooks are in `state.vocab_hooks`."""

    name = "vocab"

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        vocab_parallel(model, state.plan, state)
        if state.plan.vocab is not None:
            state.dims[self.name] = self
        return []
