"""A sharded attention block's tensors besides its projections, from a policy rule: per-head parameters (gpt-oss's
sinks, one entry per query head) split with the heads, and norms over the width the block splits (BitNet's sub-norms)
computed exactly, their statistic all-reduced and their weight split as the width is."""

from __future__ import annotations

from torch import nn

from .plan import HeadsPlan, NormPlan, ParamPlan
from .policy import Rule
from .sharding import Partition


def sharded_norms(
    path: str, block: nn.Module, rule: Rule, partition: Partition
) -> tuple[list[NormPlan], list[ParamPlan]]:
    """The rule's norms over the width `block` splits (`partition`), and their weights split as the width is."""
    norms, weights = [], []
    modules = dict(block.named_modules())
    for name, stat in rule.sharded_norms.items():
        if name not in modules:
            continue
        params = dict(modules[name].named_parameters())
        if set(params) - {"weight"} or ("weight" in params and params["weight"].shape != (partition.full_size,)):
            shapes = {n: tuple(p.shape) for n, p in params.items()}
            raise ValueError(f"{path}.{name}: a norm over {partition.full_size} columns holds {shapes}")
        norms.append(NormPlan(f"{path}.{name}", stat, partition.full_size))
        if params:
            weights.append(
                ParamPlan(f"{path}.{name}.weight", (partition.full_size,), partition, path, "a sharded norm's weight")
            )
    return norms, weights


def head_params(path: str, block: nn.Module, rule: Rule, heads: HeadsPlan) -> list[ParamPlan]:
    """The rule's per-head parameters of `block` (sinks), split along dim 0 as its query heads are."""
    out = []
    for name in rule.head_params:
        param = getattr(block, name, None)
        if param is None:
            continue
        if not isinstance(param, nn.Parameter) or param.dim() == 0 or param.shape[0] != heads.heads:
            shape = tuple(getattr(param, "shape", ()))
            raise ValueError(f"{path}.{name}: a per-head parameter needs {heads.heads} rows on dim 0, got {shape}")
        out.append(ParamPlan(f"{path}.{name}", tuple(param.shape), heads.partition(0), path, "per head"))
    return out
