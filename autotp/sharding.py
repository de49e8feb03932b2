"""Partition arithmetic: which rows of a full tensor each TP rank holds.

A `Partition` is pure data, free of process groups, so plans can be built and printed anywhere.
A tensor is made of one or more logical parts laid end to end along `dim` (one part for a plain
projection; q, k and v for a fused one); each part is split over the ranks on its own, and a rank's
shard is its slice of every part, concatenated in part order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


def split_sizes(total: int, tp_size: int, unit: int = 1) -> tuple[int, ...]:
    """Split `total` rows into `tp_size` runs on `unit` boundaries, earlier ranks taking the remainder.

    For example 14 heads of 64 rows over 4 ranks give (256, 256, 192, 192).
    """
    if total % unit:
        raise ValueError(f"{total} rows are not a whole number of {unit}-row units")
    base, extra = divmod(total // unit, tp_size)
    return tuple((base + (r < extra)) * unit for r in range(tp_size))


@dataclass(frozen=True)
class Partition:
    """How one tensor is split over a TP group: `parts[p][r]` rows of part p live on rank r."""

    dim: int
    parts: tuple[tuple[int, ...], ...]

    @property
    def tp_size(self) -> int:
        return len(self.parts[0])

    @property
    def full_size(self) -> int:
        return sum(sum(part) for part in self.parts)

    def local_size(self, rank: int) -> int:
        return sum(part[rank] for part in self.parts)

    def ranges(self, rank: int) -> list[tuple[int, int]]:
        """(start, length) of each run of full-tensor rows this rank holds, in shard order."""
        runs, part_start = [], 0
        for part in self.parts:
            runs.append((part_start + sum(part[:rank]), part[rank]))
            part_start += sum(part)
        return runs

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's rows of `full`, as a new contiguous tensor that does not keep `full` alive."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(
                f"tensor of shape {tuple(full.shape)} has {full.shape[self.dim]} rows on dim {self.dim}, "
                f"the partition expects {self.full_size}"
            )
        pieces = [full.narrow(self.dim, start, length) for start, length in self.ranges(rank)]
        return torch.cat(pieces, dim=self.dim).contiguous() if len(pieces) > 1 else pieces[0].clone()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order."""
        if len(shards) != self.tp_size:
            raise ValueError(f"expected {self.tp_size} shards, got {len(shards)}")
        if self.tp_size == 1:
            return shards[0]
        pieces = []
        for p, part in enumerate(self.parts):
            offset_in_shard = [sum(self.parts[q][r] for q in range(p)) for r in range(self.tp_size)]
            pieces += [s.narrow(self.dim, offset_in_shard[r], part[r]) for r, s in enumerate(shards)]
        return torch.cat(pieces, dim=self.dim)

    def describe(self) -> str:
        sizes = [self.local_size(r) for r in range(self.tp_size)]
        split = "/".join(map(str, sizes)) if len(set(sizes)) > 1 else f"{sizes[0]} each"
        parts = f" in {len(self.parts)} parts" if len(self.parts) > 1 else ""
        return f"dim {self.dim}: {self.full_size} -> {split}{parts}"


@dataclass(frozen=True)
class Shard:
    """Partition metadata carried by a sharded parameter, so gather and save need no guessing."""

    partition: Partition
    rank: int

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.partition.dim] = self.partition.full_size
        return tuple(shape)
