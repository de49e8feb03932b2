"""Tied parameters outside the embedding. Sharding replaces a module's parameters with shards of its own, so a tie
would be cut and each module trained apart, where one process trains one tensor. The tied LM head is the vocabulary
plan's (`planner.with_vocab`).

A planned block tied whole to an earlier one (Zamba2 ties its shared transformer block of each hybrid layer to the
first one's, every parameter, and the blocks hold nothing else of their own) is a copy of it: `wrap` makes it that
very module (`Plan.shared`), registered under both paths, so the one block is planned, sharded and trained once and
every path reads it. Any other block holding a linear whose parameter is also another module's stays replicated.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from .plan import Plan
from .verify import under, without_blocks


def keep_ties(model: nn.Module, plan: Plan) -> Plan:
    """`plan` with each block tied whole to an earlier one shared (`Plan.shared`), and without the blocks holding a
    linear whose parameter is also another module's, each with the name."""
    modules = dict(model.named_modules(remove_duplicate=False))
    shared = _copies(modules, [layer.block for layer in plan.layers])
    plan = _shared(plan, shared)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    reasons: dict[str, str] = {}
    for layer in plan.layers:
        copies = [copy + layer.path[len(layer.block) :] for copy, source in shared.items() if source == layer.block]
        for local, param in modules[layer.path].named_parameters(recurse=False):
            own = {f"{path}.{local}" for path in [layer.path, *copies]}
            elsewhere = [n for n in names.get(id(param), []) if n not in own]
            if elsewhere and layer.block not in reasons:
                reasons[layer.block] = (
                    f"{layer.path}.{local} is tied to {elsewhere[0]} (one tensor), which a shard of its own would untie"
                )
    return without_blocks(plan, reasons)


def unshared(plan: Plan) -> Plan:
    """`plan` with its shared blocks replicated, sources and copies alike: under a pipeline the copies may lie on other
    stages, each stage training its own tensor (`autotp.pp.shared` sums their gradients), which the source's shards
    alone would not match."""
    if not plan.shared:
        return plan
    why = "it is tied to the same block in other layers, which a pipeline may place on other stages"
    return replace(without_blocks(plan, {source: why for _, source in plan.shared}), shared=())


def _copies(modules: dict[str, nn.Module], blocks: list[str]) -> dict[str, str]:
    """Each block (path) that is a copy of an earlier one -> that block's path: `_same` in every parameter."""
    found: dict[str, str] = {}
    first: list[str] = []
    for block in dict.fromkeys(blocks):
        source = next((b for b in first if _same(modules[b], modules[block])), None)
        if source is None:
            first.append(block)
        else:
            found[block] = source
    return found


def _same(one: nn.Module, other: nn.Module) -> bool:
    """Whether `other` computes what `one` does: another object of its class holding its very parameters, equal
    buffers and equal attributes in every submodule (a layer index of its own would tell it apart), and no hooks."""
    if one is other or type(one) is not type(other):
        return False
    ours, theirs = dict(one.named_modules()), dict(other.named_modules())
    if list(ours) != list(theirs) or not any(True for _ in one.parameters()):
        return False
    for name, mine in ours.items():
        copy = theirs[name]
        if type(mine) is not type(copy) or _hooked(copy) or not _equal_state(mine, copy):
            return False
        if any(p is not copy._parameters.get(k) for k, p in mine._parameters.items()):
            return False
        if set(mine._parameters) != set(copy._parameters) or set(mine._buffers) != set(copy._buffers):
            return False
        if not all(_equal(b, copy._buffers[k]) for k, b in mine._buffers.items()):
            return False
    return True


def _equal_state(one: nn.Module, other: nn.Module) -> bool:
    """Whether the modules' own attributes (besides parameters, buffers, submodules and hooks) are equal."""
    ours, theirs = ({k: v for k, v in vars(m).items() if not k.startswith("_")} for m in (one, other))
    try:
        return bool(ours == theirs)
    except Exception:  # an attribute that cannot be compared (a tensor): not known to be equal
        return False


def _hooked(module: nn.Module) -> bool:
    hooks = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return any(getattr(module, h, None) for h in hooks)


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    if a is b:
        return True
    return a.shape == b.shape and a.dtype == b.dtype and a.device.type != "meta" and bool(torch.equal(a, b))


def _shared(plan: Plan, shared: dict[str, str]) -> Plan:
    """`plan` with the copies' own entries dropped: each becomes its source block (`Plan.shared`)."""
    if not shared:
        return plan

    return replace(
        plan,
        layers=tuple(layer for layer in plan.layers if not under(layer.block, shared)),
        attrs=tuple(a for a in plan.attrs if not under(a.path, shared)),
        head_norms=tuple(h for h in plan.head_norms if not under(h, shared)),
        head_inputs=tuple(h for h in plan.head_inputs if not under(h.path, shared)),
        attention=tuple(a for a in plan.attention if not under(a.path, shared)),
        norms=tuple(n for n in plan.norms if not under(n.path, shared)),
        params=tuple(p for p in plan.params if not under(p.block, shared)),
        whole=tuple(w for w in plan.whole if not under(w, shared)),
        gathered_outputs=tuple(g for g in plan.gathered_outputs if not under(g, shared)),
        replicated=tuple((p, why) for p, why in plan.replicated if not under(p, shared)),
        shared=plan.shared + tuple(shared.items()),
    )
