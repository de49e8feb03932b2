"""Tied parameters outside the embedding: a block whose linears hold a parameter another module holds too (Zamba
ties the shared transformer block of each hybrid layer to the first one's, module by module) stays replicated.
Sharding replaces a module's parameters with shards of its own, so the tie would be cut and each module trained
apart, where one process trains one tensor. The tied LM head is the vocabulary plan's (`planner.with_vocab`).
"""

from __future__ import annotations

from torch import nn

from .plan import Plan
from .verify import without_blocks


def keep_ties(model: nn.Module, plan: Plan) -> Plan:
    """`plan` without the blocks holding a linear whose parameter is also another module's, each with the name."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    modules = dict(model.named_modules(remove_duplicate=False))
    reasons: dict[str, str] = {}
    for layer in plan.layers:
        for local, param in modules[layer.path].named_parameters(recurse=False):
            elsewhere = [n for n in names.get(id(param), []) if n != f"{layer.path}.{local}"]
            if elsewhere and layer.block not in reasons:
                reasons[layer.block] = (
                    f"{layer.path}.{local} is tied to {elsewhere[0]} (one tensor), which a shard of its own would untie"
                )
    return without_blocks(plan, reasons)
