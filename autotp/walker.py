"""Applying a plan: swap linears for their parallel versions and fix what HF code reads.

The plan has already checked everything, so this step cannot fail halfway on bad input.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .comm import Group, grad_allreduce_hook, group_rank
from .layers import LinearAllreduce, LinearLayer, SharedInput, _ParallelLinear
from .plan import Plan


@dataclass
class TPState:
    """What `wrap` attached to a model (as `model.autotp_state`): plan, groups, rank, gathered or not."""

    plan: Plan
    tp_group: Group
    dp_group: Group
    tp_rank: int
    gathered: bool = False


def apply_plan(model: nn.Module, plan: Plan, tp_group: Group, dp_group: Group) -> TPState:
    """Rewrite `model` in place to follow `plan` on this rank."""
    rank = group_rank(tp_group)
    modules = dict(model.named_modules())
    shared: dict[str, SharedInput] = {}
    for layer in plan.layers:
        parent_path, _, name = layer.path.rpartition(".")
        parent = modules[parent_path]
        old = getattr(parent, name)
        if layer.style == "column":
            if parent_path not in shared:
                shared[parent_path] = SharedInput(tp_group)
                parent.register_forward_hook(shared[parent_path].clear)
            new = LinearLayer(old, layer.partition, tp_group, shared[parent_path])
        else:
            new = LinearAllreduce(old, layer.partition, tp_group)
        setattr(parent, name, new)
    for attr in plan.attrs:
        setattr(modules[attr.path], attr.name, attr.local[rank])
    state = TPState(plan, tp_group, dp_group, rank)
    for path in plan.head_norms:
        for param in modules[path].parameters():
            param.register_hook(grad_allreduce_hook(tp_group, lambda: not state.gathered))
    model.autotp_state = state
    return state


def parallel_layers(model: nn.Module) -> list[_ParallelLinear]:
    """Every replaced linear in `model`."""
    return [m for m in model.modules() if isinstance(m, _ParallelLinear)]


def set_gathered(model: nn.Module, state: TPState, gathered: bool) -> None:
    """Switch every replaced layer and adjusted attribute between full weights and shards."""
    modules = dict(model.named_modules())
    for layer in parallel_layers(model):
        layer.gather_() if gathered else layer.partition_()
    for attr in state.plan.attrs:
        setattr(modules[attr.path], attr.name, attr.full if gathered else attr.local[state.tp_rank])
    state.gathered = gathered
