"""Replicas stay identical: made so by `wrap`, checked by `check_replicas`.

Every TP rank computes the replicated parts of the model (norms, an embedding that is not split)
redundantly on the same inputs, so they stay equal only if they start equal; and every DP replica
applies the same averaged gradients to its copy, so the replicas stay equal only if they start equal
too. A model built without a common seed would otherwise train a different model on each rank
without a word. `wrap` broadcasts the replicated tensors from TP rank 0, and every tensor (shards
included) from DP rank 0 of the same TP rank, as DDP does within its group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..mesh import Group, group_size, named_failure
from ..state import find_state, state_of
from .collectives import all_gather, buckets
from .rows import local_rows

_BUCKET_BYTES = 64 << 20


def replicated_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of every parameter and buffer no partition splits, each once."""
    seen: set[int] = set()
    out = []
    state = find_state(model)
    sharded = state.fsdp_sharded if state is not None else frozenset()  # inside an FSDP forward: untagged copies
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        if id(tensor) not in seen and not _split(tensor) and name not in sharded:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def _split(tensor: torch.Tensor) -> bool:
    """Whether ranks hold different parts of `tensor`: a TP shard, or an EP rank's experts (`autotp.ep`)."""
    return hasattr(tensor, "autotp_shard") or hasattr(tensor, "autotp_expert")


def broadcast_replicated(model: nn.Module, group: Group, dp_group: Group = None) -> None:
    """Make every replica equal to TP rank 0 of DP rank 0: the replicated tensors over TP, every tensor over DP.

    Everything is received before any tensor is written, so a failed collective changes nothing.
    """
    tensors = _tensors_once(model)
    replicated = {id(t) for _, t in replicated_tensors(model)}
    values = _received(tensors, dp_group)  # this TP rank's tensors as DP rank 0 holds them
    indices = [i for i, t in enumerate(tensors) if id(t) in replicated]
    for index, value in zip(indices, _received([values[i] for i in indices], group)):
        values[index] = value
    _write(tensors, values)


def broadcast_tensors(tensors: list[torch.Tensor], group: Group) -> None:
    """Copy TP rank 0's values of `tensors` onto the other ranks of the group, in place.

    All buckets are received before any tensor is written, so a failed collective changes nothing.
    """
    _write(tensors, _received(tensors, group))


def _tensors_once(model: nn.Module) -> list[torch.Tensor]:
    """Every materialised parameter and buffer, each once; not the experts, which the EP step broadcasts over their
    own replicas (`autotp.ep.apply.broadcast_experts`)."""
    seen: set[int] = set()
    out = []
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in seen and tensor.device.type != "meta" and not hasattr(tensor, "autotp_expert"):
            seen.add(id(tensor))
            out.append(tensor)
    return out


def _received(tensors: list[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """Rank 0 of `group`'s values of `tensors` (the tensors themselves without a group), none written yet."""
    if group_size(group) == 1:
        return list(tensors)
    values = []
    for bucket in buckets(tensors, _BUCKET_BYTES):
        flat = _flatten_dense_tensors([t.detach() for t in bucket])
        with named_failure(group, "broadcast of the replicated tensors from the group's rank 0"):
            dist.broadcast(flat, src=dist.get_global_rank(group, 0), group=group)
        values += _unflatten_dense_tensors(flat, bucket)
    return values


def _write(tensors: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for tensor, value in zip(tensors, values):
            if value is not tensor:
                tensor.copy_(value)


def check_replicas(model: nn.Module, group: Group | None = None) -> None:
    """Raise, naming the first tensor that differs, unless every replicated tensor is equal on every TP rank and
    (with no `group` given) every tensor is equal on every DP rank of this TP rank.

    Compares three float64 checksums per tensor (sum, sum of squares, position-weighted sum) with one
    all-gather per group; any drift in a tensor's bits changes them. The DP check is skipped under
    `autotp.fully_shard`, where each DP rank holds different rows by design.
    """
    state = state_of(model) if group is None else None
    _compare(
        replicated_tensors(model),
        group if state is None else state.tp_group,
        "TP",
        "Seed every rank alike before building the model, or let autotp.wrap broadcast it (it does so from TP rank 0)",
    )
    if state is not None and state.tp_group is not None and not state.fsdp:
        named = [(n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type != "meta"]
        _compare(
            named,
            state.dp_cp_group,
            "DP",
            "Average every gradient over the DP group (autotp.allreduce_gradients, or DDP over autotp.dp_group) "
            "and step every replica alike; autotp.wrap made them equal (it broadcasts from DP rank 0)",
        )


def _compare(named: list[tuple[str, torch.Tensor]], group: Group, kind: str, fix: str) -> None:
    """Raise, naming the first of `named` whose checksums differ between the ranks of `group`."""
    size = group_size(group)
    if size == 1:
        return
    named = [(n, t) for n, t in named if t.is_floating_point()]
    mine = torch.stack([_checksum(t) for _, t in named]) if named else torch.zeros(0, 3, dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    all_gather(everyone, mine, group)
    ranks = dist.get_process_group_ranks(group)
    for index, (name, tensor) in enumerate(named):
        for rank, theirs in zip(ranks, everyone):
            if not torch.equal(theirs[index], everyone[0][index]):
                raise RuntimeError(
                    f"replicated tensor {name} {tuple(tensor.shape)} differs between {kind} ranks {ranks[0]} and "
                    f"{rank} (checksums {everyone[0][index].tolist()} vs {theirs[index].tolist()}): the ranks are "
                    f"training different models. {fix}"
                )


def _checksum(tensor: torch.Tensor) -> torch.Tensor:
    """Of this rank's own data: under FSDP, the DP rows, which the TP ranks of one DP position share."""
    flat = local_rows(tensor.detach())[0].reshape(-1).double()
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device)
    return torch.stack([flat.sum(), flat.square().sum(), (flat * weights).sum()]).cpu()
