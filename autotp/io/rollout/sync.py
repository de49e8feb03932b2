"""Weights broadcast from the trainer to a rollout engine's ranks, bucket by bucket, and received there.

Why: verl and OpenRLHF each hand-write this loop (gather, broadcast, `load_weights`); here it is written once over
`export_weights`. The engine's ranks are not in the training world, so the caller builds `engine_group` itself: a
process group holding the sending trainer rank (TP rank 0 of one replica) and every engine rank, for example
`torch.distributed.ProcessGroupGloo` / `ProcessGroupNCCL` over its own `TCPStore`, or `dist.new_group` when the
engine ranks are extra ranks of one world. With vLLM: build the group in a worker extension on every worker (the
pattern of vLLM's RLHF examples), call `receive_weights` there and pass what it yields to
`model_runner.model.load_weights(...)`; SGLang's `update_weights_from_distributed` reads the same group.

Each bucket travels as three broadcasts: its header's length, the header (names, dtypes, shapes; JSON), and the
tensors' bytes in one flat buffer, each tensor starting on 16 bytes. A header length of 0 ends the stream.
"""

from __future__ import annotations

import json
import math
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from .export import check_bucket_bytes, export_weights

_ALIGN = 16


def sync_weights(
    model: nn.Module,
    engine_group: dist.ProcessGroup | None,
    *,
    src: int = 0,
    merge_lora: bool = True,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 256 << 20,
    device: torch.device | str | None = None,
) -> None:
    """Send the model's weights (`export_weights`' names and values) to every rank of `engine_group`.

    Call it on every rank that `export_weights` runs on. `engine_group` is the group on the one trainer rank that
    sends (a TP rank 0, as rank `src` of the group) and None on every other, which only takes part in the gathers:
    the TP rank 0 of another DP replica (which `export_weights` also hands the tensors) drops them. Buckets of about `bucket_bytes` are broadcast from `device` (default: where the weights are; a CUDA device for
    NCCL). The engine's ranks call `receive_weights` meanwhile.
    """
    check_bucket_bytes(bucket_bytes, "autotp.sync_weights")
    exported = export_weights(model, merge_lora=merge_lora, dtype=dtype, bucket_bytes=bucket_bytes)
    if engine_group is None:  # not the sender: the gathers still need this rank, to the end
        for _ in exported:
            pass
        return
    send_tensors(exported, engine_group, src=src, bucket_bytes=bucket_bytes, device=device)


def send_tensors(
    pairs: Iterable[tuple[str, torch.Tensor]],
    engine_group: dist.ProcessGroup,
    *,
    src: int = 0,
    bucket_bytes: int = 256 << 20,
    device: torch.device | str | None = None,
) -> None:
    """Broadcast `(name, tensor)` pairs to `engine_group` as `sync_weights` does (any source of them: a vLLM
    `WeightSource`, say), then the end of the stream; the engine's ranks run `receive_weights` meanwhile."""
    check_bucket_bytes(bucket_bytes, "autotp.io.rollout.sync.send_tensors")
    sender = _Sender(engine_group, src, bucket_bytes, device)
    for name, tensor in pairs:
        sender.add(name, tensor)
    sender.flush()
    _broadcast(engine_group, torch.zeros(1, dtype=torch.int64, device=sender.device or "cpu"), src)


def receive_weights(
    engine_group: dist.ProcessGroup, *, src: int = 0, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """On an engine rank: `(name, tensor)` as `sync_weights` sends them, to pass to the engine's `load_weights`.

    Each tensor is a view into its bucket's buffer on `device` (CUDA for NCCL), valid until the next is asked for
    from the following bucket: copy what you keep (`load_weights` copies). Iterate it to the end.
    """
    while True:
        length = torch.zeros(1, dtype=torch.int64, device=device)
        _broadcast(engine_group, length, src)
        if not length.item():
            return
        header = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        _broadcast(engine_group, header, src)
        entries = json.loads(bytes(header.cpu().tolist()).decode())
        offsets, end = [], 0
        for entry in entries:  # each tensor starts aligned; no padding after the last
            offsets.append(_aligned(end))
            end = offsets[-1] + _nbytes(entry)
        payload = torch.empty(end, dtype=torch.uint8, device=device)
        _broadcast(engine_group, payload, src)
        for entry, at in zip(entries, offsets):
            dtype = getattr(torch, entry["dtype"])
            yield entry["name"], payload[at : at + _nbytes(entry)].view(dtype).view(entry["shape"])


class _Sender:
    """Exported tensors copied into one payload as they come, broadcast when the next would overflow it, so the sender
    holds `export_weights`' bucket plus this one; a tensor larger than a bucket goes alone, from its own bytes."""

    def __init__(self, group: dist.ProcessGroup, src: int, capacity: int, device: torch.device | str | None) -> None:
        self.group, self.src, self.capacity, self.device = group, src, capacity, device
        self.entries: list[dict] = []
        self.payload: torch.Tensor | None = None
        self.at = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.to(self.device) if self.device is not None else tensor
        self.device = tensor.device
        entry = {"name": name, "dtype": str(tensor.dtype).removeprefix("torch."), "shape": list(tensor.shape)}
        if self.entries and _aligned(self.at) + tensor.nbytes > self.capacity:
            self.flush()
        if tensor.nbytes > self.capacity:
            self._broadcast([entry], tensor.contiguous().reshape(-1).view(torch.uint8))
            return
        if self.payload is None:
            self.payload = torch.empty(self.capacity, dtype=torch.uint8, device=tensor.device)
        begin = _aligned(self.at)
        self.payload[begin : begin + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        self.at = begin + tensor.nbytes
        self.entries.append(entry)

    def flush(self) -> None:
        if self.entries:
            assert self.payload is not None  # always: add allocates it before its first entry
            self._broadcast(self.entries, self.payload[: self.at])
        self.entries, self.at = [], 0

    def _broadcast(self, entries: list[dict], payload: torch.Tensor) -> None:
        header = torch.tensor(list(json.dumps(entries).encode()), dtype=torch.uint8, device=payload.device)
        _broadcast(self.group, torch.tensor([header.numel()], dtype=torch.int64, device=payload.device), self.src)
        _broadcast(self.group, header, self.src)
        _broadcast(self.group, payload, self.src)


def _broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int) -> None:
    """A broadcast on the group object itself, with `src` its own rank: works for groups outside the world too."""
    options = dist.BroadcastOptions()
    options.rootRank = src
    group.broadcast([tensor], options).wait()


def _nbytes(entry: dict) -> int:
    return math.prod(entry["shape"]) * getattr(torch, entry["dtype"]).itemsize


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
