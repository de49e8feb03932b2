"""The collectives of an expert-parallel MoE layer, each an autograd Function beside its backward.

Over the EP group: the per-expert counts (no gradient), then the tokens, all-to-all there and reversed in backward.
Over the TP group (when EP shares ranks with TP): the TP ranks hold the same tokens, so each keeps its own rows before
the dispatch and the rows are all-gathered after it; every token then goes through the experts once, not once per TP
rank. The gradient of the whole output is the same on every TP rank, so the gather's backward keeps this rank's rows
(no sum: summing would add a spurious factor of tp), and the split's backward all-gathers the rows' gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh import Group, group_rank, group_size, named_failure
from ..planning.sharding import split_ranges


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row i of `counts` to EP rank i; returns row j of every rank j's counts (how many tokens it sends here)."""
    received = torch.empty_like(counts)
    with named_failure(group, "the all-to-all of the expert-parallel token counts"):
        dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


def exchange(tokens: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """`send[i]` rows of `tokens` to EP rank i, `receive[j]` rows back from rank j (dropless: buffers follow counts)."""
    return _AllToAll.apply(tokens, send, receive, group)


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows forward / the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(tokens, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _all_to_all(tokens: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = tokens.new_empty((sum(receive), *tokens.shape[1:]))
    with named_failure(group, "the expert-parallel all-to-all of the tokens"):
        dist.all_to_all_single(out, tokens.contiguous(), output_split_sizes=receive, input_split_sizes=send,
                               group=group)
    return out


def own_rows(rows: int, group: Group) -> range:
    """The rows of a batch of `rows` tokens this TP rank dispatches (uneven when tp does not divide them)."""
    return split_ranges(rows, group_size(group))[group_rank(group)]


def split_rows(tensors: tuple[torch.Tensor, ...], group: Group) -> tuple[torch.Tensor, ...]:
    """This TP rank's rows of tensors every TP rank holds whole; their gradients are all-gathered in backward."""
    if group_size(group) == 1:
        return tensors
    return _SplitRows.apply(group, *tensors)


def gather_rows(tensor: torch.Tensor, rows: int, group: Group) -> torch.Tensor:
    """Every TP rank's rows (`own_rows`) of a `rows`-row tensor, all-gathered; backward keeps this rank's rows."""
    if group_size(group) == 1:
        return tensor
    return _GatherRows.apply(tensor, rows, group)


class _SplitRows(torch.autograd.Function):
    """This rank's rows forward / the all-gather of the rows' gradients backward."""

    @staticmethod
    def forward(ctx, group: dist.ProcessGroup, *tensors: torch.Tensor):
        ctx.group, ctx.rows = group, tensors[0].shape[0]
        mine = own_rows(ctx.rows, group)
        return tuple(t[mine.start:mine.stop] for t in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return (None, *(None if g is None else _all_gather_rows(g, ctx.rows, ctx.group) for g in grads))


class _GatherRows(torch.autograd.Function):
    """All-gather of the TP ranks' rows forward / this rank's rows of the (replicated) gradient backward."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, rows: int, group: dist.ProcessGroup):
        ctx.mine = own_rows(rows, group)
        return _all_gather_rows(tensor, rows, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.mine.start:ctx.mine.stop], None, None


def _all_gather_rows(tensor: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The `own_rows` of every rank, in rank order; padded to the longest so every rank sends one shape."""
    ranges = split_ranges(rows, group_size(group))
    longest = max(len(r) for r in ranges)
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    parts = [torch.empty_like(padded) for _ in ranges]
    with named_failure(group, "the all-gather of the expert-parallel rows over TP"):
        dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:len(r)] for part, r in zip(parts, ranges)])
