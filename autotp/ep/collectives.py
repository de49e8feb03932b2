"""The collectives of an expert-parallel MoE layer over the EP group, each an autograd Function beside its backward:
the per-expert counts (no gradient), then the tokens, all-to-all there and reversed in backward.

Over the TP group (when EP shares ranks with TP) the TP ranks hold the same tokens, so each keeps its own share before
the dispatch and the shares are all-gathered after it, so every token goes through the experts once, not once per TP
rank: `autotp.runtime.seq_collectives`' `keep_dim0_share` / `gather_dim0_shares` pair, which SP shares.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh import named_failure
from ..runtime.second_order import refuse_second_order


def exchange_counts(counts: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Row i of `counts` to EP rank i; returns row j of every rank j's counts (how many tokens it sends here)."""
    received = torch.empty_like(counts)
    with named_failure(group, "the all-to-all of the expert-parallel token counts"):
        dist.all_to_all_single(received, counts.contiguous(), group=group)
    return received


def exchange(tokens: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """`send[i]` of `tokens` to EP rank i, `receive[j]` tokens back from rank j (dropless: buffers follow counts)."""
    return _AllToAll.apply(tokens, send, receive, group)


class _AllToAll(torch.autograd.Function):
    """All-to-all of tokens forward / the reverse all-to-all backward."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup):
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _all_to_all(tokens, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_order(
            "the expert-parallel all-to-all of the tokens (a collective: no derivative)", "wrap with ep_size=1 for them"
        )
        return _all_to_all(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _all_to_all(tokens: torch.Tensor, send: list[int], receive: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = tokens.new_empty((sum(receive), *tokens.shape[1:]))
    with named_failure(group, "the expert-parallel all-to-all of the tokens"):
        dist.all_to_all_single(
            out, tokens.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group
        )
    return out
