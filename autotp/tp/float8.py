"""torchao float8 training (`convert_to_float8_training`) on sharded linears, as one process computes it.

torchao's tensorwise recipe casts each operand of a `Float8Linear`'s three matmuls with one scale, 448 / amax of the
whole tensor. Under TP a column layer's weight and output gradient and a row layer's weight and input are shards, so
their amax is all-reduced (MAX) over the TP group before the cast (torchao's own `reduce_amax`): every element is then
cast as one process casts it. The cast operands go to torchao's matmul (`matmul_with_hp_or_float8_args`), which uses
an operand already in float8 as given, forward and backward. With one scale per tensor the forward's cast of an
operand is the one its backward would make again, so this is exact for tensorwise scaling only; `refusal` names every
other configuration before wrap changes anything. torchao is imported only from a model that already holds its layers.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from ..compat.torchao import is_float8_linear
from ..mesh import Group

SHARDED_OPERANDS = {"column": ("weight", "grad_output"), "row": ("input", "weight")}


def refusal(module: nn.Module) -> str | None:
    """Why a torchao module cannot be sharded exactly (None: a tensorwise `Float8Linear`, which can)."""
    if not is_float8_linear(module):
        return "autotp shards torchao's Float8Linear (convert_to_float8_training) only"
    from torchao.float8.config import ScalingGranularity, ScalingType

    config: Any = module.config
    if config.enable_fsdp_float8_all_gather:
        return "enable_fsdp_float8_all_gather (FSDP2's float8 all-gather) is not supported under autotp"
    casts = [
        ("input", config.cast_config_input, config.cast_config_input_for_grad_weight),
        ("weight", config.cast_config_weight, config.cast_config_weight_for_grad_input),
        ("grad_output", config.cast_config_grad_output, config.cast_config_grad_output_for_grad_weight),
    ]
    for role, forward, backward in casts:
        for cast in (forward, backward):
            if cast.scaling_granularity is not ScalingGranularity.TENSORWISE or cast.scaling_type is not (
                ScalingType.DYNAMIC
            ):
                return (
                    f"its {role} is cast with {cast.short_str()} ({cast.scaling_granularity.value}, "
                    f"{cast.scaling_type.value}); autotp shards the tensorwise recipe only (Float8LinearConfig() or "
                    f"Float8LinearConfig.from_recipe_name('tensorwise'))"
                )
        if forward != backward:
            return (
                f"its {role} is cast differently forward ({forward.short_str()}) and backward ({backward.short_str()})"
            )
    return None


class _Mesh:
    """What torchao's amax reduction reads of a device mesh: the group."""

    def __init__(self, group: Group):
        self.group = group

    def get_group(self) -> Group:
        return self.group


class _CastGradOutput(torch.autograd.Function):
    """Identity forward; backward casts the output gradient (a shard) with the amax over the TP group."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, float8: Float8Matmul) -> torch.Tensor:
        ctx.float8 = float8
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        from torchao.float8.float8_training_tensor import GemmInputRole

        float8 = ctx.float8
        return float8.cast(grad, float8.config.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT), None


class Float8Matmul:
    """A converted `Float8Linear`'s float8 matmul, kept by the sharded layer that replaces it (`autotp.tp.layers`)."""

    def __init__(self, linear: nn.Module, group: Group):
        self.config: Any = linear.config
        self.mm_config: Any = linear.linear_mm_config
        self.mesh = _Mesh(group)

    def __deepcopy__(self, memo: dict) -> Float8Matmul:
        """A copied layer (PEFT's modules_to_save) computes alike, on the same group (a handle, not data)."""
        new = Float8Matmul.__new__(Float8Matmul)
        new.config, new.mm_config, new.mesh = self.config, self.mm_config, self.mesh
        return new

    def __call__(
        self, x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None, sharded: Iterable[str]
    ) -> torch.Tensor:
        """`x @ weight_t + bias` as torchao's `Float8Linear.forward` computes it, the `sharded` operands ("input",
        "weight", "grad_output") scaled by their amax over the TP group. Collective over it when any is sharded."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import GemmInputRole

        sharded = set(sharded)
        if torch.is_autocast_enabled():  # Float8Linear's own autocast step (its GPU dtype)
            x = x.to(torch.get_autocast_dtype("cuda"))
        if "input" in sharded:
            x = self.cast(x, self.config.cast_config_input, GemmInputRole.INPUT)
        if "weight" in sharded:
            weight_t = self.cast(weight_t, self.config.cast_config_weight, GemmInputRole.WEIGHT)
        y = matmul_with_hp_or_float8_args.apply(x, weight_t, self.mm_config, self.config)
        if "grad_output" in sharded:
            y = _CastGradOutput.apply(y, self)
        # torchao returns a view made inside its Function, which autograd forbids modifying in place (a row layer's
        # all-reduce does): a copy, the one Float8Linear's own bias add makes
        return y.clone() if bias is None else y + bias.to(y.dtype)

    def cast(self, tensor: torch.Tensor, cast_config: Any, role: Any) -> torch.Tensor:
        """`tensor` (a shard) in float8, scaled by the amax of the whole tensor (all-reduced over the TP group)."""
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic

        return hp_tensor_to_float8_dynamic(
            tensor,
            cast_config.target_dtype,
            self.mm_config,
            reduce_amax=True,
            gemm_input_role=role,
            device_mesh=self.mesh,
            round_scales_to_power_of_2=self.config.round_scales_to_power_of_2,
        )


def float8_matmul(linear: nn.Module, group: Group) -> Float8Matmul | None:
    """The float8 matmul of `linear` if torchao converted it, for the sharded layer replacing it."""
    return Float8Matmul(linear, group) if is_float8_linear(linear) else None


def computes_float8(module: nn.Module) -> bool:
    """Whether `module` is a `Float8Linear`, or a sharded layer that replaced one."""
    return is_float8_linear(module) or isinstance(getattr(module, "float8", None), Float8Matmul)
