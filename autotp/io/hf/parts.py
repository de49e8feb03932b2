"""Which tensors a transformers checkpoint of a (sharded) model holds, in which order, and each rank's rows of each.

One place for what `save_pretrained` (files) and `export_weights` (a rollout engine) both need: transformers' saved
names and cuts (`saved_layout`), and a checkpoint tensor's part cut from this rank's shard before anything is
gathered (`local_part`), so a fused experts tensor is never gathered whole.
"""

from __future__ import annotations

from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...compat.hf_conversion import (
    SavedPart,
    SavedTensor,
    checkpoint_layout,
    keys_to_ignore_on_save,
    remove_tied_weights,
)
from ...mesh import named_failure
from ...planning.placement import Placement, window
from ...planning.sharding import Partition, Shard
from ...runtime.rows import dp_full, local_rows
from ...runtime.shards import full_shape, held_part
from ..streaming import gather_after_streams


def saved_layout(model: nn.Module, params: Mapping[str, torch.Tensor]) -> dict[str, SavedTensor]:
    """Checkpoint key -> how transformers' `save_pretrained` builds it from `params` (model keys to tensors whose
    shapes or `autotp_shard` give the full shapes), in transformers' order: tied aliases and ignored keys left out."""
    names = list(remove_tied_weights({k: v.detach() for k, v in params.items()}, model))
    ignored = keys_to_ignore_on_save(model)
    return checkpoint_layout(
        model,
        {
            n: torch.empty(full_shape(params[n]), dtype=params[n].dtype, device="meta")
            for n in names
            if n not in ignored
        },
    )


def local_part(tensor: torch.Tensor, shard: Shard | None, part: SavedPart) -> tuple[torch.Tensor, Partition | None]:
    """This rank's rows of `part` of a model tensor whose TP shard is `tensor`, and how they split over TP (None:
    replicated). Rows only: an int index keeps its dim (length 1) for `finish_part`. Under FSDP, rows of dim 0 that
    one DP rank holds (one expert) are broadcast from it alone (collective over DP); otherwise the shard is gathered
    over DP whole."""
    partition = None if shard is None else shard.partition
    local, index = _dp_rows(tensor.detach(), part.index, partition)
    for dim, i in enumerate(index):
        run = (i, 1) if isinstance(i, int) else i
        if run is None:
            continue
        if shard is not None and partition is not None and dim == partition.dim:  # partition comes from shard
            boxes = Placement(shard.full_shape(local.shape), partition, shard.rank).within(dim, *run)
            mine, partition = [box.view(local) for box in boxes], window(partition, *run)
            local = torch.cat(mine, dim=dim) if len(mine) > 1 else mine[0] if mine else local.narrow(dim, 0, 0)
        else:
            local = local.narrow(dim, *run)
    return local, partition


def finish_part(rows: torch.Tensor, part: SavedPart) -> torch.Tensor:
    """Gathered rows of `part` (from `local_part`) as the checkpoint holds them: int-indexed dims dropped, dims
    reordered, contiguous."""
    for dim in reversed(range(len(part.index))):
        if isinstance(part.index[dim], int):
            rows = rows.select(dim, 0)
    kept = sorted(part.order)
    return rows.permute([kept.index(d) for d in part.order]).contiguous()


def gather_part(param: torch.Tensor, part: SavedPart, group) -> torch.Tensor | None:
    """`part` of a model tensor on rank 0 of `group` (None on its other ranks), gathering nothing else; `group` is the
    one the tensor is split over (`autotp.runtime.shards.holders`: TP, or EP for experts)."""
    local, partition = local_part(param, held_part(param), part)
    full = local if partition is None else gather_after_streams(local.contiguous(), partition, group, dst=0)
    return None if full is None else finish_part(full, part)


def _dp_rows(tensor: torch.Tensor, index: tuple, partition: Partition | None) -> tuple[torch.Tensor, tuple]:
    """This rank's TP shard of `tensor` and `index` into it. Under FSDP (a DTensor sharded on dim 0 over DP), when
    `index` reads rows of dim 0 that one DP rank holds (one expert), only those rows, broadcast from that rank, with
    `index` counted from them; otherwise the whole TP shard (`dp_full`)."""
    rows = index[0] if index else None
    if not isinstance(tensor, DTensor) or rows is None or (partition is not None and partition.dim == 0):
        return dp_full(tensor), index
    start, count = (rows, 1) if isinstance(rows, int) else rows
    mesh, shape = tensor.device_mesh, tuple(tensor.shape)
    held = [Placement.fsdp(shape, None, 0, mesh.size(), r).within(0, start, count) for r in range(mesh.size())]
    owner = next((r for r, boxes in enumerate(held) if boxes and boxes[0].sizes[0] == count), None)
    if owner is None:
        return dp_full(tensor), index
    group = mesh.get_group()
    mine = local_rows(tensor)[0]
    if mesh.get_local_rank() == owner:
        buffer = held[owner][0].view(mine).contiguous()
    else:
        buffer = mine.new_empty((count, *mine.shape[1:]))
    with named_failure(group, "broadcast of an expert's rows from the DP rank holding them (FSDP)"):
        dist.broadcast(buffer, src=dist.get_global_rank(group, owner), group=group)
    return buffer, (0 if isinstance(rows, int) else (0, count), *index[1:])
