"""The tensor-parallel collectives: primitives, Megatron's f/g pair, and the gathers behind full weights.

Every collective on the autograd path is one short `torch.autograd.Function` with its forward and
backward side by side (Megatron-LM's f / g operators). The code between a column-parallel entry and
its row-parallel exit, where activations are split over the TP group, is a TP span (Megatron's "region"; in
autotp a region is a module sharded as one unit: `ShardedRegion`, `ExpertRegion`, the plan's `regions`). Each
helper takes the process group explicitly; a group of `None` or of size 1 returns its input at once, so tp=1 runs the same code.

Full tensors for a file travel point to point instead (`autotp.io.streaming`): that protocol writes files.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..mesh import Group, group_rank, group_size, named_failure
from ..planning.sharding import Partition
from .second_order import refuse_second_order


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """`dist.all_reduce` in place; a failed or timed-out peer is reported with the group's ranks."""
    with named_failure(group, "all-reduce"):
        dist.all_reduce(tensor, op=op, group=group)


def all_gather(buffers: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """`dist.all_gather`; a failed or timed-out peer is reported with the group's ranks."""
    with named_failure(group, "all-gather"):
        dist.all_gather(buffers, tensor, group=group)


def weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dL/dW of `F.linear(x, W)` from dL/dY, summed over every token: [out, in]."""
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


def all_reduce_packed(
    tensors: list[torch.Tensor], group: dist.ProcessGroup, meanwhile: Callable[[], Any] | None = None
) -> list[torch.Tensor]:
    """`tensors` summed over `group`, out of place: one all-reduce per dtype, of that dtype's tensors packed flat.

    `meanwhile` runs while the all-reduces are in flight (started asynchronously, waited for after it).
    """
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    flats, works = [], []
    with named_failure(group, "all-reduce"):
        for indices in by_dtype.values():
            flats.append(torch.cat([tensors[i].reshape(-1) for i in indices]))
            works.append(dist.all_reduce(flats[-1], group=group, async_op=meanwhile is not None))
        if meanwhile is not None:
            meanwhile()
            for work in works:
                work.wait()
    out: list = [None] * len(tensors)
    for indices, flat in zip(by_dtype.values(), flats):
        for i, piece in zip(indices, flat.split([tensors[i].numel() for i in indices])):
            out[i] = piece.view_as(tensors[i])
    return out


class _CopyToTP(torch.autograd.Function):
    """Column-parallel entry (Megatron f): identity forward, all-reduce of dL/dX backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_order(
            "a tensor-parallel layer's input, whose gradient is all-reduced over TP (a collective: no derivative)",
            "wrap with tp_size=1 for them",
        )
        # Out of place: autograd may hand the same gradient buffer to other branches.
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, ctx.group)
        return grad, None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a TP span (column-parallel): gradients of `x` are summed over the TP group."""
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


class _ReduceFromTP(torch.autograd.Function):
    """Row-parallel exit (Megatron g): all-reduce of the partial outputs forward, identity backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        y = y.contiguous()
        all_reduce(y, group)
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def reduce_from_tp(y: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a TP span (row-parallel): partial results are summed over the TP group."""
    if group_size(group) == 1:
        return y
    return _ReduceFromTP.apply(y, group)


class _ReduceFromTPJoined(torch.autograd.Function):
    """Row-parallel exit of several partial results (a layer's and its LoRA's): one all-reduce forward packing
    them, identity backward."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *partials: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(all_reduce_packed(list(partials), group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *grads)


def reduce_from_tp_joined(partials: list[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """`reduce_from_tp` of several partial results in one all-reduce (one per dtype)."""
    if group_size(group) == 1:
        return partials
    return list(_ReduceFromTPJoined.apply(group, *partials))


class _GatherFromTP(torch.autograd.Function):
    """Leave a TP span for replicated code (logits for a user): all-gather forward, keep own slice backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, partition: Partition, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.partition, ctx.rank = partition, dist.get_rank(group)
        return partition.unshard(gather_padded(x, partition, group, dst=None))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.partition.shard(grad, ctx.rank), None, None


def gather_from_tp(x: torch.Tensor, partition: Partition, group: Group) -> torch.Tensor:
    """The whole tensor from every rank's shard, differentiably (downstream code is replicated)."""
    if group_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, partition, group)


def all_gather_full(shard: torch.Tensor, partition: Partition, group: Group) -> torch.Tensor:
    """Every rank's shard of one tensor, reassembled into the full tensor on every rank."""
    if group_size(group) == 1:
        return partition.unshard([shard])
    shards = gather_padded(shard, partition, group, dst=None)
    return partition.unshard(shards)


def gather_full_to(shard: torch.Tensor, partition: Partition, group: Group, dst: int = 0) -> torch.Tensor | None:
    """The full tensor on group rank `dst` (None elsewhere), holding one copy only there.

    With full-tensor streams about (`autotp.io.streaming`), call `streaming.gather_after_streams`: a stream left
    unread would keep its senders from this gather."""
    if group_size(group) == 1:
        return partition.unshard([shard])
    shards = gather_padded(shard, partition, group, dst=dst)
    return None if shards is None else partition.unshard(shards)


def gather_padded(shard: torch.Tensor, partition: Partition, group: dist.ProcessGroup, dst: int | None):
    """Gather shards of possibly unequal length along `partition.dim`, padding to the longest."""
    world = group_size(group)
    longest = max(partition.local_size(r) for r in range(world))
    dim = partition.dim
    shard = shard.detach()
    pad = longest - shard.shape[dim]
    if pad:
        shape = list(shard.shape)
        shape[dim] = pad
        shard = torch.cat([shard, shard.new_zeros(shape)], dim=dim)
    shard = shard.contiguous()
    if dst is None:
        buffers = [torch.empty_like(shard) for _ in range(world)]
        all_gather(buffers, shard, group)
    else:
        mine = group_rank(group) == dst
        gathered = [torch.empty_like(shard) for _ in range(world)] if mine else None
        with named_failure(group, "gather of full-weight shards to one rank"):
            dist.gather(shard, gathered, dst=dist.get_global_rank(group, dst), group=group)
        if gathered is None:  # not `mine`
            return None
        buffers = gathered
    return [b.narrow(dim, 0, partition.local_size(r)) for r, b in enumerate(buffers)]


def buckets(tensors: list[torch.Tensor], max_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each up to `max_bytes`, to flatten into one collective."""
    bucket: list[torch.Tensor] = []
    used = 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if bucket and (used + size > max_bytes or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, used = [], 0
        bucket.append(t)
        used += size
    if bucket:
        yield bucket


BUCKET_BYTES = 25 << 20  # DDP's default bucket: few collectives, no full flat copy of the model


def all_reduce_bucketed(tensors: list[torch.Tensor], group: Group, what: str, divisor: int = 1) -> None:
    """Sum each of `tensors` over `group` in place, flattened into ~25 MB `buckets` (one all-reduce each, a failure
    named as `what`), then divide by `divisor` (an average over replicas); the gradient syncs of DP and EP share it."""
    if group_size(group) == 1:
        for tensor in tensors if divisor != 1 else ():
            tensor.div_(divisor)
        return
    for bucket in buckets(tensors, BUCKET_BYTES):
        flat = _flatten_dense_tensors(bucket)
        with named_failure(group, what):
            dist.all_reduce(flat, group=group)
        if divisor != 1:
            flat /= divisor
        for tensor, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            tensor.copy_(synced)


def any_rank(flags: list[bool], groups: list[Group], device: torch.device, what: str) -> list[bool]:
    """Each of `flags` or'ed over every rank of `groups` (one MAX all-reduce each, a failure named as `what`): which
    parameters some rank's batch reached, when the ranks' batches take different paths through the model."""
    if not flags or all(group_size(group) == 1 for group in groups):
        return flags
    agreed = torch.tensor(flags, dtype=torch.int32, device=device)
    for group in groups:
        if group_size(group) > 1:
            with named_failure(group, what):
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    return agreed.bool().tolist()
