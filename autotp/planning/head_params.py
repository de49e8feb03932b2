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


def head_params(path: str, block: nn.Module, rule: Rule, split: HeadsPlan | Partition) -> list[ParamPlan]:
    """The rule's parameters of `block` split along dim 0 with what it splits. An attention block's heads (a
    `HeadsPlan`): one entry per head (sinks) or a run per head (Dory's `sqk`, `s_gate`: one per query column). An MLP's
    width (a `Partition`): one entry per column (Dory's `suv_gate`, `suv_up`)."""
    out = []
    for name in rule.head_params:
        param = getattr(block, name, None)
        if param is None:
            continue
        rows = param.shape[0] if isinstance(param, nn.Parameter) and param.dim() else 0
        count = split.heads if isinstance(split, HeadsPlan) else split.full_size
        if not rows or rows % count or not isinstance(split, HeadsPlan) and rows != count:
            shape = tuple(getattr(param, "shape", ()))
            what = f"a multiple of {count} heads'" if isinstance(split, HeadsPlan) else f"the width's {count}"
            raise ValueError(f"{path}.{name}: a parameter split with the block needs {what} rows on dim 0, got {shape}")
        if isinstance(split, HeadsPlan):
            unit = rows // count
            runs = tuple(((first * unit, n * unit),) for first, n in split.local)
            reason = "per head" if unit == 1 else f"per head, {unit} entries each"
            out.append(ParamPlan(f"{path}.{name}", tuple(param.shape), Partition(0, rows, runs), path, reason))
        else:
            out.append(ParamPlan(f"{path}.{name}", tuple(param.shape), split.with_dim(0), path, "per column"))
    return out
