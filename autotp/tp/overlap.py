"""Overlapping the column layers' weight gradients with their input gradient's all-reduce (Megatron's overlap).

Each column layer's backward returns dL/dX at once and leaves dL/dW to the block entry's backward,
which computes it while the one all-reduce of dL/dX (packed with any replicated LoRA weights'
partial gradients) is in flight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..mesh import Group, group_size
from ..runtime.collectives import all_reduce_packed, weight_grad
from ..runtime.second_order import refuse_second_order


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
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, deferred: DeferredWeights, index: int
    ) -> torch.Tensor:
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


def deferred_column_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, deferred: DeferredWeights, index: int
) -> torch.Tensor:
    """`F.linear` on an entered input whose weight gradient is computed during the entry's all-reduce."""
    return _DeferredColumnLinear.apply(x, weight, bias, deferred, index)


class _CopyToTPJoined(torch.autograd.Function):
    """Column-parallel entry with replicated weights: identity forward; backward, one all-reduce of dL/dX packed
    with the weights' partial gradients, while the deferred weight gradients of the layers reading it compute."""

    @staticmethod
    def forward(
        ctx,
        group: dist.ProcessGroup,
        deferred: DeferredWeights | None,
        joined: int,
        x: torch.Tensor,
        *weights: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.group, ctx.deferred, ctx.joined = group, deferred, joined
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in (x, *weights))

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        refuse_second_order(
            "a tensor-parallel layer's input, whose gradient is all-reduced over TP (a collective: no derivative)",
            "wrap with tp_size=1 for them",
        )
        reduced = grads[: ctx.joined + 1]  # dL/dX and the replicated weights' partial gradients
        wanted = [i for i, grad in enumerate(reduced) if ctx.needs_input_grad[i + 3] and grad is not None]
        later: list = []
        meanwhile = None if ctx.deferred is None else lambda: later.extend(ctx.deferred.grads())
        result: list = [None] * len(grads)
        if wanted:
            for i, summed in zip(wanted, all_reduce_packed([reduced[i] for i in wanted], ctx.group, meanwhile)):
                result[i] = summed
        elif meanwhile is not None:
            meanwhile()
        for offset, grad in enumerate(later):
            result[ctx.joined + 1 + offset] = grad
        return (None, None, None, *result)


def copy_to_tp_joined(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    group: Group,
    deferred: Sequence[torch.Tensor] = (),
    transposed: Sequence[bool] = (),
) -> tuple[list[torch.Tensor], DeferredWeights | None]:
    """`copy_to_tp` of `x`, and `weights` (replicated, each rank's gradient partial) entering with it: ([x, *weights,
    *deferred] as used inside the span, the DeferredWeights). The weights' gradients are summed over the TP group
    in the same all-reduce as x's; the `deferred` weights' (the column layers', `transposed` when stored [in, out])
    are computed while it runs, from what `deferred_column_linear` leaves."""
    if group_size(group) == 1:
        return [x, *weights, *deferred], None
    pending = DeferredWeights(list(transposed)) if deferred else None
    return list(_CopyToTPJoined.apply(group, pending, len(weights), x, *weights, *deferred)), pending
