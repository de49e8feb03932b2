"""Which rows of a TP shard this rank holds when FSDP2 shards it again over data parallelism (a DTensor).

A leaf: the files tier and the entry points read FSDP's rows through it without importing `autotp.dp.fsdp`.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Shard


def dp_full(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's whole TP shard of `tensor`: gathered over DP when FSDP holds it sharded (collective over DP)."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def dp_chunk(rows: int, parts: int, index: int) -> tuple[int, int]:
    """(first row, row count) of part `index` of `parts`, split as torch.chunk splits (FSDP2's dim-0 shards)."""
    size = -(-rows // parts)
    first = min(index * size, rows)
    return first, min(rows, first + size) - first


def local_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's rows of `tensor`, the index of the first in its TP shard): FSDP's dim-0 chunk of a DTensor."""
    if not isinstance(tensor, DTensor):
        return tensor, 0
    if len(tensor.placements) != 1 or tensor.placements[0] != Shard(0):
        raise NotImplementedError(f"autotp expects FSDP's 1-D Shard(0) placement, got {tensor.placements}")
    mesh = tensor.device_mesh
    return tensor.to_local(), dp_chunk(tensor.shape[0], mesh.size(), mesh.get_local_rank())[0]
