"""Which modules of a model hold routed experts that expert parallelism can split, and why any other is refused.

Two sources, as for the rest of the plan: the plan's expert regions (a shipped policy or transformers' TP plan), and
structure for the rest: a module named `*experts` with an integer `num_experts`, called as transformers calls its
experts modules, `experts(hidden_states, top_k_index, top_k_weights)` after the model's own router (the
`@use_experts_implementation` classes, gpt-oss's biased and interleaved experts, DBRX's). Each of its parameters must
hold its experts as equal consecutive blocks of dim 0: one entry per expert (fused 3-D tensors, gpt-oss's biases), or
`rows / experts` rows for a 2-D one (DBRX's flat [experts * width, hidden] tensors). A module that keeps its experts some other way is refused by name: Llama
4's take every token scaled by its score, JetMoE's mixture of attention heads, LongCat-Flash's experts that also
run the router's zero-computation (identity) experts, and per-expert modules
(module lists, or switch_transformers' and nllb-moe's `nn.ModuleDict` of `expert_<i>` modules).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn

from ..planning.plan import Plan


@dataclass(frozen=True)
class ExpertLayout:
    """One experts module: its path, its parameters (dotted names under it) and how many experts they hold."""

    path: str
    names: tuple[str, ...]
    experts: int


def takes_routing(module: nn.Module) -> bool:
    """Whether `forward` takes (hidden_states, top_k_index, top_k_weights): three positional parameters."""
    try:
        params = inspect.signature(type(module).forward).parameters.values()
    except (TypeError, ValueError):
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in params) - 1 >= 3  # less self


def _candidates(model: nn.Module, plan: Plan) -> dict[str, nn.Module]:
    """The plan's expert regions, then every other module named `*experts` with an integer `num_experts`. Not a
    parallel-experts linear (a region with a `side`: JetMoE's): a layer of its block, which routes tokens itself."""
    found = {region.path: model.get_submodule(region.path) for region in plan.regions if not region.side}
    for name, module in model.named_modules():
        inside = any(name.startswith(f"{path}.") for path in found)
        if (
            not inside
            and name.rsplit(".", 1)[-1].endswith("experts")
            and isinstance(getattr(module, "num_experts", None), int)
            and next(module.parameters(), None) is not None
        ):
            found.setdefault(name, module)
    return found


def expert_layouts(model: nn.Module, plan: Plan, ep: int) -> list[ExpertLayout]:
    """Every experts module expert parallelism splits at `ep_size=ep`; raises, naming the module, for one it cannot."""
    lists = [
        (name, module)
        for name, module in model.named_modules()
        if name.endswith("experts") and isinstance(module, (nn.ModuleList, nn.ModuleDict))
    ]
    if lists:  # Mixtral-era lists, switch_transformers' and nllb-moe's dicts (expert_0, ...) routed by one-hot masks
        path, module = lists[0]
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise NotImplementedError(
            f"ep_size={ep}: {type(model).__name__} ({family}) keeps its experts as per-expert "
            f"modules: {path} ({type(module).__name__}) is an nn."
            f"{'ModuleList' if isinstance(module, nn.ModuleList) else 'ModuleDict'} of "
            f"{getattr(module, 'num_experts', len(module))} expert modules ({len(lists)} such experts modules); expert "
            f"parallelism splits fused experts tensors only so far. Leave ep_size at 1 (tensor "
            f"parallelism shards each expert's layers)"
        )
    layouts = []
    for path, module in _candidates(model, plan).items():
        experts = getattr(module, "num_experts", None)
        if not takes_routing(module):
            raise NotImplementedError(
                f"ep_size={ep}: {path} ({type(module).__name__}) is not called as "
                f"experts(hidden_states, top_k_index, top_k_weights) after the model's router; "
                f"autotp cannot dispatch tokens to it"
            )
        if not isinstance(experts, int):
            raise NotImplementedError(
                f"ep_size={ep}: {path} ({type(module).__name__}) has no integer num_experts, so "
                f"autotp cannot tell which of the router's indices are experts it can move "
                f"(LongCat-Flash's router also picks zero-computation experts, which the module "
                f"runs as identities); autotp cannot split it by expert"
            )
        names = tuple(name for name, _ in module.named_parameters())
        wrong = [
            name
            for name, p in module.named_parameters()
            if (p.shape[0] % experts if p.dim() == 2 else p.shape[0] != experts)
        ]
        if wrong:
            raise NotImplementedError(
                f"ep_size={ep}: {path}.{wrong[0]} does not hold its {experts} experts as equal "
                f"blocks of dim 0; autotp cannot split it by expert"
            )
        if experts % ep:
            raise ValueError(
                f"ep_size={ep} does not divide the {experts} experts of {path}: each EP rank must hold "
                f"the same number of whole experts; pick an ep_size that divides {experts}"
            )
        layouts.append(ExpertLayout(path, names, experts))
    return layouts
