"""The LM head and the vocab-parallel loss over chunks of tokens: a training forward never holds its logits whole.

In a training forward with labels the head returns `PendingLogits`, a stand-in of the logits' shape that holds no
memory and keeps the head's input. The sharded loss, given that stand-in untouched, computes each chunk's logits,
loss and gradients (the hidden states' and the head's, Liger-style) in its forward and keeps only those gradients,
O(tokens x hidden + vocab/tp x hidden), for its backward. Any other use of the stand-in (a softcap, a scale, LoRA's
sum, a user reading `output.logits`) computes the real logits through the head, differentiably, so it stays exact.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from ..runtime.collectives import copy_to_tp
from ..runtime.lazy_logits import PendingLogits
from .layers import shard_grad_, shard_loss


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed loss of `hidden @ weight.T (+ bias)` against `target` on a vocab shard, chunk by chunk; each chunk's
    gradients for the hidden states, weight and bias are computed in the forward (at unit output gradient), so only
    they are kept: the backward scales them by the output's gradient."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        start: int,
        full_vocab: int,
        ignore_index: int,
        smoothing: float,
        group: dist.ProcessGroup,
        chunk: int,
    ) -> torch.Tensor:
        total = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        )
        for at in range(0, hidden.shape[0], chunk):
            h = hidden[at : at + chunk]
            logits = torch.nn.functional.linear(h, weight, bias)
            loss, softmax, local, mine, valid = shard_loss(
                logits, target[at : at + chunk], start, full_vocab, ignore_index, smoothing, group
            )
            total += (loss * valid).sum()
            dlogits = shard_grad_(softmax, local, mine, smoothing, full_vocab)
            dlogits *= valid.unsqueeze(-1)
            if grad_hidden is not None:
                grad_hidden[at : at + chunk] = dlogits @ weight.float()
            if grad_weight is not None:
                grad_weight.addmm_(dlogits.t(), h.float())
            if grad_bias is not None:
                grad_bias += dlogits.sum(0)
        ctx.save_for_backward(
            *(g.to(like.dtype) if g is not None else None for g, like in ((grad_hidden, hidden), (grad_weight, weight)))
        )
        ctx.grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)  # type: ignore[union-attr]
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        scaled = [None if g is None else g * grad.to(g.dtype) for g in (grad_hidden, grad_weight, ctx.grad_bias)]
        return (*scaled, None, None, None, None, None, None, None)


class ChunkedHead:
    """The vocab-parallel head's forward (patched in by `apply_vocab`) returning `PendingLogits` in a training forward
    with labels, where the chunked loss is exact; everywhere else it is the head's own forward.

    Off (today's path) under sequence or context parallelism, FSDP2, autocast, torch.compile, a transposed head, a
    head wrapped by another module (PEFT's LoRA, whose adapter shares the head's block entry) or `loss_chunk` of None
    or 0. `chunked` counts the losses computed over chunks.
    """

    def __init__(self, head: Any, group: dist.ProcessGroup, chunk: int, state: Any):
        self.head, self.group, self.chunk, self.state = head, group, chunk, state
        self.original: Callable[[torch.Tensor], torch.Tensor] = head.forward
        self.armed = False
        self.chunked = 0

    def before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's forward pre-hook: arm for one head call in a training forward given labels."""
        options = self.state.options
        self.armed = (
            module.training
            and torch.is_grad_enabled()
            and kwargs.get("labels") is not None
            and not (options.sequence_parallel or options.cp_size > 1 or self.state.fsdp)
            and not self.head.transposed
            and module.get_output_embeddings() is self.head  # not wrapped (LoRA on the head)
            and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled()
        )

    def after(self, *_: Any) -> None:
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed or x.dtype != self.head.weight.dtype:
            return self.original(x)
        self.armed = False  # the model's own head call; any other is the head's
        head = self.head
        return PendingLogits(
            copy_to_tp(x, self.group), lambda h: head.local_linear(h, head.bias), head.weight.shape[0], x.dtype
        )

    def loss_sum(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        start: int,
        full_vocab: int,
        ignore_index: int,
        smoothing: float,
    ) -> torch.Tensor | None:
        """The summed loss over chunks when `logits` is this head's stand-in, untouched; else None."""
        if not isinstance(logits, PendingLogits) or logits.computed is not None:
            return None
        self.chunked += 1
        hidden = logits.hidden.reshape(-1, logits.hidden.shape[-1])
        head = self.head
        return _ChunkedLinearCrossEntropy.apply(
            hidden, head.weight, head.bias, target, start, full_vocab, ignore_index, smoothing, self.group, self.chunk
        )
