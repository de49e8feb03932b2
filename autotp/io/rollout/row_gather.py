"""Many tensors' rows gathered to one rank in one message per sender: the bucketed gather behind `export_weights`.

Why not one gather per tensor (`collectives.gather_full_to`): a 70B model is thousands of tensors, and a rollout
engine wants them after every step. Here every rank packs its share of a whole bucket of tensors into one flat
buffer and sends it in one message; the receiving rank posts one receive per sender into one buffer, then
assembles each tensor only when asked, so it holds the bucket's bytes plus one tensor. Which rows of which rank's
shard go where is arithmetic on the partitions, the same on every rank. A request may ask for some rows only (one
engine rank's): only those travel. Replicated tensors are read from the receiving rank's own copy.
Under FSDP, `dp_full_many` first gathers a bucket's DP rows in one all-gather per dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ...mesh import Group, group_rank, group_size, named_failure
from ...planning.placement import Box, Placement
from ...planning.sharding import Partition, Run
from ...runtime.rows import local_rows
from ...runtime.seq_collectives import all_gather_dim0

_TAG = 0x41544257  # apart from the streaming gather's tag and a user's point-to-point tags
_ALIGN = 16  # every piece starts on this many bytes, so it can be viewed as any dtype


@dataclass(frozen=True)
class RowRequest:
    """Rows `wanted` ((start, length) runs of the full tensor's `partition.dim`, in order; None: all) of a tensor
    of which this rank holds `local` (its rows as `partition` splits them; None: the whole tensor on every rank,
    `dim` then naming the dim `wanted` counts), delivered in `dtype`."""

    local: torch.Tensor
    partition: Partition | None
    wanted: tuple[Run, ...] | None
    dtype: torch.dtype
    dim: int = 0


@dataclass(frozen=True)
class _Piece:
    holder: int  # group rank whose shard holds the rows
    offset: int  # first row in the holder's shard
    length: int
    at: int  # first row in the delivered tensor


def _pieces(request: RowRequest, dst: int) -> tuple[int, list[_Piece]]:
    """(dim, pieces) of a request: which rank's rows make each run of the result; a row several ranks hold is read
    from `dst` when it holds it."""
    partition = request.partition
    if partition is None:
        dim = request.dim if request.local.dim() else 0
        wanted = request.wanted or ((0, request.local.shape[dim] if request.local.dim() else 1),)
        at, out = 0, []
        for start, length in wanted:
            out.append(_Piece(dst, start, length, at))
            at += length
        return dim, out
    holders = partition.holders(prefer=dst)
    at, out = 0, []
    for start, length in request.wanted or ((0, partition.full_size),):
        for held in holders:
            box = Box((held.start,), (held.length,), (held.offset,)).clip(0, start, length)
            if box is not None:
                out.append(_Piece(held.rank, box.at[0], box.sizes[0], at + box.offsets[0]))
        at += length
    return partition.dim, out


def _shape(request: RowRequest, rank: int, dim: int, rows: int | None = None) -> list[int]:
    shape = list(request.local.shape)
    if shape:
        shape[dim] = (
            rows
            if rows is not None
            else (request.partition.local_size(rank) if request.partition is not None else shape[dim])
        )
    return shape


def delivered_shape(request: RowRequest) -> tuple[int, ...]:
    """The shape `gather_rows_to` delivers for `request` (what a rank receiving it from elsewhere allocates)."""
    dim, pieces = _pieces(request, 0)
    return tuple(_shape(request, 0, dim, sum(piece.length for piece in pieces)))


def _nbytes(request: RowRequest, dim: int, length: int) -> int:
    shape = _shape(request, 0, dim, length)
    return math.prod(shape) * request.dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@torch.no_grad()
def gather_rows_to(requests: list[RowRequest], group: Group, dst: int = 0) -> Iterator[torch.Tensor] | None:
    """On group rank `dst`, an iterator over the requested rows of each request, in order, each assembled when asked
    (the previous one is not kept); None on the other ranks, once their share is sent. Collective over `group`:
    one message from each rank holding wanted rows. A bucket of one tensor whose rows are contiguous runs (split on
    its first non-unit dim: a vocabulary, a column layer) is received in place instead, one message per run, so a
    tensor larger than a bucket costs no staging buffer."""
    plans = [_pieces(r, dst) for r in requests]
    world = group_size(group)
    me = group_rank(group) if world > 1 else 0
    if len(requests) == 1 and requests[0].local.dim() and math.prod(requests[0].local.shape[: plans[0][0]]) == 1:
        return _in_place(requests[0], *plans[0], group, dst, me)
    sizes = [0] * world
    where: list[list[int]] = []  # per request, per piece: byte offset in its holder's message (-1: dst's own)
    for request, (dim, pieces) in zip(requests, plans):
        offsets = []
        for piece in pieces:
            if piece.holder == dst:
                offsets.append(-1)
                continue
            offsets.append(sizes[piece.holder])
            sizes[piece.holder] += _aligned(_nbytes(request, dim, piece.length))
        where.append(offsets)
    if me != dst:
        if sizes[me]:
            flat = torch.empty(sizes[me], dtype=torch.uint8, device=requests[0].local.device)
            for request, (dim, pieces), offsets in zip(requests, plans, where):
                for piece, offset in zip(pieces, offsets):
                    if piece.holder == me:
                        _view(flat, offset, request, dim, piece.length).copy_(
                            request.local.narrow(dim, piece.offset, piece.length)
                        )
            with named_failure(group, "bucketed gather"):
                dist.send(flat, dist.get_global_rank(group, dst), group=group, tag=_TAG)
        return None
    device = requests[0].local.device if requests else torch.device("cpu")
    received = {}
    if any(sizes):
        buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        works, at = [], 0
        for rank, size in enumerate(sizes):
            if size:
                received[rank] = buffer[at : at + size]
                works.append(dist.irecv(received[rank], dist.get_global_rank(group, rank), group=group, tag=_TAG))
                at += size
        with named_failure(group, "bucketed gather"):
            for work in works:
                work.wait()
    return _assembled(requests, plans, where, received)


def _in_place(
    request: RowRequest, dim: int, pieces: list[_Piece], group: Group, dst: int, me: int
) -> Iterator[torch.Tensor] | None:
    """One tensor's runs sent one by one and received straight into the result (every run is contiguous there)."""
    if me != dst:
        mine = [
            request.local.narrow(dim, p.offset, p.length).to(request.dtype).contiguous()
            for p in pieces
            if p.holder == me
        ]
        with named_failure(group, "bucketed gather"):
            for work in [dist.isend(t, dist.get_global_rank(group, dst), group=group, tag=_TAG) for t in mine]:
                work.wait()
        return None
    out = torch.empty(
        _shape(request, 0, dim, sum(p.length for p in pieces)), dtype=request.dtype, device=request.local.device
    )
    works = [
        dist.irecv(out.narrow(dim, p.at, p.length), dist.get_global_rank(group, p.holder), group=group, tag=_TAG)
        for p in pieces
        if p.holder != dst
    ]
    for p in pieces:
        if p.holder == dst:
            out.narrow(dim, p.at, p.length).copy_(request.local.narrow(dim, p.offset, p.length))
    with named_failure(group, "bucketed gather"):
        for work in works:
            work.wait()
    return iter([out])


def _assembled(
    requests: list[RowRequest], plans: list, where: list[list[int]], received: dict[int, torch.Tensor]
) -> Iterator[torch.Tensor]:
    for request, (dim, pieces), offsets in zip(requests, plans, where):
        if len(pieces) == 1 and offsets[0] == -1:  # dst's own rows: a copy, so no one writes into the model
            piece = pieces[0]
            own = request.local.narrow(dim, piece.offset, piece.length) if request.local.dim() else request.local
            yield own.to(request.dtype, copy=True)
            continue
        rows = sum(p.length for p in pieces)
        out = torch.empty(_shape(request, 0, dim, rows), dtype=request.dtype, device=request.local.device)
        for piece, offset in zip(pieces, offsets):
            source = (
                request.local.narrow(dim, piece.offset, piece.length)
                if offset == -1
                else _view(received[piece.holder], offset, request, dim, piece.length)
            )
            out.narrow(dim, piece.at, piece.length).copy_(source)
        yield out
        del out  # before the next is built: one tensor alive at a time


def _view(flat: torch.Tensor, offset: int, request: RowRequest, dim: int, length: int) -> torch.Tensor:
    """Bytes [offset, ...) of `flat` as `length` rows of the request's tensor, in its delivered dtype."""
    shape = _shape(request, 0, dim, length)
    n = math.prod(shape) * request.dtype.itemsize
    return flat[offset : offset + n].view(request.dtype).view(shape)


@torch.no_grad()
def dp_full_many(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor's whole TP shard: FSDP's DTensors (dim-0 chunks over DP) gathered together, one all-gather per
    dtype and mesh of every chunk padded to torch.chunk's size; other tensors as they are. Collective over DP."""
    out = list(tensors)
    kinds: dict[tuple, list[int]] = {}
    for i, tensor in enumerate(tensors):
        if isinstance(tensor, DTensor):
            kinds.setdefault((tensor.dtype, id(tensor.device_mesh)), []).append(i)
    for indices in kinds.values():
        first = tensors[indices[0]]
        mesh = first.device_mesh
        world, group = mesh.size(), mesh.get_group()
        inner = [math.prod(tensors[i].shape[1:]) for i in indices]
        padded = [-(-tensors[i].shape[0] // world) * n for i, n in zip(indices, inner)]
        mine, at = torch.zeros(sum(padded), dtype=first.dtype, device=local_rows(first)[0].device), 0
        for i, size in zip(indices, padded):
            local = local_rows(tensors[i])[0]
            mine[at : at + local.numel()].copy_(local.reshape(-1))
            at += size
        gathered = all_gather_dim0(mine, group, of=" of FSDP's rows")
        at = 0
        for i, n, size in zip(indices, inner, padded):
            shape = tensors[i].shape
            full = mine.new_empty(shape)
            for rank in range(world):
                for box in Placement.fsdp(tuple(shape), None, 0, world, rank).boxes():
                    begin = rank * mine.numel() + at
                    box.in_full(full).copy_(gathered[begin : begin + box.sizes[0] * n].view(box.sizes))
            out[i] = full
            at += size
    return out
