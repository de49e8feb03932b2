"""A parameter that holds one rank's rows, tagged with its `Shard`, and swapped for the full tensor and back.

Every dimension that shards a parameter by rows (TP's linears and experts, the vocabulary) uses these, so
the partition metadata that gather, save and load read is written in one place.
"""

from __future__ import annotations

import torch
from torch import nn

from ..mesh import Group
from ..planning.sharding import Partition, Shard
from .collectives import all_gather_full


def shard_parameter(param: nn.Parameter, partition: Partition, rank: int) -> nn.Parameter:
    """A new Parameter holding this rank's rows, tagged with its `Shard` (works on the meta device too); where this
    rank holds every row (tp 1), `param` itself, tagged: an optimizer made before `wrap` still trains it."""
    if partition.is_whole(rank):
        param.autotp_shard = Shard(partition, rank)
        return param
    shard = nn.Parameter(partition.shard(param.detach(), rank), requires_grad=param.requires_grad)
    shard.autotp_shard = Shard(partition, rank)
    return shard


def forget_shard(param: nn.Parameter) -> None:
    """Drop the shard metadata `shard_parameter` and `gather_parameter_` put on a parameter that now holds a full tensor."""
    for key in ("autotp_shard", "autotp_full", "autotp_stashed_grad"):
        vars(param).pop(key, None)


def held_shard(tensor: torch.Tensor) -> Shard | None:
    """The `Shard` that `tensor` holds now: None for a replicated tensor, and for a sharded one gathered whole
    (inside `GatherReplacedLayerParams` its `autotp_shard` stays, but every rank holds the full tensor)."""
    return None if getattr(tensor, "autotp_full", False) else getattr(tensor, "autotp_shard", None)


def held_part(tensor: torch.Tensor) -> Shard | None:
    """`held_shard`, or for an EP rank's experts (`autotp_expert`, `autotp.ep.dispatch.ExpertRegion`) their `Shard`
    over the EP group: what a save or a checkpoint writes of `tensor` is the same box of the full tensor either way."""
    region = getattr(tensor, "autotp_expert", None)
    return held_shard(tensor) if region is None else region.held(tensor)


def full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The full (unsharded) shape of a model tensor, from its `autotp_shard` tag (or its experts' `autotp_expert`)."""
    shard = held_part(tensor)
    return tuple(tensor.shape) if shard is None else shard.full_shape(tensor.shape)


def holders(tensor: torch.Tensor, tp_group: Group) -> Group:
    """The group over which `held_part(tensor)` splits it: the EP group for experts, else `tp_group`."""
    region = getattr(tensor, "autotp_expert", None)
    return tp_group if region is None else region.experts.ep


def gather_parameter_(param: nn.Parameter, group: Group) -> None:
    """Swap the shard for the full tensor in place (same Parameter object), stashing the gradient.

    A parameter shared by two modules (tied embedding and LM head) is gathered once.
    """
    if getattr(param, "autotp_full", False):
        return
    param.autotp_full = True
    param.autotp_stashed_grad, param.grad = param.grad, None
    param.data = all_gather_full(param.data, param.autotp_shard.partition, group)


def partition_parameter_(param: nn.Parameter) -> None:
    """Back to this rank's rows of whatever the full tensor became; a full gradient is sliced and added."""
    if not getattr(param, "autotp_full", False):
        return
    param.autotp_full = False
    shard = param.autotp_shard
    full_grad, param.grad = param.grad, None
    param.data = shard.partition.shard(param.data, shard.rank)
    grad, param.autotp_stashed_grad = param.autotp_stashed_grad, None
    if full_grad is not None:
        sliced = shard.partition.shard(full_grad, shard.rank)
        grad = sliced if grad is None else grad + sliced
    param.grad = grad
