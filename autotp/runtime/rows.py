"""Which rows of a TP shard this rank holds when FSDP2 shards it again over data parallelism (a DTensor).

A leaf: the files tier and the entry points read FSDP's rows through it without importing `autotp.dp.fsdp`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard

from ..planning.placement import Placement
from ..planning.sharding import Shard as TPShard


def dp_full(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's whole TP shard of `tensor`: gathered over DP when FSDP holds it sharded (collective over DP)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def placement(tensor: torch.Tensor, shard: TPShard | None = None) -> Placement:
    """Which boxes of the full tensor this rank holds of `tensor`, whose TP shard is cut as `shard` says (None: not
    split over TP): FSDP's dim-0 chunk of it when `tensor` is a DTensor."""
    full = tuple(tensor.shape) if shard is None else shard.full_shape(tensor.shape)
    partition, rank = (None, 0) if shard is None else (shard.partition, shard.rank)
    if not isinstance(tensor, DTensor):
        return Placement(full, partition, rank)
    if len(tensor.placements) != 1 or tensor.placements[0] != Shard(0):
        raise NotImplementedError(f"autotp expects FSDP's 1-D Shard(0) placement, got {tensor.placements}")
    mesh = tensor.device_mesh
    return Placement.fsdp(full, partition, rank, mesh.size(), mesh.get_local_rank())


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's rows of `tensor`, the index of the first in its TP shard): FSDP's dim-0 chunk of a DTensor."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    rows = placement(tensor).rows
    assert rows is not None  # always: `placement` takes FSDP's Shard(0) only, so the tensor has a dim 0 to chunk
    return tensor.to_local(), rows[0]
