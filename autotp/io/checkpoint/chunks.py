"""A rank's rows of a tensor as chunks of the full tensor, in `torch.distributed.checkpoint`'s (DCP's) protocol.

A sharded parameter is held as runs of full-tensor rows along its partition's dim (several runs for
fused q/k/v or gate/up, a run shared by several ranks for a replicated KV head), and under
`autotp.fully_shard` FSDP keeps only some rows (dim 0) of that TP shard. Each (run, DP rows) piece
is a box of the full tensor: `Chunks` hands those boxes to DCP's default planners through the
chunk protocol DTensor itself implements (`__create_write_items__`, `__create_chunk_list__`,
`__get_tensor_shard__`), so a checkpoint stores every tensor at its full shape and any layout reads
it back. DCP's planner drops equal boxes written by several ranks (replicated rows, DP replicas)
and refuses gaps and overlaps; no custom planner is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ...compat.torch import no_torch_function, storageless_tensor
from ...planning.sharding import Shard
from ...runtime.rows import local_rows, placement


@dataclass(frozen=True)
class Piece:
    """One box of the full tensor: its offsets and this rank's data for it (a view of the local tensor)."""

    offsets: tuple[int, ...]
    data: torch.Tensor


class Chunks(torch.Tensor):
    """This rank's pieces of one full tensor, for DCP: written as they are, read in place into the views.

    A tensor subclass holding no data, with the full shape (DCP looks pieces up only in tensors and
    compares the full shape with the saved one before it plans a read); it refuses to compute."""

    pieces: list[Piece]
    __torch_function__ = no_torch_function()

    @staticmethod
    def __new__(
        cls, full_shape: Sequence[int], pieces: list[Piece], dtype: torch.dtype, device: torch.device
    ) -> Chunks:
        self = storageless_tensor(cls, torch.Size(full_shape), dtype, device)
        self.pieces = pieces
        return self

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise TypeError(
            f"autotp.io.checkpoint.chunks.Chunks only describes which pieces of a tensor a rank holds, for "
            f"torch.distributed.checkpoint; {func} cannot run on it"
        )

    def __repr__(self) -> str:
        return f"Chunks({tuple(self.shape)}, {[(p.offsets, tuple(p.data.shape)) for p in self.pieces]})"

    @classmethod
    def of(cls, tensor: torch.Tensor, shard: Shard | None = None) -> Chunks:
        """The pieces of `tensor` (a parameter, buffer or optimizer state shaped like one; a DTensor under FSDP)."""
        tensor = tensor.detach()
        local, where = local_rows(tensor)[0], placement(tensor, shard)
        pieces = [Piece(box.offsets, box.view(local)) for box in where.boxes()]
        return cls(where.full_shape, [p for p in pieces if p.data.numel()], local.dtype, local.device)

    def snapshot(self) -> Chunks:
        """The same pieces copied to CPU memory, for a save that writes while training goes on."""
        return Chunks(
            self.shape,
            [Piece(p.offsets, p.data.detach().to("cpu", copy=True)) for p in self.pieces],
            self.dtype,
            torch.device("cpu"),
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(p.offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(p), size=self.shape, properties=TensorProperties.create_from_tensor(p.data)
                ),
            )
            for p in self.pieces
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(p) for p in self.pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return next(p.data for p in self.pieces if p.offsets == tuple(index.offset))


def _chunk(piece: Piece) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(piece.offsets), sizes=piece.data.shape)
