"""The dim-0 collective pairs, and the sequence-parallel collectives built on them.

Two pairs, each autograd function beside its dual. An all-gather along dim 0 in forward has a reduce-scatter as its
backward, and vice versa (`all_gather_dim0` / `reduce_scatter_dim0`): SP's block entry and exit, CP's keys and
values and the FSDP row gathers share it. Keeping this rank's share of dim 0 has the all-gather of the shares'
gradients as its backward, and the all-gather of the shares keeps this rank's share of the gradient
(`keep_dim0_share` / `gather_dim0_shares`, shares uneven where the group size does not divide dim 0): SP's entry to
and exit from the sequence-sharded stream, and EP's tokens split over TP, share it. Token-major sequence chunks
(`own_chunk`) make the sequence collectives these pairs plus a view. `SavedChunk` lets the column layers reading one
gathered input keep only this rank's chunk, gathered again once in backward.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.distributed as dist

from ..compat import torch as torch_compat
from ..mesh import Group, group_rank, group_size, named_failure
from ..planning.sharding import split_ranges
from .collectives import weight_grad
from .second_order import refuse_second_order


def check_divisible(length: int, size: int) -> None:
    """Refuse a sequence that does not split evenly over the TP group's `size` ranks."""
    if length % size:
        raise ValueError(
            f"sequence_parallel needs the sequence length ({length}) to be a multiple of tp_size={size}; pad the "
            f"batch (a tokenizer's pad_to_multiple_of={size})"
        )


def _chunk_shape(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> list[int]:
    """The shape of one rank's chunk of `x`: `dim` (the sequence) divided by the group size."""
    size = group_size(group)
    check_divisible(x.shape[dim], size)
    shape = list(x.shape)
    shape[dim] //= size
    return shape


def own_chunk(x: torch.Tensor, group: dist.ProcessGroup, dim: int, copy: bool = True) -> torch.Tensor:
    """This rank's chunk of `x`, a copy (a view of a contiguous `x` without `copy`): its equal share of the tokens in
    memory order (batch-major), shaped as `x` with the sequence `dim` divided. Token-major chunks make the
    collectives copy-free: the gathered tensor is the ranks' chunks one after another. Every op between blocks is
    per token (norms, residual adds)."""
    rows = _chunk_rows(x, group, dim)
    share = dim0_share(rows.shape[0], group)
    return _copied(rows[share.start : share.stop], copy)


def _chunk_rows(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """`x` viewed (copied if not contiguous) as the ranks' token-major chunks one after another along dim 0."""
    shape = _chunk_shape(x, group, dim)
    return x.reshape(group_size(group) * shape[0], *shape[1:])


def dim0_share(length: int, group: Group) -> range:
    """This rank's rows of a dim 0 of `length` split over `group`: consecutive, the first `length % size` ranks
    holding one more (`split_ranges`)."""
    return split_ranges(length, group_size(group))[group_rank(group)]


def start_all_gather(
    x: torch.Tensor, group: dist.ProcessGroup, dim: int = 0, async_op: bool = False, of: str = ""
) -> Callable[[], torch.Tensor]:
    """Start the one all-gather of every rank's `x` (asynchronously with `async_op`); the returned call waits and gives
    the ranks' tensors one after another in memory, viewed as `x` with `dim` times the group size: joined along dim 0,
    or along the sequence `dim` of token-major chunks (`own_chunk`). `of` names what travels, for a failure."""
    size = group_size(group)
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    gather = torch_compat.all_gather_single()
    with named_failure(group, f"all-gather{of}"):
        work = gather(out, x, group=group, async_op=async_op)
    shape = list(x.shape)
    shape[dim] *= size

    def finish() -> torch.Tensor:
        if work is not None and async_op:
            with named_failure(group, f"all-gather{of}"):
                work.wait()
        return out.view(shape)

    return finish


def all_gather_seq(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Every rank's chunk, joined into the whole tensor: one all-gather straight into it."""
    return start_all_gather(x, group, dim)()


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, of: str = "") -> torch.Tensor:
    """Sum over the group and keep this rank's share of dim 0: one reduce-scatter, no full-size result."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    with named_failure(group, f"reduce-scatter{of}"):
        torch_compat.reduce_scatter_single()(out, x, group=group)
    return out


class _AllGatherDim0(torch.autograd.Function):
    """All-gather along dim 0 forward / reduce-scatter backward (the dual of `_ReduceScatterDim0`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, of: str) -> torch.Tensor:
        ctx.group, ctx.of = group, of
        return start_all_gather(x, group, of=of)()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_order(
            f"a sequence or context split's all-gather{ctx.of} (a collective: no derivative)",
            "wrap with tp_size=1 and cp_size=1 for them",
        )
        return _reduce_scatter(grad, ctx.group, ctx.of), None, None


def all_gather_dim0(x: torch.Tensor, group: Group, of: str = "") -> torch.Tensor:
    """Every rank's `x` one after another along dim 0; each rank's gradient is its rows of the sum over ranks.
    SP's block entry, CP's keys and values and the row gathers share it; `of` names what travels, for a failure."""
    return x if group_size(group) == 1 else _AllGatherDim0.apply(x, group, of)


class _ReduceScatterDim0(torch.autograd.Function):
    """Reduce-scatter along dim 0 forward / all-gather backward (the dual of `_AllGatherDim0`); the backward then
    starts `prefetch`'s all-gather, to run during the block's backward."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: dist.ProcessGroup, of: str, prefetch: SavedChunk | None) -> torch.Tensor:
        ctx.group, ctx.of, ctx.prefetch = group, of, prefetch
        if prefetch is not None:
            ctx.save_for_backward(prefetch.chunk)
        return _reduce_scatter(y, group, of)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_order(
            f"a sequence or context split's reduce-scatter{ctx.of} (a collective: no derivative)",
            "wrap with tp_size=1 and cp_size=1 for them",
        )
        grad = start_all_gather(grad, ctx.group, of=ctx.of)()
        if ctx.prefetch is not None:
            ctx.prefetch.prefetch(*ctx.saved_tensors)
        return grad, None, None, None


def reduce_scatter_dim0(
    y: torch.Tensor, group: Group, of: str = "", prefetch: SavedChunk | None = None
) -> torch.Tensor:
    """The sum over ranks of `y`, this rank's share of dim 0; the gradient is every rank's gathered along dim 0.
    `prefetch`: a block's saved input, gathered again early in backward."""
    return y if group_size(group) == 1 else _ReduceScatterDim0.apply(y, group, of, prefetch)


class _KeepDim0Share(torch.autograd.Function):
    """This rank's share of dim 0 forward / all-gather of the shares' gradients backward (the dual of
    `_GatherDim0Shares`)."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, copy: bool, of: str, *tensors: torch.Tensor):
        ctx.group, ctx.of, ctx.length = group, of, tensors[0].shape[0]
        share = dim0_share(ctx.length, group)
        return tuple(_copied(t[share.start : share.stop], copy) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        refuse_second_order(
            f"a sequence or context split's kept share{ctx.of} (a collective: no derivative)",
            "wrap with tp_size=1 and cp_size=1 for them",
        )
        return (
            None,
            None,
            None,
            *(None if g is None else _gather_shares(g, ctx.length, ctx.group, ctx.of) for g in grads),
        )


class _GatherDim0Shares(torch.autograd.Function):
    """All-gather of the ranks' shares of dim 0 forward / this rank's share of the gradient backward (the dual of
    `_KeepDim0Share`): the gathered tensor feeds code every rank runs alike, so its gradient is already whole on every
    rank, and summing it would count it once per rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, length: int, group: dist.ProcessGroup, copy: bool, of: str) -> torch.Tensor:
        ctx.share, ctx.copy = dim0_share(length, group), copy
        return _gather_shares(x, length, group, of)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _copied(grad[ctx.share.start : ctx.share.stop], ctx.copy), None, None, None, None


def keep_dim0_share(
    tensors: tuple[torch.Tensor, ...], group: Group, copy: bool = False, of: str = ""
) -> tuple[torch.Tensor, ...]:
    """This rank's share (`dim0_share`) of each of `tensors`, which every rank of `group` holds whole and alike (views
    of them, copies with `copy`); their gradients are all-gathered in backward. `of` names what travels."""
    return tensors if group_size(group) == 1 else _KeepDim0Share.apply(group, copy, of, *tensors)


def gather_dim0_shares(x: torch.Tensor, length: int, group: Group, copy: bool = False, of: str = "") -> torch.Tensor:
    """Every rank's share (`dim0_share`) of a dim 0 of `length`, `x` being this rank's, joined in rank order; the
    gradient is this rank's share of the whole one (a copy with `copy`). `of` names what travels, for a failure."""
    return x if group_size(group) == 1 else _GatherDim0Shares.apply(x, length, group, copy, of)


def _gather_shares(x: torch.Tensor, length: int, group: dist.ProcessGroup, of: str) -> torch.Tensor:
    """The all-gather of `gather_dim0_shares`: straight into the result when the shares are equal, else of the shares
    padded to the longest (every rank sends one shape), the padding dropped after."""
    size = group_size(group)
    if length % size == 0:
        return start_all_gather(x, group, of=of)()
    shares = split_ranges(length, size)
    padded = x.new_zeros((max(len(share) for share in shares), *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in shares]
    with named_failure(group, f"all-gather{of}"):
        dist.all_gather(parts, padded, group=group)
    return torch.cat([part[: len(share)] for part, share in zip(parts, shares)])


def _copied(x: torch.Tensor, copy: bool) -> torch.Tensor:
    return x.clone() if copy else x


def scatter_to_seq(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Enter the sequence-sharded residual stream: keep this rank's chunk (`own_chunk`) forward, all-gather backward."""
    if group_size(group) == 1:
        return x
    return keep_dim0_share((_chunk_rows(x, group, dim),), group, copy=True)[0]


def gather_from_seq(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Leave the sequence-sharded stream for replicated code: all-gather forward, keep own chunk backward."""
    if group_size(group) == 1:
        return x
    shape = list(x.shape)
    shape[dim] *= group_size(group)
    return gather_dim0_shares(x, group_size(group) * x.shape[0], group, copy=True).view(shape)


def all_gather_seq_to_tp(x: torch.Tensor, group: Group, dim: int = 1) -> torch.Tensor:
    """Enter a column-parallel block under sequence parallelism: all-gather forward, reduce-scatter backward."""
    if group_size(group) == 1:
        return x
    shape = list(x.shape)
    shape[dim] *= group_size(group)
    return all_gather_dim0(x, group).view(shape)  # token-major chunks: the ranks' chunks one after another


def reduce_scatter_seq_from_tp(
    y: torch.Tensor, group: Group, dim: int = 1, prefetch: SavedChunk | None = None
) -> torch.Tensor:
    """Leave a row-parallel block under sequence parallelism: reduce-scatter along the sequence forward, all-gather
    backward; `prefetch`: the block's saved input, gathered again early in backward."""
    if group_size(group) == 1:
        return y
    shape = _chunk_shape(y, group, dim)  # refuse a length that does not divide before communicating
    return reduce_scatter_dim0(y.reshape(group_size(group) * shape[0], *shape[1:]), group, prefetch=prefetch)


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
            self._started = start_all_gather(chunk, self.group, self.dim, async_op=True)

    def full(self, chunk: torch.Tensor) -> torch.Tensor:
        """The gathered input, all-gathered from `chunk` by the first layer whose backward asks (or prefetched),
        dropped after the last."""
        if self._full is None:
            started, self._started = self._started, None
            self._full = started() if started is not None else all_gather_seq(chunk, self.group, self.dim)
        full = self._full
        self.users -= 1
        self._full = full if self.users > 0 else None
        return full


class _SeqParallelColumnLinear(torch.autograd.Function):
    """Column linear on a sequence-gathered input that keeps only its own chunk: re-all-gathered in backward."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, saved: SavedChunk
    ) -> torch.Tensor:
        ctx.save_for_backward(saved.chunk, weight)  # one tensor for every layer sharing `saved`
        ctx.saved, ctx.has_bias = saved, bias is not None
        saved.users += 1
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_order(
            "a sequence-parallel column layer, whose input is all-gathered again (a collective: no derivative)",
            "wrap with sequence_parallel=False for them",
        )
        chunk, weight = ctx.saved_tensors
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad @ weight, weight_grad(grad, ctx.saved.full(chunk)), grad_bias, None


def seq_parallel_column_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, saved: SavedChunk | None
) -> torch.Tensor:
    """`F.linear` whose saved input is this rank's sequence chunk only (the activation memory SP saves), shared
    with the other layers reading the same input (`saved`; None without tensor parallelism)."""
    if saved is None:
        return torch.nn.functional.linear(x, weight, bias)
    return _SeqParallelColumnLinear.apply(x, weight, bias, saved)
