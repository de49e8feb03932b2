"""The causal-LM loss under context parallelism: each rank's tokens' sum, added over CP, divided by the whole batch's
target count, so every rank returns the loss one process computes (see `autotp.cp.apply`'s module doc)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import group_size
from ..runtime.collectives import all_reduce
from ..runtime.input_agreement import BACKWARD, check_same_read
from .layout import LAYOUT_KWARG


class _SumOverCP(torch.autograd.Function):
    """The loss's sum over CP: all-reduce forward; backward passes C times the gradient on (see the module doc). The
    backward, the first of the CP backward (the loss is its root), first checks that every CP rank began it: a rank
    still reading the forward's logits (a collective, `check_same_read`) is named on every rank, not left hanging."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.size, ctx.group = group_size(group), group
        ctx.check = not torch.compiler.is_compiling()  # compiled: logits are gathered in the forward, never read later
        x = x.clone()
        all_reduce(x, group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.check:
            check_same_read(ctx.group, grad.device, BACKWARD)
        return grad * ctx.size, None


class CPLoss:
    """Stands in for the model's `loss_function` (ForCausalLM semantics) on this rank's chunk of the logits; `context`
    is the model's `ContextParallel` (its group, layout and per-forward counters)."""

    def __init__(self, context: Any, inner: Callable[..., torch.Tensor]):
        self.context, self.inner = context, inner

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor | None,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        layout = kwargs.pop(LAYOUT_KWARG, None) or self.context.layout
        if layout is None or logits.shape[1] != layout.local.numel():  # the whole sequence (gathered, generation)
            return self.inner(
                logits,
                labels,
                vocab_size=vocab_size,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        if shift_labels is None:  # shifted before the split: no target is lost at a chunk border
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        local = layout.split(shift_labels, pad=ignore_index)
        total = self.inner(
            logits,
            None,
            vocab_size=vocab_size,
            num_items_in_batch=1,
            ignore_index=ignore_index,
            shift_labels=local,
            **kwargs,
        )  # a sum over this rank's tokens
        self.context.loss_calls += 1
        total = _SumOverCP.apply(total.float(), self.context.group)
        self.context.unsynced |= total.requires_grad  # a backward will leave this rank's share
        if num_items_in_batch is None:
            num_items_in_batch = (shift_labels != ignore_index).sum()
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
