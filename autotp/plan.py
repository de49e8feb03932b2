"""The plan: which module gets which style, as data.

`build_plan` reads a model (meta device is fine) and a policy and returns a `Plan` that says, for
one tp size, every linear's style and partition, the attention attributes to adjust and the
parameters whose gradients need a TP sum. It touches no process group, so it can be printed and
tested anywhere; every inconsistency is reported here, before the model is changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from .policy import AttentionRule, MLPRule, Policy, as_policy, builtin_policies, find_policy
from .sharding import Partition, split_sizes

# Attention attributes HF code may read to reshape heads, and which count each one holds.
_HEAD_ATTRS = {
    "num_heads": "heads", "num_attention_heads": "heads", "n_heads": "heads", "n_head": "heads",
    "num_key_value_heads": "kv_heads", "num_kv_heads": "kv_heads", "n_kv_heads": "kv_heads",
}


@dataclass(frozen=True)
class LayerPlan:
    """One linear to replace: its style, full (out, in) shape and weight partition."""

    path: str
    style: str  # "column" or "row"
    shape: tuple[int, int]
    partition: Partition
    reason: str


@dataclass(frozen=True)
class AttrPlan:
    """An integer attribute of an attention module that holds a head count: full and per-rank values."""

    path: str
    name: str
    full: int
    local: tuple[int, ...]


@dataclass(frozen=True)
class Plan:
    tp_size: int
    source: str
    layers: tuple[LayerPlan, ...]
    attrs: tuple[AttrPlan, ...]
    head_norms: tuple[str, ...]
    replicated: tuple[tuple[str, str], ...]

    def describe(self) -> str:
        """A table of every decision, for people."""
        lines = [f"autotp plan: tp_size={self.tp_size}, from {self.source}"]
        for layer in self.layers:
            p = layer.partition
            local = [(p.local_size(r), layer.shape[1]) if p.dim == 0 else (layer.shape[0], p.local_size(r))
                     for r in range(self.tp_size)]
            shapes = f"{local[0]} each" if len(set(local)) == 1 else " / ".join(map(str, local))
            lines.append(f"  {layer.style:<10} {layer.path}  {layer.shape} -> {shapes}  ({layer.reason})")
        for path in self.head_norms:
            lines.append(f"  {'head-norm':<10} {path}  replicated, gradient summed over TP (acts on sharded heads)")
        for attr in self.attrs:
            lines.append(f"  {'attribute':<10} {attr.path}.{attr.name}  {attr.full} -> {list(attr.local)}")
        for path, why in self.replicated:
            lines.append(f"  {'replicated':<10} {path}  ({why})")
        return "\n".join(lines)


def build_plan(model: nn.Module, tp_size: int, policy: Policy | str | Path | Mapping[str, Any] | None = None) -> Plan:
    """The plan for `model` at `tp_size`, from the given policy or the shipped one for its model type."""
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    if policy is None:
        found = find_policy(model_type)
        if found is None:
            known = sorted(t for p in builtin_policies() for t in p.model_types)
            raise ValueError(
                f"autotp has no sharding policy for model_type {model_type!r} ({type(model).__name__}); "
                f"shipped policies cover {known}. Pass policy=<file or dict> to wrap()."
            )
        policy = found
    else:
        policy = as_policy(policy)
    modules = dict(model.named_modules())
    layers: list[LayerPlan] = []
    attrs: list[AttrPlan] = []
    head_norms: list[str] = []
    for rule in policy.attention:
        for path in _matching(modules, rule.match, policy):
            _plan_attention(path, modules[path], rule, config, tp_size, layers, attrs, head_norms)
    for rule in policy.mlp:
        for path in _matching(modules, rule.match, policy):
            _plan_mlp(path, modules[path], rule, tp_size, layers)
    order = {name: i for i, name in enumerate(modules)}
    layers.sort(key=lambda layer: order[layer.path])
    sharded = {layer.path for layer in layers}
    replicated = tuple(
        (name, "not covered by the policy; replicated, which is always correct")
        for name, m in modules.items() if isinstance(m, nn.Linear) and name not in sharded
    )
    return Plan(tp_size, f"policy {policy.name!r}", tuple(layers), tuple(attrs), tuple(head_norms), replicated)


def _matching(modules: Mapping[str, nn.Module], pattern: str, policy: Policy) -> list[str]:
    paths = [name for name in modules if fnmatchcase(name, pattern)]
    if not paths:
        raise ValueError(f"policy {policy.name!r}: no module matches {pattern!r}; the model's structure differs")
    return paths


def _linear(block_path: str, block: nn.Module, name: str) -> nn.Linear:
    child = getattr(block, name, None)
    if not isinstance(child, nn.Linear):
        raise ValueError(f"{block_path}.{name}: expected an nn.Linear, found {type(child).__name__}")
    return child


def _plan_attention(path, block, rule: AttentionRule, config, tp_size, layers, attrs, head_norms) -> None:
    counts = {"heads": getattr(config, rule.heads, None), "kv_heads": getattr(config, rule.kv_heads, None)}
    if counts["kv_heads"] is None:
        counts["kv_heads"] = counts["heads"]
    if counts["heads"] is None:
        raise ValueError(f"{path}: the config has no field {rule.heads!r} giving the number of heads")
    heads, kv = counts["heads"], counts["kv_heads"]
    if heads % tp_size or kv % tp_size:
        raise ValueError(
            f"{path}: {heads} query heads and {kv} key/value heads cannot be split evenly over tp_size={tp_size}; "
            f"choose a tp_size that divides both"
        )
    first = _linear(path, block, next(iter(rule.column)))
    head_dim = getattr(block, "head_dim", None) or first.out_features // counts[rule.column[next(iter(rule.column))]]
    for style, dim, children in (("column", 0, rule.column), ("row", 1, rule.row)):
        for name, count_key in children.items():
            linear = _linear(path, block, name)
            rows = (linear.out_features, linear.in_features)[dim]
            expected = counts[count_key] * head_dim
            if rows != expected:
                raise ValueError(
                    f"{path}.{name}: {rows} {'output' if dim == 0 else 'input'} features, expected "
                    f"{counts[count_key]} heads x {head_dim} = {expected}"
                )
            partition = Partition(dim, (split_sizes(rows, tp_size, unit=head_dim),))
            layers.append(LayerPlan(f"{path}.{name}", style, (linear.out_features, linear.in_features), partition,
                                    f"{counts[count_key]} {count_key.replace('_', ' ')} of {head_dim}"))
    local = {k: split_sizes(v, tp_size) for k, v in counts.items()}
    wanted = [(name, counts[key], local[key]) for name, key in _HEAD_ATTRS.items()
              if getattr(block, name, None) == counts[key]]
    if hasattr(block, "num_key_value_groups"):
        wanted.append(("num_key_value_groups", block.num_key_value_groups,
                       tuple(h // k for h, k in zip(local["heads"], local["kv_heads"]))))
    attrs.extend(AttrPlan(path, name, full, per_rank) for name, full, per_rank in wanted
                 if any(v != full for v in per_rank))
    head_norms.extend(f"{path}.{name}" for name in rule.head_norms if hasattr(block, name))


def _plan_mlp(path, block, rule: MLPRule, tp_size, layers) -> None:
    columns = [_linear(path, block, name) for name in rule.column]
    width = columns[0].out_features
    for name, linear in zip(rule.column, columns):
        if linear.out_features != width:
            raise ValueError(f"{path}.{name}: {linear.out_features} output features, {rule.column[0]} has {width}")
    for name in rule.row:
        if _linear(path, block, name).in_features != width:
            raise ValueError(f"{path}.{name}: {_linear(path, block, name).in_features} input features, expected {width}")
    sizes = split_sizes(width, tp_size)
    for style, dim, names in (("column", 0, rule.column), ("row", 1, rule.row)):
        for name in names:
            linear = getattr(block, name)
            layers.append(LayerPlan(f"{path}.{name}", style, (linear.out_features, linear.in_features),
                                    Partition(dim, (sizes,)), f"MLP width {width}"))
