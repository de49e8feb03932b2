"""A recurrent state the model holds whole and passes to a sharded mixer (RWKV's list of tensors): the mixer gets
views of this rank's channels, and its layer's slice is gathered back whole after it.

Why views and a gather: the model allocates the state from its config (every channel), and the mixer writes its
layer's slice in place. On the views it reads and writes only its own channels; the gather then fills the others'
channels, so the state the model returns (and `generate` feeds back) equals one process's on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from ..mesh import Group
from ..planning.plan import MixerState
from ..runtime.collectives import all_gather_full


class StateChannels:
    """The hooks of one mixer: its state's items narrowed to this rank's channels, and gathered back after it."""

    def __init__(self, module: nn.Module, plan: MixerState, group: Group, rank: int, state):
        self.plan, self.group = plan, group
        ((self.start, self.length),) = plan.partition.runs[rank]  # one run: the channels are a plain "w" layout
        self.passed: tuple[list, list] | None = None  # (the model's list, the narrowed one) while the mixer runs
        module.register_forward_pre_hook(state.sharded_only(self._narrow), with_kwargs=True)
        module.register_forward_hook(state.sharded_only(self._gather))

    def _narrow(self, module, args, kwargs):
        self.passed = None  # a forward that raised left its own
        whole = kwargs.get(self.plan.arg)
        if whole is None:
            return None
        dim = self.plan.partition.dim
        local = list(whole)
        for item in self.plan.items:
            local[item] = whole[item].narrow(dim, self.start, self.length)
        self.passed = (whole, local)
        kwargs[self.plan.arg] = local
        return args, kwargs

    def _gather(self, module, args, output):
        if self.passed is None:
            return None
        (whole, local), self.passed = self.passed, None
        layer = getattr(module, self.plan.layer)
        with torch.no_grad():
            for item in self.plan.items:
                mine = whole[item].select(-1, layer)  # batch x channels: dim stays the channel dim
                mine.copy_(
                    all_gather_full(
                        mine.narrow(self.plan.partition.dim, self.start, self.length), self.plan.partition, self.group
                    )
                )
        if isinstance(output, tuple):
            return tuple(whole if o is local else o for o in output)
        return output
