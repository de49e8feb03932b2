"""A sharded block's tensors besides its projections, from a policy rule: per-head or per-column parameters (gpt-oss's
sinks, one entry per query head; Dory's per-channel scales) split with the heads or the width, and norms over the
width the block splits (BitNet's sub-norms) computed exactly, their statistic all-reduced and their weight split as
the width is."""

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


def head_params(path: str, block: nn.Module, rule: Rule, heads: HeadsPlan | None, width: Partition) -> list[ParamPlan]:
    """The rule's parameters of `block` split on dim 0 with what the block splits: one entry per query head (sinks,
    `heads.partition`), or one per column of the split width (`width`: the heads' channels, Dory's `sqk` and `s_gate`,
    or an MLP's width, its `suv_gate`). A block without heads (an MLP) has the width alone."""
    out = []
    for name in rule.head_params:
        param = getattr(block, name, None)
        if param is None:
            continue
        rows = param.shape[0] if isinstance(param, nn.Parameter) and param.dim() else None
        if heads is not None and rows == heads.heads:
            out.append(ParamPlan(f"{path}.{name}", tuple(param.shape), heads.partition(0), path, "per head"))
        elif rows == width.full_size:
            out.append(ParamPlan(f"{path}.{name}", tuple(param.shape), width.with_dim(0), path, "per column"))
        else:
            shape = tuple(getattr(param, "shape", ()))
            counts = f"{heads.heads} (one per head) or " if heads is not None else ""
            raise ValueError(f"{path}.{name}: a split parameter needs {counts}{width.full_size} rows on dim 0, got {shape}")
    return out
