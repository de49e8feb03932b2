"""Parallel-experts linears (JetMoE's `JetMoeParallelExperts`: a weight [experts, out, in], `forward(inputs,
expert_size)`) planned as the column and row layers of a block, split inside every expert.

Why a module of its own: they are not `nn.Linear`s a `LayerPlan` replaces, so each becomes a `RegionPlan` of one
tensor sharded in place with a `side`: a column one's input enters the TP span (its gradient summed), a row one's
output is summed over TP right there. Everything after the sum (routing weights, scatter back to tokens, the block's
bias) then runs on whole values on every rank, so a router or bias beside them stays replicated and exact.
"""

from __future__ import annotations

from typing import Protocol

from torch import nn

from .linears import features, is_expert_linear, weight_dim
from .plan import LayerPlan, RegionPlan
from .policy import Rule
from .sharding import layout_partition, split_ranges

SIDES = {
    "column": "its input enters TP, its output stays this rank's",
    "row": "its output summed over TP at once",
}


class _Planned(Protocol):
    layers: list[LayerPlan]
    regions: list[RegionPlan]


def add_layer(acc: _Planned, module: nn.Module, layer: LayerPlan) -> None:
    """A planned linear: replaced as a layer, or a parallel-experts linear sharded in place as a one-tensor region."""
    if not is_expert_linear(module):
        acc.layers.append(layer)
        return
    reason = f"{layer.reason}, inside each expert; {SIDES[layer.style]}"
    acc.regions.append(RegionPlan(layer.path, (("weight", layer.shape, layer.partition),), reason, side=layer.style))


def plan_expert_linears(path: str, block: nn.Module, rule: Rule, tp: int, acc: _Planned) -> bool:
    """An experts rule naming parallel-experts linears as `column` (layout over the expert width: "w | w" for JetMoE's
    gate | up) and `row`: each split by its experts' width, the same columns on every side. False when a name is
    missing or not a parallel-experts linear (not this block)."""
    named = {**rule.column, **rule.row}
    children = {}
    for name in named:
        try:
            children[name] = block.get_submodule(name)
        except AttributeError:
            return False
        if not is_expert_linear(children[name]):
            return False
    widths = {}
    for style, mapping in (("column", rule.column), ("row", rule.row)):
        for name, spec in mapping.items():
            size, parts = features(children[name])[0 if style == "column" else 1], _parts(spec)
            widths[name] = size // parts if size % parts == 0 else None
    width = next(iter(widths.values()))
    if width is None or any(w != width for w in widths.values()):
        raise ValueError(f"{path}: the parallel-experts linears disagree on the expert width: {widths}")
    if width < tp:
        raise ValueError(
            f"{path}: expert width {width} is smaller than tp_size={tp}, so some rank would hold no column; "
            f"use a tp_size of at most {width}"
        )
    owned = {"w": split_ranges(width, tp)}
    for style, mapping in (("column", rule.column), ("row", rule.row)):
        for name, spec in mapping.items():
            module = children[name]
            partition = layout_partition(spec, weight_dim(module, style), owned, {"w": 1})
            layer = LayerPlan(f"{path}.{name}", style, tuple(module.weight.shape), partition, f"expert width {width}")
            add_layer(acc, module, layer)
    return True


def _parts(layout: str) -> int:
    """Rows per width item: one per "|" part, and per token of an interleaved "(w w)" part."""
    blocks = [b.strip() for b in layout.split("|")]
    return sum(len(b.strip("()").split()) if b.startswith("(") else 1 for b in blocks)
