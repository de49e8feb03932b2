"""Replicated parameters stay identical on every TP rank: made so by `wrap`, checked by `check_replicas`.

Every TP rank computes the replicated parts of the model (norms, an embedding that is not split)
redundantly on the same inputs, so they stay equal only if they start equal. A model built without
a common seed would otherwise train a different model on each rank without a word. `wrap`
broadcasts them from TP rank 0, as DDP does within its group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .collectives import all_gather, buckets

from .dtensor_rows import local_rows
from .groups import Group, group_size
from .state import find_state, state_of

_BUCKET_BYTES = 64 << 20


def replicated_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer no partition splits, each once."""
    seen: set[int] = set()
    out = []
    state = find_state(model)
    sharded = state.fsdp_sharded if state is not None else frozenset()  # inside an FSDP forward: untagged copies
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) not in seen and not hasattr(tensor, "autotp_shard") and name not in sharded:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def broadcast_replicated(model: nn.Module, group: Group) -> None:
    """Copy TP rank 0's replicated parameters and buffers onto the other ranks of the group."""
    broadcast_tensors([t for _, t in replicated_tensors(model) if t.device.type != "meta"], group)


def broadcast_tensors(tensors: list[torch.Tensor], group: Group) -> None:
    """Copy TP rank 0's values of `tensors` onto the other ranks of the group, in place.

    All buckets are received before any tensor is written, so a failed collective changes nothing.
    """
    if group_size(group) == 1:
        return
    received = []
    for bucket in buckets(tensors, _BUCKET_BYTES):
        flat = _flatten_dense_tensors([t.detach() for t in bucket])
        dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
        received.append((bucket, flat))
    with torch.no_grad():
        for bucket, flat in received:
            for tensor, value in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
                tensor.copy_(value)


def check_replicas(model: nn.Module, group: Group | None = None) -> None:
    """Raise, naming the first tensor that differs, unless every replicated tensor is equal on every TP rank.

    Compares three float64 checksums per tensor (sum, sum of squares, position-weighted sum) with one
    all-gather; any drift in a tensor's bits changes them.
    """
    group = state_of(model).tp_group if group is None else group
    size = group_size(group)
    if size == 1:
        return
    named = [(n, t) for n, t in replicated_tensors(model) if t.is_floating_point()]
    mine = torch.stack([_checksum(t) for _, t in named]) if named else torch.zeros(0, 3, dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    all_gather(everyone, mine, group)
    ranks = dist.get_process_group_ranks(group)
    for index, (name, tensor) in enumerate(named):
        for rank, theirs in zip(ranks, everyone):
            if not torch.equal(theirs[index], everyone[0][index]):
                raise RuntimeError(
                    f"replicated tensor {name} {tuple(tensor.shape)} differs between TP ranks {ranks[0]} and {rank} "
                    f"(checksums {everyone[0][index].tolist()} vs {theirs[index].tolist()}): the ranks are training "
                    f"different models. Seed every rank alike before building the model, or let autotp.wrap "
                    f"broadcast it (it does so from TP rank 0)")


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Of this rank's own data: under FSDP, the DP rows, which the TP ranks of one DP position share."""
    flat = local_rows(tensor.detach())[0].reshape(-1).double()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), flat.square().sum(), (flat * weights).sum()]).cpu()
