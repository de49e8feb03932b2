"""`output_attentions=True` under TP: each sharded attention block computes its rank's heads only, so the attention
weights it returns are gathered, differentiably, into every head in order before the user sees them.

Transformers records the weights with hooks of its own (on the block or on a module inside it), so they are told
by identity: the block's hook notes the per-head tensors it returns, and the model's hook gathers those it finds in
the output's `*attentions` tuples (or a `return_dict=False` tuple's). Weights the model does not return (eager
attention computes them on every forward) are never gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .collectives import gather_from_tp
from .groups import Group
from ..planning.plan import HeadsPlan


class AttentionWeights:
    """The hooks: `note` on each sharded attention block (bound to its `HeadsPlan` and this rank's head count with
    `functools.partial`: a copy of the model then copies them), `gather_outputs` on the model (always called, so a
    forward that raised drops what it noted)."""

    def __init__(self, group: Group, state):
        self.group, self.state = group, state
        self.noted: dict[int, tuple[torch.Tensor, HeadsPlan]] = {}  # id -> (the tensor, kept so the id stays its own)

    def note(self, heads: HeadsPlan, count: int, module: nn.Module, args, output) -> None:
        """A block's forward hook: note the per-head tensors ([batch, `count` heads, ...]) in its tuple output."""
        if not self.state.forwards or not isinstance(output, tuple):  # a block called alone: nothing to gather
            return
        for item in output[1:]:
            if torch.is_tensor(item) and item.ndim >= 3 and item.shape[1] == count:
                self.noted[id(item)] = (item, heads)

    def gather_outputs(self, module: nn.Module, args, kwargs, output) -> Any:
        """The model's output with every noted tensor in its attention tuples gathered over the heads."""
        try:
            if not self.noted or output is None:
                return None
            if isinstance(output, dict):  # a ModelOutput: attentions, cross_attentions, decoder_attentions...
                for key in [k for k in output.keys() if k.endswith("attentions")]:
                    output[key] = self._whole(output[key])
                return output
            if isinstance(output, tuple):
                return type(output)(self._whole(item) if isinstance(item, tuple) else item for item in output)
            return None
        finally:
            if self.state.forwards <= 1:  # the outermost forward: what it noted is done with
                self.noted.clear()

    def _whole(self, weights):
        if not isinstance(weights, tuple):
            return weights
        return tuple(self._gather(*self.noted[id(w)]) if torch.is_tensor(w) and id(w) in self.noted else w
                     for w in weights)

    def _gather(self, tensor: torch.Tensor, heads: HeadsPlan) -> torch.Tensor:
        return gather_from_tp(tensor, heads.partition(1), self.group)
