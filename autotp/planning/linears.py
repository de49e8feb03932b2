"""What autotp needs to know about a linear layer: its features and which weight dim a split cuts.

HF models hold `nn.Linear` and GPT-2's `Conv1D`, whose weight is stored transposed ([in, out]), and parallel-experts
linears (JetMoE's `JetMoeParallelExperts`): one weight [experts, out, in] and nothing else, each expert a linear.
"""

from __future__ import annotations

from torch import nn

from ..compat.hf import is_conv1d


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def is_expert_linear(module: nn.Module) -> bool:
    """A parallel-experts linear: a weight [experts, out, in] its only tensor (no bias)."""
    weight = getattr(module, "weight", None)
    return (
        not is_linear(module)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 3
        and [p for p in module.parameters()] == [weight]
    )


def features(module: nn.Module) -> tuple[int, int]:
    """(out, in) of an nn.Linear, a GPT-2 Conv1D (whose weight is stored [in, out]) or a parallel-experts linear."""
    if is_expert_linear(module):
        return module.weight.shape[1], module.weight.shape[2]
    if is_conv1d(module):
        return module.weight.shape[1], module.weight.shape[0]
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    raise TypeError(f"expected an nn.Linear or Conv1D, found {type(module).__name__}")


def weight_dim(module: nn.Module, style: str) -> int:
    """The dim of the stored weight that a column (output) or row (input) split cuts."""
    if is_expert_linear(module):
        return 1 if style == "column" else 2
    transposed = is_conv1d(module)
    return (1 if transposed else 0) if style == "column" else (0 if transposed else 1)
