"""A gated MLP's product `act(gate) * up` recomputed in the row layer's backward instead of kept.

In `down_proj(act(gate_proj(x)) * up_proj(x))` autograd keeps four [tokens, ffn / tp] tensors:
gate (for act's backward), act(gate) and up (for the product's) and the product (for down_proj's
weight gradient). Two suffice: the row layer recognises the pattern in the autograd graph, takes
gate and up as its inputs in place of the product, and in backward recomputes act(gate) and the
product (elementwise, under 1% of the block's time) to give the same gradients, bit for bit. The
model's own act and product nodes are then unreferenced and free what they saved.

Only an exact match takes this path: the product of an activation below (applied out of place) of
one column layer's output and another's (or of the two halves of one, chunked), in the product's dtype. Anything else (LoRA, dropout, an
upcast, a tensor hook on the product, `torch.compile`, where inductor plans recomputation itself) keeps the plain
matmul. A tensor hook on act(gate) does not fire: its node is bypassed.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..runtime.collectives import weight_grad
from ..runtime.second_order import refuse_second_order

Activation = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]


def _silu_backward(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """silu's backward as autograd computes it: aten's kernel, or, building a graph for second-order gradients, the
    differentiable formula autograd uses there (aten's `silu_backward` has no derivative)."""
    if not torch.is_grad_enabled():
        return torch.ops.aten.silu_backward(grad, x)
    sigmoid = torch.sigmoid(x)
    return grad * sigmoid * (1 + x * (1 - sigmoid))


def _activation(node) -> Activation | None:
    """(forward, backward) of the activation whose autograd node is `node`, as autograd itself computes them."""
    name = type(node).__name__
    if name == "SiluBackward0":
        return F.silu, _silu_backward
    if name == "GeluBackward0":
        approximate = node._saved_approximate
        return (
            lambda x: F.gelu(x, approximate=approximate),
            lambda grad, x: torch.ops.aten.gelu_backward(grad, x, approximate=approximate),
        )
    return None


def _operand(edge: tuple, column_output: Callable[[object, int], torch.Tensor | None]) -> torch.Tensor | None:
    """The tensor behind autograd edge `edge` if it is a column layer's output, or an equal split of one (a fused
    gate_up projection chunked in two, as Phi-3's); else None."""
    node, index = edge
    output = column_output(node, index)
    if output is not None or type(node).__name__ != "SplitBackward0":
        return output
    whole = column_output(*node.next_functions[0])
    if whole is None:
        return None
    dim = node._saved_dim if node._saved_dim < 2**63 else node._saved_dim - 2**64  # a negative dim reads unsigned
    return whole.split(node._saved_split_size, dim)[index]


def match(
    x: torch.Tensor, column_output: Callable[[object, int], torch.Tensor | None]
) -> tuple[Activation, torch.Tensor, torch.Tensor] | None:
    """(activation, gate, up) if `x` is `act(gate) * up` (either order) of two column layers' outputs or two parts of
    one, found by `column_output(node, output_nr)`; else None."""
    if torch.compiler.is_compiling():  # reading the graph would break dynamo's
        return None
    node = x.grad_fn
    if type(node).__name__ != "MulBackward0" or x._backward_hooks:  # a hook on the product must see its gradient
        return None
    edges = node.next_functions
    for act_edge, up_edge in ((edges[0], edges[1]), (edges[1], edges[0])):
        act = _activation(act_edge[0]) if act_edge[0] is not None else None
        if act is None or up_edge[0] is None:
            continue
        gate, up = _operand(act_edge[0].next_functions[0], column_output), _operand(up_edge, column_output)
        if (
            gate is not None
            and up is not None
            and gate.shape == up.shape == x.shape
            and (gate.dtype == up.dtype == x.dtype)
        ):
            return act, gate, up
    return None


class _GLURowLinear(torch.autograd.Function):
    """The row layer's matmul on `act(gate) * up`, keeping gate and up: backward recomputes the product."""

    @staticmethod
    def forward(
        ctx,
        gate: torch.Tensor,
        up: torch.Tensor,
        weight: torch.Tensor,
        product: torch.Tensor,
        act: Activation,
        transposed: bool,
    ) -> torch.Tensor:
        device = product.device.type
        ctx.cast = torch.is_autocast_enabled(device)
        if ctx.cast:  # autocast's cast, made here so backward sees the same dtypes
            dtype = torch.get_autocast_dtype(device)
            product, weight = product.to(dtype), weight.to(dtype)
        ctx.save_for_backward(gate, up, weight)
        ctx.act, ctx.transposed, ctx.device = act, transposed, device
        with torch.autocast(device, enabled=False):
            return F.linear(product, weight.t() if transposed else weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # gate, up and the weight are its inputs, so a graph built for second-order gradients reaches them
        if ctx.cast:
            refuse_second_order(
                "a gated MLP's row layer under autocast, whose backward reads the weight's autocast copy",
                "wrap with recompute_glu=False for them",
            )
        gate, up, weight = ctx.saved_tensors
        forward, backward = ctx.act
        with torch.autocast(ctx.device, enabled=False):
            activated = forward(gate)
            grad_weight = None
            if ctx.needs_input_grad[2]:  # a frozen row weight needs no product
                product = (activated * up).to(weight.dtype)
                grad_weight = weight_grad(product, grad) if ctx.transposed else weight_grad(grad, product)
                del product
            grad_product = (grad @ (weight.t() if ctx.transposed else weight)).to(gate.dtype)
            return backward(grad_product * up, gate), grad_product * activated, grad_weight, None, None, None


def glu_linear(
    x: torch.Tensor, weight: torch.Tensor, transposed: bool, found: tuple[Activation, torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    """`x @ W.T` (no bias) for `x = act(gate) * up` as `match` found it, saving gate and up instead of `x`."""
    act, gate, up = found
    return _GLURowLinear.apply(gate, up, weight, x.detach(), act, transposed)
