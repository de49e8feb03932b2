"""A plan from a policy's rules: each rule's attention heads, MLP width or expert tensors split over tp ranks.

Why apart from `planning.planner`: this is the arithmetic of one policy applied to one module tree (which modules
a rule claims, how their weights split, which head-count attributes change per rank), checked as it goes; the
planner chooses the policy, composes sub-models and has the result verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn

from .linears import features, is_linear, weight_dim
from .plan import (
    AttrPlan,
    HeadInputPlan,
    HeadsPlan,
    LayerPlan,
    NormPlan,
    ParamPlan,
    Plan,
    RegionPlan,
    Replicated,
    Why,
)
from .policy import Policy, Rule
from .sharding import HeadLayout, Partition, layout_partition, split_ranges

# Attributes HF attention code may read to reshape heads, and which count each holds.
_HEAD_ATTRS = {
    "num_heads": "q",
    "num_attention_heads": "q",
    "n_heads": "q",
    "n_head": "q",
    "num_key_value_heads": "kv",
    "num_kv_heads": "kv",
    "n_kv_heads": "kv",
}
_WIDTH_ATTRS = {"split_size": "q", "embed_dim": "q", "all_head_size": "q", "hidden_size": "q", "kv_dim": "kv"}


def plan_from_policy(model: nn.Module, tp_size: int, policy: Policy) -> Plan:
    config = model.config
    modules = dict(model.named_modules())
    acc = _Accumulator()
    claimed: set[str] = set()
    for rule in policy.rules:
        if any(getattr(config, key, None) != value for key, value in rule.when.items()):
            continue
        for path in [name for name in modules if fnmatchcase(name, rule.match) and name not in claimed]:
            planner = {"attention": _plan_attention, "mlp": _plan_mlp, "experts": _plan_experts}[rule.kind]
            if planner(path, modules[path], rule, config, tp_size, acc):
                claimed.add(path)
    if policy.rules and not claimed and policy.origin.checked_by_hand:
        raise ValueError(
            f"policy {policy.name!r} shards nothing in {type(model).__name__}: no rule matches its modules"
        )
    # every name of each module (one registered twice, as a block shares it, too): a rule reaches its submodules by
    # the path under the module it matched, which may be the name named_modules() dropped as a duplicate
    order = {name: i for i, name in enumerate(dict(model.named_modules(remove_duplicate=False)))}
    acc.layers.sort(key=lambda layer: order[layer.path])
    sharded = {layer.path for layer in acc.layers}
    replicated = tuple(
        (name, Why(Replicated.NOT_COVERED)) for name, m in modules.items() if is_linear(m) and name not in sharded
    )
    source = repr(policy.name) + (f" ({policy.description})" if policy.description else "")
    return Plan(
        tp_size,
        policy.origin,
        source,
        tuple(acc.layers),
        tuple(acc.regions),
        tuple(acc.attrs),
        tuple(acc.head_norms),
        tuple(acc.head_inputs),
        tuple(acc.attention),
        replicated,
        vocab_reason=policy.no_vocab_parallel,
        params=tuple(acc.params),
        norms=tuple(acc.norms),
    )


@dataclass
class _Accumulator:
    layers: list[LayerPlan] = field(default_factory=list)
    regions: list[RegionPlan] = field(default_factory=list)
    attrs: list[AttrPlan] = field(default_factory=list)
    head_norms: list[str] = field(default_factory=list)
    head_inputs: list[HeadInputPlan] = field(default_factory=list)
    attention: list[HeadsPlan] = field(default_factory=list)
    params: list[ParamPlan] = field(default_factory=list)
    norms: list[NormPlan] = field(default_factory=list)


def _children(block: nn.Module, names) -> dict[str, nn.Module] | None:
    """The named descendants of `block` (dotted paths allowed), or None if any is missing."""
    found = {}
    for name in names:
        try:
            found[name] = block.get_submodule(name)
        except AttributeError:
            return None
    return found


def _count(config, spec: str | int) -> int:
    if isinstance(spec, int):
        return spec
    value = getattr(config, spec, None)
    if not isinstance(value, int):
        raise ValueError(f"the config has no integer field {spec!r}")
    return value


def _parts(layout: str) -> int:
    """Rows per item of a layout: one per "|" part, and per token of an interleaved "(w w)" part."""
    blocks = [b.strip() for b in layout.split("|")]
    return sum(len(b.strip("()").split()) if b.startswith("(") else 1 for b in blocks)


def _plan_attention(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator) -> bool:
    children = _children(block, [*rule.column, *rule.row])
    if children is None:
        return False
    heads = _count(config, rule.heads)
    kv = heads if rule.kv_heads is None else _count(config, rule.kv_heads)
    row_name = next(iter(rule.row))
    row_in = features(children[row_name])[1]
    if row_in % heads:
        raise ValueError(f"{path}.{row_name}: {row_in} input features are not a whole number of {heads} heads")
    head_dim = row_in // heads
    try:
        layout = HeadLayout.plan(heads, kv, tp)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    owned = {"q": layout.q, "k": layout.kv, "v": layout.kv}
    units = {"q": head_dim, "k": head_dim, "v": head_dim}
    for style, mapping in (("column", rule.column), ("row", rule.row)):
        for name, spec in mapping.items():
            module = children[name]
            rows = features(module)[0 if style == "column" else 1]
            partition = layout_partition(spec, weight_dim(module, style), owned, units, group=heads // kv)
            if partition.full_size != rows:
                raise ValueError(
                    f"{path}.{name}: {rows} {'output' if style == 'column' else 'input'} features, but layout "
                    f"{spec!r} with {heads} query / {kv} key-value heads of {head_dim} gives {partition.full_size}"
                )
            acc.layers.append(
                LayerPlan(
                    f"{path}.{name}",
                    style,
                    tuple(module.weight.shape),
                    partition,
                    f"{spec} over {heads} heads / {kv} kv heads of {head_dim}",
                    path,
                )
            )
    local = {"q": tuple(len(r) for r in layout.q), "kv": tuple(len(r) for r in layout.kv)}
    full = {"q": heads, "kv": kv}
    linears = {id(m) for m in children.values()}
    for sub_path, sub in block.named_modules():
        if id(sub) in linears:
            continue
        prefix = f"{path}.{sub_path}" if sub_path else path
        for name, role in _HEAD_ATTRS.items():
            if getattr(sub, name, None) == full[role] and full[role] != 0:
                _attr(acc, prefix, name, full[role], local[role])
        for name, role in _WIDTH_ATTRS.items():
            if getattr(sub, name, None) == full[role] * head_dim:
                _attr(acc, prefix, name, full[role] * head_dim, tuple(n * head_dim for n in local[role]))
        if isinstance(getattr(sub, "num_key_value_groups", None), int):
            groups = tuple(q // k for q, k in zip(local["q"], local["kv"]))
            _attr(acc, prefix, "num_key_value_groups", sub.num_key_value_groups, groups)
    for name in rule.local_config:
        value = getattr(config, name)
        counted = "q" if value == heads else "kv" if value == kv else None
        if counted is None:
            raise ValueError(f"{path}: config.{name}={value} is neither the query nor the key/value head count")
        _attr(acc, path, f"config.{name}", value, local[counted])
    acc.head_norms.extend(f"{path}.{name}" for name in rule.head_norms if _children(block, [name]))
    local_heads = tuple((r.start, len(r)) for r in layout.q)
    acc.head_inputs.extend(HeadInputPlan(path, name, heads, local_heads) for name in rule.head_inputs)
    acc.attention.append(HeadsPlan(path, heads, local_heads))
    acc.params.extend(_head_params(path, block, rule, acc.attention[-1]))
    _sharded_norms(path, block, rule, layout_partition("w", 0, {"w": layout.q}, {"w": head_dim}), acc)
    return True


def _sharded_norms(path: str, block: nn.Module, rule: Rule, partition: Partition, acc: _Accumulator) -> None:
    """The rule's norms over the width the block splits (`partition`): their statistic all-reduced, their weight (if
    any) split as the width is."""
    for name, stat in rule.sharded_norms.items():
        found = _children(block, [name])
        if found is None:
            continue
        weights = dict(found[name].named_parameters())
        if set(weights) - {"weight"} or ("weight" in weights and weights["weight"].shape != (partition.full_size,)):
            shapes = {n: tuple(p.shape) for n, p in weights.items()}
            raise ValueError(f"{path}.{name}: a norm over {partition.full_size} columns holds {shapes}")
        acc.norms.append(NormPlan(f"{path}.{name}", stat, partition.full_size))
        if weights:
            acc.params.append(ParamPlan(f"{path}.{name}", "weight", (partition.full_size,), partition))


def _head_params(path: str, block: nn.Module, rule: Rule, heads: HeadsPlan) -> list[ParamPlan]:
    """The rule's per-head parameters of `block` (sinks), split along dim 0 as its query heads are."""
    out = []
    for name in rule.head_params:
        param = getattr(block, name, None)
        if param is None:
            continue
        if not isinstance(param, nn.Parameter) or param.dim() == 0 or param.shape[0] != heads.heads:
            shape = tuple(getattr(param, "shape", ()))
            raise ValueError(f"{path}.{name}: a per-head parameter needs {heads.heads} rows on dim 0, got {shape}")
        out.append(ParamPlan(path, name, tuple(param.shape), heads.partition(0)))
    return out


def _attr(acc: _Accumulator, path: str, name: str, full: int, local: tuple[int, ...]) -> None:
    if any(v != full for v in local):
        acc.attrs.append(AttrPlan(path, name, full, local))


def _plan_mlp(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator) -> bool:
    children = _children(block, [*rule.column, *rule.row])
    if children is None:
        return False
    widths = {}
    for style, mapping in (("column", rule.column), ("row", rule.row)):
        for name, spec in mapping.items():
            rows = features(children[name])[0 if style == "column" else 1]
            widths[name] = rows // _parts(spec) if rows % _parts(spec) == 0 else None
    width = next(iter(widths.values()))
    if width is None or any(w != width for w in widths.values()):
        raise ValueError(f"{path}: the MLP projections disagree on the width: {widths}")
    _check_width(path, "MLP width", width, tp)
    owned = {"w": split_ranges(width, tp)}
    _sharded_norms(path, block, rule, layout_partition("w", 0, owned, {"w": 1}), acc)
    for style, mapping in (("column", rule.column), ("row", rule.row)):
        for name, spec in mapping.items():
            module = children[name]
            partition = layout_partition(spec, weight_dim(module, style), owned, {"w": 1})
            parts = f" x {_parts(spec)} parts" if _parts(spec) > 1 else ""
            acc.layers.append(
                LayerPlan(
                    f"{path}.{name}", style, tuple(module.weight.shape), partition, f"MLP width {width}{parts}", path
                )
            )
    return True


def _check_width(path: str, what: str, width: int, tp: int) -> None:
    if width < tp:
        raise ValueError(
            f"{path}: {what} {width} is smaller than tp_size={tp}, so some rank would hold no column; "
            f"use a tp_size of at most {width}"
        )


def _plan_experts(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator) -> bool:
    found = {name: getattr(block, name, None) for name in [*rule.params, *rule.bias_once]}
    params = {name: p for name, p in found.items() if isinstance(p, nn.Parameter)}
    if len(params) != len(found):  # a rule's tensor is missing or not a parameter: not this block
        return False
    widths = {name: params[name].shape[dim] // _parts(spec) for name, (dim, spec) in rule.params.items()}
    width = next(iter(widths.values()))
    if any(w != width for w in widths.values()):
        raise ValueError(f"{path}: the expert tensors disagree on the expert width: {widths}")
    _check_width(path, "expert width", width, tp)
    owned = {"w": split_ranges(width, tp)}
    partitions = tuple(
        (name, tuple(params[name].shape), layout_partition(spec, dim, owned, {"w": 1}))
        for name, (dim, spec) in rule.params.items()
    )
    acc.regions.append(RegionPlan(path, partitions, f"each expert's width {width} split", rule.bias_once))
    return True
