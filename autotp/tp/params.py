"""What a sharded block computes beside its linears: an expert bias counted once, and norms over a split width
computed exactly (a per-head parameter, gpt-oss's attention sinks, is split with its heads in place: `tp.inplace`).

An expert's output bias (gpt-oss's `down_proj_bias`) is added inside
the experts module, before the TP sum of the partial outputs: every rank keeps it whole, and every rank but the
first takes its routed contribution back out, detached from the bias, so the sum holds it once while every rank's
bias gradient is the whole one (each rank sees the same output gradient and routing weights).
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from ..mesh import Group
from ..runtime.collectives import copy_to_tp, reduce_from_tp


def routed_bias(module: nn.Module, name: str, args: tuple, kwargs: dict) -> torch.Tensor:
    """Each token's sum of its routed experts' `name` bias rows, weighted as the experts' outputs are, with the bias
    detached: `experts(hidden_states, top_k_index, top_k_weights)`, transformers' experts signature."""
    bound = inspect.signature(module.forward).bind(*args, **kwargs).arguments
    _, index, weights = list(bound.values())[:3]
    bias = getattr(module, name).detach()
    valid = index < bias.shape[0]  # an index past the last expert masks a slot (gpt-oss skips it)
    rows = bias[index.clamp(max=bias.shape[0] - 1)] * (weights * valid)[..., None]
    return rows.sum(-2)


class ShardedNorm:
    """A norm over a width TP splits, exact: the module runs on this rank's columns, then its output is rescaled from
    its own columns' statistic to the whole row's (the `stat`, mean or sum, of x^2 all-reduced). RMS and L2 norms
    scale each row by rsqrt(stat + eps), whatever their weight does, so the ratio is exact for either."""

    def __init__(self, module: nn.Module, stat: str, width: int, group: Group, state):
        self.stat, self.width, self.group = stat, width, group
        self.eps = next(getattr(module, n) for n in ("variance_epsilon", "eps", "epsilon") if hasattr(module, n))
        module.register_forward_hook(state.sharded_only(self._rescale))

    def _rescale(self, module, args, output):
        x = args[0].float()
        local = x.pow(2).sum(-1, keepdim=True)
        # forward: the all-reduced sum; backward: every rank's part of its gradient summed (the clone: reduce_from_tp
        # sums in place, and copy_to_tp returns its input)
        whole = reduce_from_tp(copy_to_tp(local, self.group).clone(), self.group)
        if self.stat == "mean":
            local, whole = local / x.shape[-1], whole / self.width
        return output * (torch.sqrt(local + self.eps) * torch.rsqrt(whole + self.eps)).to(output.dtype)
