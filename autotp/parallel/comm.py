"""The autograd collectives of tensor parallelism, and the gathers behind full weights.

Every collective that sits on the autograd path is one short `torch.autograd.Function` with its
forward and backward side by side (Megatron-LM's f / g operators). Each helper takes the process
group explicitly; a group of `None` (no tensor parallelism) or of size 1 returns its input at once,
so tp=1 runs the same code with no communication.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch import nn

from .groups import Group, group_rank, group_size, named_failure
from ..planning.sharding import Partition


def all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """`dist.all_reduce` in place; a failed or timed-out peer is reported with the group's ranks."""
    with named_failure(group, "all-reduce"):
        dist.all_reduce(tensor, op=op, group=group)


def all_gather(buffers: list[torch.Tensor], tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """`dist.all_gather`; a failed or timed-out peer is reported with the group's ranks."""
    with named_failure(group, "all-gather"):
        dist.all_gather(buffers, tensor, group=group)


class _CopyToTP(torch.autograd.Function):
    """Column-parallel entry (Megatron f): identity forward, all-reduce of dL/dX backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Out of place: autograd may hand the same gradient buffer to other branches.
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, ctx.group)
        return grad, None


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


def _all_reduce_packed(tensors: list[torch.Tensor], group: dist.ProcessGroup,
                       meanwhile: Callable[[], Any] | None = None) -> list[torch.Tensor]:
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


def weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dL/dW of `F.linear(x, W)` from dL/dY, summed over every token: [out, in]."""
    return grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1])


class DeferredWeights:
    """The weight gradients of the column layers reading one entered input, left by each layer's backward to the
    entry's backward, which computes them while the input gradient's all-reduce runs (Megatron's overlap)."""

    def __init__(self, transposed: list[bool]):
        self.transposed = transposed  # per weight: stored [in, out] (GPT-2's Conv1D)
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (weight index, dL/dY, X)

    def grads(self) -> list[torch.Tensor | None]:
        out: list = [None] * len(self.transposed)
        for index, grad, x in self.pending:
            weight = weight_grad(x, grad) if self.transposed[index] else weight_grad(grad, x)  # Conv1D's [in, out]
            out[index] = weight if out[index] is None else out[index] + weight
        self.pending = []
        return out


class _DeferredColumnLinear(torch.autograd.Function):
    """A column layer's matmul on the entered input: backward returns dL/dX now and leaves dL/dW to the entry."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, deferred: DeferredWeights,
                index: int) -> torch.Tensor:
        device = x.device.type
        if torch.is_autocast_enabled(device):  # autocast's cast, made here so backward sees the same dtypes
            dtype = torch.get_autocast_dtype(device)
            x, weight, bias = x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.deferred, ctx.index, ctx.has_bias = deferred, index, bias is not None
        matrix = weight.t() if deferred.transposed[index] else weight
        with torch.autocast(device, enabled=False):
            return torch.nn.functional.linear(x, matrix, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        matrix = weight.t() if ctx.deferred.transposed[ctx.index] else weight
        ctx.deferred.pending.append((ctx.index, grad, x))
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad @ matrix, None, grad_bias, None, None


class _CopyToTPJoined(torch.autograd.Function):
    """Column-parallel entry with replicated weights: identity forward; backward, one all-reduce of dL/dX packed
    with the weights' partial gradients, while the deferred weight gradients of the layers reading it compute."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, deferred: DeferredWeights | None, joined: int, x: torch.Tensor,
                *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.deferred, ctx.joined = group, deferred, joined
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in (x, *weights))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        reduced = grads[:ctx.joined + 1]  # dL/dX and the replicated weights' partial gradients
        wanted = [i for i, grad in enumerate(reduced) if ctx.needs_input_grad[i + 3] and grad is not None]
        later: list = []
        meanwhile = None if ctx.deferred is None else lambda: later.extend(ctx.deferred.grads())
        result: list = [None] * len(grads)
        if wanted:
            for i, summed in zip(wanted, _all_reduce_packed([reduced[i] for i in wanted], ctx.group, meanwhile)):
                result[i] = summed
        elif meanwhile is not None:
            meanwhile()
        for offset, grad in enumerate(later):
            result[ctx.joined + 1 + offset] = grad
        return (None, None, None, *result)


class _ReduceFromTPJoined(torch.autograd.Function):
    """Row-parallel exit of several partial results (a layer's and its LoRA's): one all-reduce forward packing
    them, identity backward."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *partials: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(_all_reduce_packed(list(partials), group))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *grads)


class _GatherFromTP(torch.autograd.Function):
    """Leave a sharded region for replicated code (logits for a user): all-gather forward, keep own slice backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, partition: Partition, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.partition, ctx.rank = partition, dist.get_rank(group)
        return partition.unshard(_gather_padded(x, partition, group, dst=None))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.partition.shard(grad, ctx.rank), None, None


def gather_from_tp(x: torch.Tensor, partition: Partition, group: Group) -> torch.Tensor:
    """The whole tensor from every rank's shard, differentiably (downstream code is replicated)."""
    if group_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, partition, group)


def _chunk_shape(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> list[int]:
    """The shape of one rank's chunk of `x`: `dim` (the sequence) divided by the group size."""
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"sequence_parallel needs the sequence length ({x.shape[dim]}) to be a multiple of "
                         f"tp_size={size}; pad the batch")
    shape = list(x.shape)
    shape[dim] //= size
    return shape


def own_chunk(x: torch.Tensor, group: dist.ProcessGroup, dim: int, copy: bool = True) -> torch.Tensor:
    """This rank's chunk of `x`, a copy (a view of a contiguous `x` without `copy`): its equal share of the tokens in
    memory order (batch-major), shaped as `x` with the sequence `dim` divided. Token-major chunks make the
    collectives copy-free: the gathered tensor is the ranks' chunks one after another. Every op between blocks is
    per token (norms, residual adds)."""
    shape = _chunk_shape(x, group, dim)
    flat = x.reshape(-1)
    count = flat.numel() // group_size(group)
    chunk = flat.narrow(0, dist.get_rank(group) * count, count).view(shape)
    return chunk.clone() if copy else chunk


def _all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's chunk, joined into the whole tensor: one all-gather straight into it."""
    return _start_gather_seq(x, group, dim)()


def _start_gather_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int,
                      async_op: bool = False) -> Callable[[], torch.Tensor]:
    """Start `_all_gather_seq` (asynchronously with `async_op`); the returned call waits and gives its result."""
    size = group_size(group)
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))  # the ranks' chunks one after another: the whole tensor
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    with named_failure(group, "all-gather"):
        work = gather(out, x, group=group, async_op=async_op)
    shape = list(x.shape)
    shape[dim] *= size

    def finish() -> torch.Tensor:
        if work is not None and async_op:
            with named_failure(group, "all-gather"):
                work.wait()
        return out.view(shape)

    return finish


def _reduce_scatter_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Sum over the group and keep this rank's chunk: one reduce-scatter, no full-size result and no copy."""
    out = x.new_empty(_chunk_shape(x, group, dim))  # refuse a length that does not divide before communicating
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    with named_failure(group, "reduce-scatter"):
        scatter(out.view(-1), x.contiguous().view(-1), group=group)
    return out


class _ScatterToSeq(torch.autograd.Function):
    """Enter the sequence-sharded residual stream: keep this rank's chunk forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return own_chunk(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather_seq(grad, ctx.group, ctx.dim), None, None


class _GatherFromSeq(torch.autograd.Function):
    """Leave the sequence-sharded stream for replicated code: all-gather forward, keep own chunk backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return own_chunk(grad, ctx.group, ctx.dim), None, None


class _AllGatherSeqToTP(torch.autograd.Function):
    """Enter a column-parallel block under sequence parallelism: all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _all_gather_seq(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter_seq(grad, ctx.group, ctx.dim), None, None


class _ReduceScatterSeqFromTP(torch.autograd.Function):
    """Leave a row-parallel block under sequence parallelism: reduce-scatter forward, all-gather backward (which
    then starts the all-gather the block's column layers will need, to run during the block's backward)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup, dim: int, prefetch: SavedChunk | None
                ) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.prefetch = group, dim, prefetch
        if prefetch is not None:
            ctx.save_for_backward(prefetch.chunk)
        return _reduce_scatter_seq(y, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = _all_gather_seq(grad, ctx.group, ctx.dim)
        if ctx.prefetch is not None:
            ctx.prefetch.prefetch(*ctx.saved_tensors)
        return grad, None, None, None


class SavedChunk:
    """This rank's sequence chunk of a gathered block input, saved once for all the column layers reading it
    (q, k, v or gate, up), and gathered again in backward once for all of them.

    It holds the chunk only until the block's forward ends (`release`); from then on only the readers'
    `save_for_backward` copies keep it, so activation checkpointing can drop it and recompute it."""

    def __init__(self, full: torch.Tensor, group: dist.ProcessGroup, dim: int):
        self.source = weakref.ref(full)  # which input it is, without keeping the gathered input alive
        self.group, self.dim = group, dim
        self.chunk: torch.Tensor | None = own_chunk(full.detach(), group, dim)
        self.users = 0  # layers whose backward still needs the gathered input
        self._full: torch.Tensor | None = None
        self._started: Callable[[], torch.Tensor] | None = None

    def release(self) -> None:
        """The block's forward is over: from here only the readers' saved copies hold the chunk."""
        self.chunk = None

    def prefetch(self, chunk: torch.Tensor) -> None:
        """Start gathering the input again from `chunk` now, asynchronously, for the column layers' backward later."""
        if self._full is None and self._started is None and self.users > 0:
            self._started = _start_gather_seq(chunk, self.group, self.dim, async_op=True)

    def full(self, chunk: torch.Tensor) -> torch.Tensor:
        """The gathered input, all-gathered from `chunk` by the first layer whose backward asks (or prefetched),
        dropped after the last."""
        if self._full is None:
            started, self._started = self._started, None
            self._full = started() if started is not None else _all_gather_seq(chunk, self.group, self.dim)
        full = self._full
        self.users -= 1
        self._full = full if self.users > 0 else None
        return full


class _SeqParallelColumnLinear(torch.autograd.Function):
    """Column linear on a sequence-gathered input that keeps only its own chunk: re-all-gathered in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, saved: SavedChunk
                ) -> torch.Tensor:
        ctx.save_for_backward(saved.chunk, weight)  # one tensor for every layer sharing `saved`
        ctx.saved, ctx.has_bias = saved, bias is not None
        saved.users += 1
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        chunk, weight = ctx.saved_tensors
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad @ weight, weight_grad(grad, ctx.saved.full(chunk)), grad_bias, None


def seq_parallel_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               saved: SavedChunk | None) -> torch.Tensor:
    """`F.linear` whose saved input is this rank's sequence chunk only (the activation memory SP saves), shared
    with the other layers reading the same input (`saved`; None without tensor parallelism)."""
    if saved is None:
        return torch.nn.functional.linear(x, weight, bias)
    return _SeqParallelColumnLinear.apply(x, weight, bias, saved)


def scatter_to_seq(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    return x if group_size(group) == 1 else _ScatterToSeq.apply(x, group, dim)


def gather_from_seq(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    return x if group_size(group) == 1 else _GatherFromSeq.apply(x, group, dim)


def all_gather_seq_to_tp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    return x if group_size(group) == 1 else _AllGatherSeqToTP.apply(x, group, dim)


def reduce_scatter_seq_from_tp(y: torch.Tensor, group: Group, dim: int = 1,
                               prefetch: SavedChunk | None = None) -> torch.Tensor:
    """Reduce-scatter along the sequence; `prefetch`: the block's saved input, gathered again early in backward."""
    return y if group_size(group) == 1 else _ReduceScatterSeqFromTP.apply(y, group, dim, prefetch)


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Enter a column-parallel region: gradients of `x` are summed over the TP group."""
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(y: torch.Tensor, group: Group) -> torch.Tensor:
    """Leave a row-parallel region: partial results are summed over the TP group."""
    if group_size(group) == 1:
        return y
    return _ReduceFromTP.apply(y, group)


def copy_to_tp_joined(x: torch.Tensor, weights: list[torch.Tensor], group: Group,
                      deferred: list[torch.Tensor] = (), transposed: list[bool] = ()
                      ) -> tuple[list[torch.Tensor], DeferredWeights | None]:
    """`copy_to_tp` of `x`, and `weights` (replicated, each rank's gradient partial) entering with it: ([x, *weights,
    *deferred] as used inside the region, the DeferredWeights). The weights' gradients are summed over the TP group
    in the same all-reduce as x's; the `deferred` weights' (the column layers', `transposed` when stored [in, out])
    are computed while it runs, from what `deferred_column_linear` leaves."""
    if group_size(group) == 1:
        return [x, *weights, *deferred], None
    pending = DeferredWeights(list(transposed)) if deferred else None
    return list(_CopyToTPJoined.apply(group, pending, len(weights), x, *weights, *deferred)), pending


def deferred_column_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           deferred: DeferredWeights, index: int) -> torch.Tensor:
    """`F.linear` on an entered input whose weight gradient is computed during the entry's all-reduce."""
    return _DeferredColumnLinear.apply(x, weight, bias, deferred, index)


def reduce_from_tp_joined(partials: list[torch.Tensor], group: Group) -> list[torch.Tensor]:
    """`reduce_from_tp` of several partial results in one all-reduce (one per dtype)."""
    if group_size(group) == 1:
        return partials
    return list(_ReduceFromTPJoined.apply(group, *partials))


def grad_allreduce_hook(group: Group, enabled: Callable[[], bool]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Gradient hook for a replicated parameter that only sees this rank's heads (per-head norms).

    Its true gradient is the sum of every rank's partial one; `enabled()` turns the sum off while
    the layers hold full weights and every rank already computes the whole gradient.
    """

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if group_size(group) == 1 or not enabled():
            return grad
        grad = grad.clone(memory_format=torch.contiguous_format)
        all_reduce(grad, group)
        return grad

    return hook


def replica_grad_hook(
    partition: Partition, rank: int, groups: Mapping[tuple[int, ...], Group], enabled: Callable[[], bool]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Gradient hook for rows several ranks hold (a replicated KV head): sum each over its holders.

    Each holder computes only its own query heads' share of that head's gradient.
    """
    spans = partition.replicas(rank)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if not enabled():
            return grad
        grad = grad.clone(memory_format=torch.contiguous_format)
        for offset, length, holders in spans:
            piece = grad.narrow(partition.dim, offset, length)
            summed = piece.contiguous()
            all_reduce(summed, groups[holders])
            piece.copy_(summed)
        return grad

    return hook


class GradHook:
    """A gradient hook on parameter `param` of `owner`, put on whichever tensor holds that name when `owner` runs:
    a frozen parameter takes no tensor hook until it is unfrozen, a parameter replaced by loading with
    assign=True is a new tensor, and FSDP2 computes on an unsharded copy of it (its hook then runs
    before FSDP reduces the gradient over data parallelism)."""

    def __init__(self, owner: nn.Module, param: nn.Parameter, hook: Callable[[torch.Tensor], torch.Tensor]):
        self.owner, self.hook = owner, hook
        self.name = next(name for name, p in owner._parameters.items() if p is param)
        self._hooked: dict[int, tuple[weakref.ref, Any]] = {}  # id(tensor) -> (the tensor, its hook handle)
        self._attach(param)
        self._watch = owner.register_forward_pre_hook(self._current)

    def _attach(self, tensor: torch.Tensor) -> None:
        if not tensor.requires_grad:
            return
        held = self._hooked.get(id(tensor))
        if held is None or held[0]() is not tensor:
            self._hooked = {key: (ref, handle) for key, (ref, handle) in self._hooked.items() if ref() is not None}
            self._hooked[id(tensor)] = (weakref.ref(tensor), tensor.register_hook(self.hook))

    def _current(self, module: nn.Module, args) -> None:
        tensor = module._parameters.get(self.name)
        if tensor is not None:
            self._attach(tensor)

    def remove(self) -> None:
        self._watch.remove()
        for _, handle in self._hooked.values():
            handle.remove()
        self._hooked = {}


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


def all_gather_full(shard: torch.Tensor, partition: Partition, group: Group) -> torch.Tensor:
    """Every rank's shard of one tensor, reassembled into the full tensor on every rank."""
    if group_size(group) == 1:
        return partition.unshard([shard])
    shards = _gather_padded(shard, partition, group, dst=None)
    return partition.unshard(shards)


def gather_full_to(shard: torch.Tensor, partition: Partition, group: Group, dst: int = 0) -> torch.Tensor | None:
    """The full tensor on group rank `dst` (None elsewhere), holding one copy only there."""
    if group_size(group) == 1:
        return partition.unshard([shard])
    shards = _gather_padded(shard, partition, group, dst=dst)
    return None if shards is None else partition.unshard(shards)


def _gather_padded(shard: torch.Tensor, partition: Partition, group: dist.ProcessGroup, dst: int | None):
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
        buffers = [torch.empty_like(shard) for _ in range(world)] if mine else None
        dist.gather(shard, buffers, dst=dist.get_global_rank(group, dst), group=group)
        if not mine:
            return None
    return [b.narrow(dim, 0, partition.local_size(r)) for r, b in enumerate(buffers)]


def buckets(tensors: list[torch.Tensor], max_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of tensors of one dtype and device, each up to `max_bytes`, to flatten into one collective."""
    bucket, used = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        if bucket and (used + size > max_bytes or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, used = [], 0
        bucket.append(t)
        used += size
    if bucket:
        yield bucket
