"""Which boxes of a full tensor one rank holds: its TP rank's runs of a `Partition`, times FSDP's dim-0 rows.

Under `autotp.fully_shard`, FSDP2 keeps only a dim-0 chunk of each rank's TP shard, so a rank holds, per run of its
partition, the part of that run inside FSDP's rows: a box of the full tensor. Checkpoints write those boxes, saves and
exports cut parts of them, and legacy reads check their shapes; all of it is this arithmetic, done once here (pure
data, free of process groups, like `Partition`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .sharding import Partition, Run


def dp_chunk(rows: int, parts: int, index: int) -> Run:
    """(first row, row count) of part `index` of `parts`, split as torch.chunk splits (FSDP2's dim-0 shards)."""
    size = -(-rows // parts)
    first = min(index * size, rows)
    return first, min(rows, first + size) - first


def _with(values: tuple[int, ...], dim: int, value: int) -> tuple[int, ...]:
    return values[:dim] + (value,) + values[dim + 1 :]


class Box(NamedTuple):
    """A box of the full tensor: its `offsets` and `sizes`, and where it starts (`at`) in the rank's local tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    at: tuple[int, ...]

    def view(self, local: torch.Tensor) -> torch.Tensor:
        """The box's rows in `local`, the tensor this rank holds."""
        for dim, (at, size) in enumerate(zip(self.at, self.sizes)):
            local = local.narrow(dim, at, size)
        return local

    def in_full(self, full: torch.Tensor) -> torch.Tensor:
        """The box in a full tensor, to write it there."""
        for dim, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            full = full.narrow(dim, offset, size)
        return full

    def clip(self, dim: int, start: int, length: int, *, local: bool = False) -> Box | None:
        """The part of the box inside rows [start, start + length) of `dim` (None: no row), counted from `start`: rows
        of the full tensor (a window, as one checkpoint part of a fused tensor), or with `local`, of the local tensor
        (the rows of it that a rank keeps)."""
        base = self.at if local else self.offsets
        lo, hi = max(base[dim], start), min(base[dim] + self.sizes[dim], start + length)
        if lo >= hi:
            return None
        shift = lo - base[dim]
        offsets = self.offsets[dim] + shift - (0 if local else start)
        return Box(
            _with(self.offsets, dim, offsets),
            _with(self.sizes, dim, hi - lo),
            _with(self.at, dim, self.at[dim] + shift - (start if local else 0)),
        )


@dataclass(frozen=True)
class Placement:
    """The rows of a tensor of `full_shape` one rank holds: TP rank `rank`'s runs of `partition` (None: not split over
    TP), and of that TP shard only FSDP's dim-0 rows `rows` ((first, count); None: all of them)."""

    full_shape: tuple[int, ...]
    partition: Partition | None = None
    rank: int = 0
    rows: Run | None = None

    @classmethod
    def fsdp(
        cls, full_shape: tuple[int, ...], partition: Partition | None, rank: int, dp_size: int, dp_rank: int
    ) -> Placement:
        """The placement of DP rank `dp_rank` of `dp_size`: FSDP2 keeps torch.chunk's part of the TP shard's dim 0."""
        shard = cls(full_shape, partition, rank).shard_shape
        return cls(full_shape, partition, rank, dp_chunk(shard[0], dp_size, dp_rank) if shard else None)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        """The shape of this rank's TP shard (a DTensor's shape under FSDP)."""
        if self.partition is None:
            return self.full_shape
        return _with(self.full_shape, self.partition.dim, self.partition.local_size(self.rank))

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The shape of the tensor this rank holds: its FSDP rows of its TP shard."""
        shard = self.shard_shape
        return shard if self.rows is None else _with(shard, 0, self.rows[1])

    def boxes(self) -> list[Box]:
        """The boxes of the full tensor this rank holds, one per run of its TP shard that meets its FSDP rows, in the
        order the local tensor holds them; a replicated run is a box on every rank holding it."""
        shape = self.full_shape
        if not shape:
            return [Box((), (), ())]
        dim = 0 if self.partition is None else self.partition.dim
        runs = ((0, shape[0]),) if self.partition is None else self.partition.runs[self.rank]
        out, offset = [], 0
        for start, length in runs:
            box = Box(
                _with((0,) * len(shape), dim, start), _with(shape, dim, length), _with((0,) * len(shape), dim, offset)
            )
            offset += length
            clipped = box.clip(0, *self.rows, local=True) if length and self.rows is not None else box
            if length and clipped is not None:
                out.append(clipped)
        return out

    def within(self, dim: int, start: int, length: int) -> list[Box]:
        """This rank's boxes cut to full rows [start, start + length) of `dim`, offsets counted from `start`."""
        return [box for box in (b.clip(dim, start, length) for b in self.boxes()) if box is not None]


def window(partition: Partition, start: int, length: int) -> Partition:
    """The partition of rows [start, start + length) of `partition`'s dim (one part of a fused tensor); a replicated
    run stays replicated."""
    line = partition.with_dim(0)
    ranks = (Placement((partition.full_size,), line, rank).within(0, start, length) for rank in range(line.tp_size))
    return Partition(partition.dim, length, tuple(tuple((b.offsets[0], b.sizes[0]) for b in boxes) for boxes in ranks))
