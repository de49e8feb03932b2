"""torchao float8 training (`convert_to_float8_training`) on sharded linears, as one process computes it.

torchao's `Float8Linear` casts the operands of its three matmuls (output = input @ weight_t, grad_input =
grad_output @ weight_t.T, grad_weight = grad_output.T @ input) to float8, each with a scale 448 / amax taken over the
whole tensor (tensorwise) or along one axis (axiswise: the rowwise recipes, one scale per row or column, the amax
taken along the matmul's reduction axis). Under TP a column layer holds a shard of weight_t's and grad_output's last
axis (N), a row layer one of input's last axis and weight_t's first (K). A cast whose amax runs along a sharded axis
(or over the whole of a sharded tensor) takes its amax all-reduced (MAX) over the TP group (torchao's `reduce_amax`);
every other cast is local as it is. Every element is then cast as one process casts it, and each rank's matmul is one
process's over its part of the reduction axis (the layer's all-reduce sums the parts):

    column: grad_input's grad_output (per row, along N) and weight_t (per row, along N); tensorwise: both, all casts
    row:    output's input (per row, along K) and weight_t (per column, along K); tensorwise: both, all casts

`_Float8Matmul` is torchao's `matmul_with_hp_or_float8_args` with that reduction; an operand cast tensorwise alike
forward and backward is cast once (the cast the backward would make again). Where torchao rounds an axiswise product
of a float32 layer to bfloat16, the rounding follows the sum over TP (`Float8Matmul.matmul`).

Under data parallelism a cast whose amax runs along the tokens (tensorwise: input and grad_output, whole tensors;
axiswise: the grad_weight matmul's input and grad_output, per feature along the tokens) takes it over the DP group
too (`scale_over_dp`, every float8 layer of the wrapped model), so the scales are one process's over the whole global
batch; a float32 layer's axiswise grad_weight is then summed over DP before its rounding, as over TP. torchao is imported
only from a model that already holds its layers; `refusal` names what is not sharded exactly before wrap changes
anything.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..compat.torchao import is_float8_linear, is_torchao
from ..mesh import Group, group_rank, group_size
from ..runtime.collectives import all_reduce
from ..runtime.process_hooks import patch_attribute
from ..state import TPState

# the axis of each operand, as torchao's matmul holds it (input [..., K], weight_t [K, N], grad_output [M, N]), along
# which a layer of this style holds a shard
SHARDED_OPERANDS: dict[str, dict[str, int]] = {
    "column": {"weight": -1, "grad_output": -1},
    "row": {"input": -1, "weight": 0},
}


def refusal(module: nn.Module) -> str | None:
    """Why a torchao module cannot be sharded exactly (None: a `Float8Linear`, which can, any recipe)."""
    if not is_float8_linear(module):
        return "autotp shards torchao's Float8Linear (convert_to_float8_training) only"
    if module.config.enable_fsdp_float8_all_gather:
        return (
            "enable_fsdp_float8_all_gather (FSDP2's float8 all-gather) is not supported under autotp: torchao scales "
            "the weight by its amax over the FSDP mesh only, so under TP each rank's shard would take its own scale, "
            "not the whole weight's as one process does. Without it FSDP2 gathers the weight in high precision and "
            "autotp casts it exactly"
        )
    return None


def refuse_torchao(model: nn.Module, under: str | None = None) -> None:
    """Refuse, by name and before anything changes, torchao layers or tensors autotp cannot shard exactly: all but
    `convert_to_float8_training`'s `Float8Linear` (any recipe), its weight in FSDP2's float8 all-gather subclass, a
    quantised weight; and, with `under` (an option such as "cp_size=2"), float8 under a dimension it is not composed
    with yet, whose `refuse` calls this (sequence, context or expert parallelism: a CP rank's amax would be its part
    of the sequence's, one process's the whole's). Found by the module their class is defined in: torchao is not a
    dependency."""
    found = [
        (name, type(module), refusal(module)) for name, module in model.named_modules() if is_torchao(type(module))
    ]
    if under is not None:
        found = [(name, cls, why or f"float8 under {under} is not supported yet") for name, cls, why in found]
    found = [entry for entry in found if entry[2] is not None]
    found += [
        (name, type(p), "autotp shards plain weights only")
        for name, p in model.named_parameters()
        if is_torchao(type(p))
    ]
    if not found:
        return
    (path, cls, why), more = found[0], len(found) - 1
    raise NotImplementedError(
        f"autotp: {path} is torchao's {cls.__name__} ({cls.__module__}.{cls.__qualname__})"
        f"{f', and {more} more modules or parameters' if more else ''}: {why}. autotp's sharded linears would "
        f"replace these and lose float8 or compute it on shards. Convert with convert_to_float8_training (the "
        f"tensorwise, rowwise or rowwise_with_gw_hp recipe, without enable_fsdp_float8_all_gather), or wrap the "
        f"model without the conversion. Nothing was changed."
    )


# the axis of each operand, as `Float8Matmul.cast` gets it, along which the tokens run (input and grad_output
# flattened to [M, K] and [M, N]): a cast whose amax runs along it, or over the whole tensor, spans the replicas' tokens
TOKEN_OPERANDS: dict[str, int] = {"input": 0, "grad_output": 0}


def _cast_once(forward: Any, backward: Any) -> bool:
    """Whether an operand's backward cast is its forward cast again (one scale for the whole tensor, one config)."""
    from torchao.float8.config import ScalingGranularity

    return forward == backward and forward.scaling_granularity is ScalingGranularity.TENSORWISE


class _Float8Matmul(torch.autograd.Function):
    """torchao's `matmul_with_hp_or_float8_args`, each cast scaled over the TP group where its amax crosses a shard."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight_t: torch.Tensor, float8: Float8Matmul, sharded: Mapping[str, int], dp: Group
    ):
        c = float8.config
        ctx.float8, ctx.sharded, ctx.dp = float8, sharded, dp
        x8 = float8.cast(x, c.cast_config_input, "input", -1, sharded, dp)
        w8 = float8.cast(weight_t, c.cast_config_weight, "weight", 0, sharded, dp)
        ctx.save_for_backward(
            x8 if _cast_once(c.cast_config_input, c.cast_config_input_for_grad_weight) else x,
            w8 if _cast_once(c.cast_config_weight, c.cast_config_weight_for_grad_input) else weight_t,
        )
        y = float8.matmul(x8.reshape(-1, x8.shape[-1]), w8, float8.split("input", sharded))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight_t = ctx.saved_tensors
        float8, sharded, dp = ctx.float8, ctx.sharded, ctx.dp
        c = float8.config
        g = grad.reshape(-1, grad.shape[-1])
        g_for_input = float8.cast(g, c.cast_config_grad_output, "grad_output", -1, sharded, dp)
        w_for_input = float8.cast(weight_t, c.cast_config_weight_for_grad_input, "weight", -1, sharded, dp)
        grad_input = float8.matmul(g_for_input, w_for_input.t(), float8.split("grad_output", sharded))
        grad_input = grad_input.reshape(*grad.shape[:-1], -1)
        if not ctx.needs_input_grad[1]:  # a frozen weight (LoRA's base)
            return grad_input, None, None, None, None
        g_for_weight = (
            g_for_input
            if _cast_once(c.cast_config_grad_output, c.cast_config_grad_output_for_grad_weight)
            else float8.cast(g, c.cast_config_grad_output_for_grad_weight, "grad_output", 0, sharded, dp)
        )
        x2 = x.reshape(-1, x.shape[-1])
        x_for_weight = float8.cast(x2, c.cast_config_input_for_grad_weight, "input", 0, sharded, dp)
        # the tokens' sum: each replica's part, which the gradient sync over DP sums
        return grad_input, float8.matmul(g_for_weight.t(), x_for_weight, dp).t(), None, None, None


class Float8Matmul:
    """A converted `Float8Linear`'s float8 matmul, kept by the sharded layer that replaces it (`autotp.tp.layers`)."""

    def __init__(self, linear: nn.Module, group: Group):
        self.config: Any = linear.config
        self.mm_config: Any = linear.linear_mm_config
        self.group = group
        self.dp: Group = None  # the data-parallel replicas, set once the model's mesh is known (`scale_over_dp`)

    def __deepcopy__(self, memo: dict) -> Float8Matmul:
        """A copied layer (PEFT's modules_to_save) computes alike, on the same groups (handles, not data)."""
        new = Float8Matmul.__new__(Float8Matmul)
        new.config, new.mm_config, new.group, new.dp = self.config, self.mm_config, self.group, self.dp
        return new

    def __call__(
        self, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, sharded: Mapping[str, int]
    ) -> torch.Tensor:
        """`x @ weight_t + bias` as torchao's `Float8Linear.forward` computes it, the `sharded` operands' casts
        (`SHARDED_OPERANDS`) scaled over the TP group, and the casts spanning the tokens over the DP group while
        autograd records (training: every replica runs it; an evaluation under no_grad may run on one replica alone,
        its casts then local as torchao's). Collective over those groups."""
        if torch.is_autocast_enabled():  # Float8Linear's own autocast step (its GPU dtype)
            x = x.to(torch.get_autocast_dtype("cuda"))
        y = _Float8Matmul.apply(x, weight_t, self, sharded, self.dp if torch.is_grad_enabled() else None)
        # a view made inside the Function, which autograd forbids modifying in place (a row layer's all-reduce does):
        # a copy, the one Float8Linear's own bias add makes
        return y.clone() if bias is None else y + bias.to(y.dtype)

    def split(self, role: str, sharded: Mapping[str, int]) -> Group:
        """The TP group if operand `role` is a shard along the reduction axis of its matmul (None: not split)."""
        return self.group if role in sharded else None

    def matmul(self, a: torch.Tensor, b: torch.Tensor, group: Group) -> torch.Tensor:
        """`a @ b` as torchao computes it; `group`: its ranks each hold a part of the reduction axis, and their
        products are summed after (over TP: a row layer's output, a column layer's input gradient; over DP: the
        weight gradient's tokens, by the gradient sync).

        torchao rounds a product scaled axiswise to bfloat16 when the layer computes in float32 or float16
        (`addmm_float8_unwrapped`: torch._scaled_mm has no float32 output there). Each rank's part rounded would
        differ from one process's rounded sum, so then the parts are summed unscaled in float32 over the group, and
        the sum scaled and rounded as torchao does it: rank 0 returns it and the others zeros, which the later sum
        (or the gradient sync's average, the scale holding the replicas' factor) keeps exactly. In bfloat16 each
        rank's part is rounded as in any bfloat16 TP or DP matmul: no exchange."""
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, choose_scaled_mm_config

        if not (group_size(group) > 1 and isinstance(a, Float8TrainingTensor) and isinstance(b, Float8TrainingTensor)):
            return torch.mm(a, b)
        gemm = choose_scaled_mm_config(a._gemm_input_role, a._linear_mm_config, b._gemm_input_role, b._linear_mm_config)
        axiswise = a._axiswise_dim is not None or b._axiswise_dim is not None
        if not axiswise or gemm.emulate or a._orig_dtype not in (torch.float32, torch.float16):
            return torch.mm(a, b)
        one = torch.ones((), dtype=torch.float32, device=a.device)
        total = torch.mm(*(Float8TrainingTensor(t._data, one, torch.float32, t._linear_mm_config, t._gemm_input_role)
                           for t in (a, b)))  # fmt: skip
        all_reduce(total, group)
        scale = a._scale.reciprocal() * b._scale.reciprocal()
        if gemm.use_fast_accum:  # torch._scaled_mm scales the float32 sum, then rounds
            y = (total * scale).to(torch.bfloat16)
        else:  # torchao rounds the unscaled sum, then scales it in bfloat16
            y = total.to(torch.bfloat16)
            y *= scale
        y = y.to(a._orig_dtype)
        return y if group_rank(group) == 0 else torch.zeros_like(y)

    def cast(self, tensor: torch.Tensor, cast_config: Any, role: str, dim: int, sharded: Mapping[str, int], dp: Group):
        """`tensor` (operand `role`) in float8 as `cast_config` scales it for a matmul reducing along `dim`, its amax
        all-reduced (MAX) over the TP group where it runs along the axis `sharded` names, and over `dp` where it runs
        along the tokens (`TOKEN_OPERANDS`); as it is if already cast or if the config keeps it in high precision."""
        from torchao.float8.config import ScalingType
        from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_and_scale_to_float8
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax

        if isinstance(tensor, Float8TrainingTensor) or cast_config.scaling_type is ScalingType.DISABLED:
            return tensor
        axis = get_maybe_axiswise_dim(dim, cast_config.scaling_granularity)
        over = [
            group
            for group, axes in ((self.group, sharded), (dp, TOKEN_OPERANDS))
            if role in axes and (axis is None or axis == axes[role]) and group_size(group) > 1
        ]
        with torch.no_grad():
            amax = tensor_to_amax(tensor, scaling_granularity=cast_config.scaling_granularity, axiswise_dim=axis)
            for group in over:  # MAX is associative: TP then DP is the max over both
                all_reduce(amax, group, dist.ReduceOp.MAX)
            scale = amax_to_scale(amax, cast_config.target_dtype, self.config.round_scales_to_power_of_2)
        return hp_tensor_and_scale_to_float8(
            tensor, scale, cast_config.target_dtype, self.mm_config, GemmInputRole(role), axis
        )


class _Float8Forward:
    """An unsharded `Float8Linear`'s forward (a router TP leaves whole) with its token casts scaled over DP."""

    def __init__(self, linear: nn.Module, float8: Float8Matmul):
        self.linear, self.float8 = linear, float8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.float8(x, self.linear.weight.t(), self.linear.bias, {})


def scale_over_dp(model: nn.Module, state: TPState) -> None:
    """Every float8 layer of the wrapped `model` scales its token casts over the DP group, as one process over the
    whole global batch does: the sharded layers' matmuls, and the `Float8Linear` layers TP left whole."""
    if group_size(state.dp_group) == 1:
        return
    for module in model.modules():
        float8 = getattr(module, "float8", None)
        if isinstance(float8, Float8Matmul):
            float8.dp = state.dp_group
        elif is_float8_linear(module):
            whole = Float8Matmul(module, None)
            whole.dp = state.dp_group
            patch_attribute(module, "forward", _Float8Forward(module, whole))


def float8_matmul(linear: nn.Module, group: Group) -> Float8Matmul | None:
    """The float8 matmul of `linear` if torchao converted it, for the sharded layer replacing it."""
    return Float8Matmul(linear, group) if is_float8_linear(linear) else None


def computes_float8(module: nn.Module) -> bool:
    """Whether `module` is a `Float8Linear`, or a sharded layer that replaced one."""
    return is_float8_linear(module) or isinstance(getattr(module, "float8", None), Float8Matmul)
