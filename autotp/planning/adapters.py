"""Low-rank adapters built into a block (Zamba2's shared transformer: per-layer `down -> up` pairs added to q, k, v
and gate|up) split with the projection they add into.

An adapter `up(down(x))` reads the block's replicated input, as the projection it adds to does. `up` is split by
output exactly as that projection (same rows, same layout), so each rank adds its own rows to its own rows; `down`
(hidden -> rank) stays whole, computed on the replicated input: `up`, a column layer, all-reduces its input's
gradient, so `down`'s gradient is whole on every rank (`Plan.whole`, allowed by verification as a mixer's).
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from .linears import features, is_linear, weight_dim
from .plan import LayerPlan


def add_adapters(
    path: str, block: nn.Module, adapters: Mapping[str, str], layers: list[LayerPlan], whole: list[str]
) -> None:
    """Append to `layers` the adapters' `up` layers, split as their targets (already in `layers`), and to `whole` the
    `down` modules, for a rule's `adapters` (list name -> column projection) under the block at `path`. A list the
    block lacks is skipped (an option off); an item that is not a `down -> up` pair of linears writing the target's
    rows is a ValueError."""
    targets = {layer.path: layer for layer in layers}
    for name, target in adapters.items():
        items = getattr(block, name, None)
        if items is None:
            continue
        column = targets[f"{path}.{target}"]
        for index, item in enumerate(items):
            if isinstance(item, nn.Identity):  # an adapter slot another shared block owns
                continue
            where = f"{path}.{name}.{index}"
            pair = list(item.children()) if isinstance(item, nn.Sequential) else []
            if len(pair) != 2 or not all(is_linear(m) for m in pair):
                raise ValueError(f"{where}: an adapter of {target} is not a pair of linears (down, up)")
            up = pair[1]
            if features(up)[0] != column.shape[column.partition.dim] or weight_dim(up, "column") != 0:
                raise ValueError(f"{where}.1 writes {features(up)[0]} features, not {target}'s rows")
            reason = f"adapter added to {target}, split as it"
            layers.append(LayerPlan(f"{where}.1", "column", tuple(up.weight.shape), column.partition, reason, path))
            whole.append(f"{where}.0")
