"""`output_attentions=True` under TP: each sharded attention block computes its rank's heads only, so the attention
weights it returns are gathered, differentiably, into every head in order before the user sees them.

Transformers records the weights with hooks of its own (on the block or on a module inside it), so the block's
hook tags the per-head tensors it returns with their `HeadsPlan`, and a hook on the model (and on each model inside
it, which a user may call alone) gathers the tagged tensors it finds in the output's `*attentions` tuples, or in a
`return_dict=False` tuple. Weights that are not returned (eager attention computes them on every forward) are never
gathered.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..mesh import Group
from ..planning.plan import HeadsPlan
from ..runtime.collectives import gather_from_tp

_TAG = "autotp_heads"


def tag_heads(heads: HeadsPlan, count: int, module: nn.Module, args, output) -> None:
    """A sharded attention block's forward hook (bound to its plan and this rank's head count with
    `functools.partial`): tag the per-head tensors ([batch, `count` heads, ...]) in its tuple output."""
    if isinstance(output, tuple):
        for item in output[1:]:
            if torch.is_tensor(item) and item.ndim >= 3 and item.shape[1] == count:
                setattr(item, _TAG, heads)


class AttentionWeights:
    """The forward hook on a model: its returned attention weights with every head."""

    def __init__(self, group: Group):
        self.group = group

    def __call__(self, module: nn.Module, args, output) -> Any:
        if isinstance(output, dict):  # a ModelOutput: attentions, cross_attentions, decoder_attentions...
            for key in [k for k in output.keys() if k.endswith("attentions")]:
                output[key] = self._whole(output[key])
            return output
        if isinstance(output, tuple):
            return tuple(self._whole(item) if isinstance(item, tuple) else item for item in output)
        return None

    def _whole(self, weights):
        if not isinstance(weights, tuple):
            return weights
        return tuple(
            self._gather(w, getattr(w, _TAG)) if torch.is_tensor(w) and hasattr(w, _TAG) else w for w in weights
        )

    def _gather(self, tensor: torch.Tensor, heads: HeadsPlan) -> torch.Tensor:
        return gather_from_tp(tensor, heads.partition(1), self.group)
