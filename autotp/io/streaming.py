"""Full tensors streamed to one rank for a file: the point-to-point protocol behind `save_pretrained`'s writes.

Why not a gather (`runtime.collectives.gather_full_to`): the gathering rank would hold every shard of a
tensor at once, and write nothing until all came. Here it `pwrite`s each piece as it arrives, and on a
local filesystem the other ranks write their rows into its file themselves (the caller passes how:
`write_rows`, `autotp.io.hf.safetensors.write_rows`), so nothing travels at all.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import os
import threading
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from ..mesh import Group, group_rank, group_size, named_failure
from ..planning.sharding import Partition
from ..runtime.collectives import gather_full_to

STREAM_CHUNK_BYTES = 8 << 20  # one message: gloo moves 4-8 MiB ones at memcpy speed, 64 MiB ones at 2/3 of it
_STREAM_TAG = 0x41545346  # apart from a user's point-to-point tags (0 by default) and the staging entry check's
_ASK = 24 + 4096  # `write_into`'s message: position, file identity, path length (int64s), the path (PATH_MAX)
CANNOT = 1  # a sender's answer when the file is not one it can open: it sends its rows instead
# How a sender writes its rows into the file `dst` names: (path, file identity, [(file offset, bytes)]) -> 0, CANNOT
# or -errno (`autotp.io.hf.safetensors.write_rows`). None: senders send.
RowWriter = Callable[[str, int, list[tuple[int, memoryview]]], int]
_scratch: dict[str, torch.Tensor] = {}  # the gathering rank's reused buffers (pages touched once); freed at the end
_open: list[FullStream] = []  # streams on this rank not yet read to their end


def stream_full_to(
    shard: torch.Tensor, partition: Partition, group: Group, dst: int = 0, write_rows: RowWriter | None = None
) -> FullStream | torch.Tensor | None:
    """The full tensor on group rank `dst` as a `FullStream` to read once (None elsewhere, once sent or written).

    Collective over `group`. A stream left unread is drained by the next call, a `gather_after_streams` or
    `finish_streams()`: a writer that skips tensors after a failure never leaves a sender waiting.
    Where pieces do not go point to point (one rank, NCCL, GPU tensors), `gather_full_to`'s tensor.
    `write_rows` is how this rank, a sender, writes its rows into the file `dst` names (`FullStream.write_into`).
    """
    finish_streams(release=False)
    if group_size(group) == 1 or shard.device.type != "cpu" or dist.get_backend(group) != "gloo":
        return gather_full_to(shard, partition, group, dst)
    stream = FullStream(shard.detach(), partition, group, dst, write_rows)
    if group_rank(group) != dst:
        stream.send()
        return None
    _open.append(stream)
    return stream


def finish_streams(release: bool = True) -> None:
    """Read every stream still open on this rank to its end; `release` frees the receive buffers too."""
    while _open:
        with contextlib.suppress(OSError):  # a sender's failed write into a file whose writer failed already
            for _ in _open[0].pieces():
                pass
    if release:  # unmapping them takes tens of milliseconds: not on the caller's time
        threading.Thread(target=list(_scratch.values()).clear, name="autotp-free", daemon=True).start()
        _scratch.clear()


def gather_after_streams(shard: torch.Tensor, partition: Partition, group: Group, dst: int = 0) -> torch.Tensor | None:
    """`gather_full_to` once every stream on this rank is read: one left unread would keep its senders from it."""
    finish_streams(release=False)
    return gather_full_to(shard, partition, group, dst)


class FullStream:
    """A full tensor for a file on the gathering rank: (byte offset, bytes) pieces.

    Why: the writer `pwrite`s each piece as it comes, its own rows straight from its shard; a sender's
    pieces are `isend`s of views of its shard. Better, `write_into` has the senders write their rows
    into the file themselves where they can: nothing travels (a loopback copy costs as much CPU as
    the write). The gathering rank holds its shard plus at most the others' shards of one tensor.
    """

    def __init__(
        self, shard: torch.Tensor, partition: Partition, group: Group, dst: int, write_rows: RowWriter | None = None
    ) -> None:
        self.dtype, self.group, self._dst, self._write_rows = shard.dtype, group, dst, write_rows
        self.shape = shard.shape[: partition.dim] + (partition.full_size,) + shard.shape[partition.dim + 1 :]
        self._pieces: Iterator[tuple[int, memoryview | list[memoryview]]] | None = None
        self._ask, self.written_elsewhere = torch.zeros(_ASK, dtype=torch.uint8), 0  # zeros: send; bytes they wrote
        self._flat = _bytes(shard.contiguous())
        self._view = memoryview(self._flat.numpy())
        self._plan(partition)

    def _plan(self, partition: Partition) -> None:
        """Each rank's pieces and each sender's messages: pure arithmetic, the same on every rank."""
        dim, dst = partition.dim, self._dst
        outer, row = math.prod(self.shape[:dim]), math.prod(self.shape[dim + 1 :]) * self.dtype.itemsize
        self._runs = [
            (held.start * row, held.length * row, held.rank, held.offset * row)
            for held in partition.holders(prefer=dst)
            if held.length
        ]  # dst's replicas read from dst
        self._local = [partition.local_size(r) * row for r in range(partition.tp_size)]  # bytes per outer index
        self._senders = sorted({rank for _, _, rank, _ in self._runs} - {dst})
        self._shard_bytes = {s: outer * self._local[s] for s in self._senders}
        self._order: list[tuple[int, int, int, int, int]] = []  # outer == 1: (offset, rank, in its shard, n, message)
        self._messages: list[tuple[int, int, int]] = []  # (sender, offset in its shard, bytes)
        for begin, size, rank, offset in self._runs if outer == 1 else []:  # runs: contiguous in both
            for at in range(0, size, STREAM_CHUNK_BYTES):
                n = min(STREAM_CHUNK_BYTES, size - at)
                self._order.append((begin + at, rank, offset + at, n, len(self._messages) if rank != dst else -1))
                self._messages += [] if rank == dst else [(rank, offset + at, n)]
        step = max(1, STREAM_CHUNK_BYTES // (partition.full_size * row))  # else blocks of outer indices
        self._blocks = [(i, min(outer, i + step)) for i in range(0, outer, step)] if outer > 1 else []
        self._messages += [
            (s, first * self._local[s], (last - first) * self._local[s])
            for first, last in self._blocks
            for s in self._senders
        ]

    def write_into(self, path: bytes, identity: int, position: int) -> None:
        """Have the senders write their rows into the file at `path` themselves (the tensor's data from `position`).

        Each does (its `write_rows`) where it opens the same file (`identity`: same boot, device, inode),
        else it sends them. Several processes may write one file where the kernel keeps one page
        cache for it: the caller offers only files on local filesystems. Rows cut by outer dims travel
        (row by row, the two processes would take turns on the file's lock thousands of times).
        """
        if self._pieces is None and not self._blocks and len(path) <= _ASK - 24:
            self._ask[:24] = _bytes(torch.tensor([position, identity, len(path)]))
            self._ask[24 : 24 + len(path)] = torch.frombuffer(bytearray(path), dtype=torch.uint8)

    def send(self) -> None:
        """Off `dst`: this rank's rows, written into the file `dst` names or sent from its shard; returns when done."""
        me, peer = group_rank(self.group), dist.get_global_rank(self.group, self._dst)
        if me not in self._senders:
            return
        with named_failure(self.group, "gather of a full tensor"):
            dist.recv(self._ask, peer, group=self.group, tag=_STREAM_TAG)
            position, identity, length = self._ask[:24].view(torch.int64).tolist()
            if length:
                path = os.fsdecode(self._ask[24 : 24 + length].numpy().tobytes())
                rows = [(position + begin, self._view[at : at + n]) for begin, r, at, n, _ in self._order if r == me]
                try:  # never raised here: `dst` raises it, and this rank stays in step with it
                    status = CANNOT if self._write_rows is None else self._write_rows(path, identity, rows)
                except Exception as err:
                    status = -(getattr(err, "errno", None) or 5)  # EIO
                    logging.getLogger(__name__).exception("autotp: writing rows into %s failed", path)
                dist.send(torch.tensor([status]), peer, group=self.group, tag=_STREAM_TAG)
            if not length or status == CANNOT:
                for work in [
                    dist.isend(self._flat[at : at + n], peer, group=self.group, tag=_STREAM_TAG)
                    for sender, at, n in self._messages
                    if sender == me
                ]:
                    work.wait()

    def pieces(self) -> Iterator[tuple[int, memoryview | list[memoryview]]]:
        """(byte offset in the full tensor, bytes or a list of them to write one after another), blocking.

        After `write_into`: own rows, then any senders sent. Otherwise in file order (some filesystems
        take sequential writes only)."""
        self._pieces = self._pieces or self._receive()
        return self._pieces

    def _receive(self) -> Iterator[tuple[int, memoryview | list[memoryview]]]:
        try:
            rank, status, delegated = functools.partial(dist.get_global_rank, self.group), {}, bool(self._ask.any())
            with named_failure(self.group, "gather of a full tensor"):
                asked = [dist.isend(self._ask, rank(s), group=self.group, tag=_STREAM_TAG) for s in self._senders]
                if delegated:  # own rows while the senders write theirs; then every sender's answer
                    yield from (
                        (begin, self._view[at : at + n]) for begin, r, at, n, _ in self._order if r == self._dst
                    )
                    for sender in self._senders:
                        dist.recv(
                            answer := torch.zeros(1, dtype=torch.int64), rank(sender), group=self.group, tag=_STREAM_TAG
                        )
                        status[sender] = int(answer.item())
                sending = [s for s in self._senders if status.get(s, CANNOT) == CANNOT]
                self.written_elsewhere = sum(n for _, r, _, n, _ in self._order if r != self._dst and r not in sending)
                base = dict(zip(sending, itertools.accumulate([0] + [self._shard_bytes[s] for s in sending])))
                spare = _buffer("received", sum(self._shard_bytes[s] for s in sending))
                posted = {
                    m: dist.irecv(spare[base[s] + at : base[s] + at + n], rank(s), group=self.group, tag=_STREAM_TAG)
                    for m, (s, at, n) in enumerate(self._messages)
                    if s in base
                }
                view = memoryview(spare.numpy())
                for begin, r, at, n, m in self._order:  # file order
                    if m < 0 and not delegated:
                        yield begin, self._view[at : at + n]
                    elif m in posted:
                        posted.pop(m).wait()
                        yield begin, view[base[r] + at : base[r] + at + n]
                width = sum(n for _, n, _, _ in self._runs)  # bytes of one outer index of the full tensor
                for first, last in self._blocks:
                    yield first * width, self._rows(first, last, view, base, posted)
                for work in asked:
                    work.wait()
            failed = sorted((sender, -code) for sender, code in status.items() if code < 0)
            if failed:  # raised once every sender is done, so that none waits
                raise OSError(failed[0][1], f"{os.strerror(failed[0][1])} (writing on rank {rank(failed[0][0])})")
        finally:
            if self in _open:
                _open.remove(self)

    def _rows(self, first: int, last: int, view: memoryview, base: dict[int, int], posted: dict) -> list[memoryview]:
        """Outer indices [first, last) of the full tensor, once come: each the runs of every holder side by side,
        as the buffers of one `pwritev` (assembling them would copy them once more)."""
        for m, (sender, at, _n) in enumerate(self._messages):
            if m in posted and at == first * self._local[sender]:
                posted.pop(m).wait()
        views = {self._dst: self._view, **{s: view[base[s] : base[s] + self._shard_bytes[s]] for s in base}}
        return [
            views[rank][i * self._local[rank] + offset : i * self._local[rank] + offset + n]
            for i in range(first, last)
            for _, n, rank, offset in self._runs
        ]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)  # a contiguous tensor's bytes


def _buffer(name: str, nbytes: int) -> torch.Tensor:
    """A reused receive buffer of at least `nbytes` (fresh pages cost a fault each: 3-10x a copy's time).

    Every receive of a stream is posted at once: posting waits on a lock of gloo's that a transfer holds."""
    buffer = _scratch.get(name)
    if buffer is None or buffer.numel() < nbytes:
        buffer = _scratch[name] = torch.empty(nbytes, dtype=torch.uint8)
    return buffer
