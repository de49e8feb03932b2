"""A plan from a policy's rules: each rule's attention heads, MLP width or expert tensors split over tp ranks.

Why apart from `planning.planner`: this is the arithmetic of one policy applied to one module tree (which modules
a rule claims, how their weights split, which head-count attributes change per rank), checked as it goes; the
planner chooses the policy, composes sub-models and has the result verified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn

from .adapters import add_adapters
from .expert_linears import add_layer, plan_expert_linears
from .head_params import head_params, sharded_norms
from .linears import features, is_linear, weight_dim
from .plan import (
    AttrPlan,
    HeadInputPlan,
    HeadsPlan,
    LayerPlan,
    MixerState,
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
    refused: dict[str, str] = {}  # a recognised mixer whose rule does not fit it: why
    for rule in policy.rules:
        if any(getattr(config, key, None) != value for key, value in rule.when.items()):
            continue
        for path in [name for name in modules if fnmatchcase(name, rule.match) and name not in claimed]:
            if rule.kind == "mixer" and (rule.refuse or not policy.origin.checked_by_hand):
                if _try_mixer(path, modules[path], rule, config, tp_size, acc, refused):
                    claimed.add(path)
                continue
            planner = {"attention": _plan_attention, "mlp": _plan_mlp, "experts": _plan_experts, "mixer": _plan_mixer}[
                rule.kind
            ]
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
        (name, _why_replicated(name, refused)) for name, m in modules.items() if is_linear(m) and name not in sharded
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
        states=tuple(acc.states),
        gathered_outputs=tuple(acc.gathered_outputs),
        whole=tuple(acc.whole),
        norms=tuple(acc.norms),
    )


def _try_mixer(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator, refused: dict) -> bool:
    """A derived plan's mixer rule (`policies/mixers.toml`): a block whose shapes do not fit it stays replicated with
    the reason (a rule names children; another model may hold the same names in other shapes)."""
    if rule.refuse:  # a mixer known not to split exactly: its linears stay replicated, with the rule's reason
        if _children(block, [*rule.column, *rule.row]) is not None:
            refused[path] = rule.refuse
        return False
    trial = _Accumulator()
    try:
        if not _plan_mixer(path, block, rule, config, tp, trial):
            return False
    except ValueError as err:
        refused[path] = str(err)
        return False
    for name, items in vars(trial).items():
        getattr(acc, name).extend(items)
    return True


def _why_replicated(name: str, refused: dict[str, str]) -> Why:
    owner = next((path for path in refused if name.startswith(path + ".")), None)
    return Why(Replicated.NOT_COVERED) if owner is None else Why(Replicated.NOT_VERIFIED, refused[owner])


@dataclass
class _Accumulator:
    layers: list[LayerPlan] = field(default_factory=list)
    regions: list[RegionPlan] = field(default_factory=list)
    attrs: list[AttrPlan] = field(default_factory=list)
    head_norms: list[str] = field(default_factory=list)
    head_inputs: list[HeadInputPlan] = field(default_factory=list)
    attention: list[HeadsPlan] = field(default_factory=list)
    params: list[ParamPlan] = field(default_factory=list)
    states: list[MixerState] = field(default_factory=list)
    gathered_outputs: list[str] = field(default_factory=list)
    whole: list[str] = field(default_factory=list)
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
            what = f"{spec} over {heads} heads / {kv} kv heads of {head_dim}"
            shape = tuple(module.weight.shape)
            add_layer(acc, module, LayerPlan(f"{path}.{name}", style, shape, partition, what, path))
    add_adapters(path, block, rule.adapters, acc.layers, acc.whole)
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
    acc.attention.append(HeadsPlan(path, heads, local_heads, _count(config, rule.head_repeats)))
    acc.params.extend(head_params(path, block, rule, acc.attention[-1]))
    _norms(path, block, rule, layout_partition("w", 0, {"w": layout.q}, {"w": head_dim}), acc)
    return True


def _norms(path: str, block: nn.Module, rule: Rule, partition: Partition, acc: _Accumulator) -> None:
    norms, weights = sharded_norms(path, block, rule, partition)
    acc.norms.extend(norms)
    acc.params.extend(weights)


def _attr(acc: _Accumulator, path: str, name: str, full: int, local: tuple[int, ...]) -> None:
    if any(v != full for v in local):
        acc.attrs.append(AttrPlan(path, name, full, local))


def _plan_mlp(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator) -> bool:
    children = _children(block, [*rule.column, *rule.row])
    if children is None or not _plan_gathered(path, block, rule, tp, acc):
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
    _norms(path, block, rule, layout_partition("w", 0, owned, {"w": 1}), acc)
    acc.params.extend(head_params(path, block, rule, layout_partition("w", 0, owned, {"w": 1})))
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
    add_adapters(path, block, rule.adapters, acc.layers, acc.whole)
    return True


def _check_width(path: str, what: str, width: int, tp: int) -> None:
    if width < tp:
        raise ValueError(
            f"{path}: {what} {width} is smaller than tp_size={tp}, so some rank would hold no column; "
            f"use a tp_size of at most {width}"
        )


def _plan_experts(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator) -> bool:
    if rule.column or rule.row:  # parallel-experts linears (JetMoE's), each a column or row layer inside every expert
        return plan_expert_linears(path, block, rule, tp, acc)
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


def _plan_mixer(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator) -> bool:
    """A token mixer (short convolution, RG-LRU, gated delta-net, linear attention) split by whole heads (or
    channels): its column projections, the parameters inside it along their channel dim, its row projection, the
    attributes counting its heads or widths; no head is cut."""
    children = _children(block, [*rule.column, *rule.row])
    params = _params(block, rule.params)
    if children is None or params is None or not _plan_gathered(path, block, rule, tp, acc):
        return False
    heads = _count(config, rule.heads)
    _check_width(path, "mixer head count", heads, tp)
    owned = split_ranges(heads, tp)
    reason = f"mixer of {heads} heads"
    for style, mapping in (("column", rule.column), ("row", rule.row)):
        for name, spec in mapping.items():
            module, dim = children[name], weight_dim(children[name], style)
            partition = _mixer_partition(block, f"{path}.{name}", spec, dim, module.weight.shape[dim], owned)
            acc.layers.append(LayerPlan(f"{path}.{name}", style, tuple(module.weight.shape), partition, reason, path))
    for name, param in params.items():
        dim, spec = rule.params[name]
        if dim >= param.dim():
            raise ValueError(f"{path}.{name}: a tensor of shape {tuple(param.shape)} has no dim {dim}")
        partition = _mixer_partition(block, f"{path}.{name}", spec, dim, param.shape[dim], owned)
        acc.params.append(ParamPlan(f"{path}.{name}", tuple(param.shape), partition, path))
    local_heads = tuple(len(r) for r in owned)
    for name in rule.local_attrs:
        owner, _, attr = name.rpartition(".")
        value = getattr(block.get_submodule(owner), attr, None)
        if not isinstance(value, int) or value % heads:
            raise ValueError(f"{path}.{name}={value} is not a whole multiple of the mixer's {heads} heads")
        _attr(acc, f"{path}.{owner}" if owner else path, attr, value, tuple(n * value // heads for n in local_heads))
    acc.head_norms.extend(f"{path}.{name}" for name in rule.head_norms if _children(block, [name]))
    acc.whole.extend(f"{path}.{name}" for name in rule.whole)
    if rule.state:
        state = rule.state
        if not isinstance(getattr(block, state["layer"], None), int):
            raise ValueError(f"{path}: its state's layer attribute {state['layer']!r} is not an integer")
        partition = _mixer_partition(block, f"{path} state", "w", state["dim"], heads, owned)
        acc.states.append(MixerState(path, state["arg"], state["items"], state["layer"], partition))
    return True


def _mixer_partition(block: nn.Module, where: str, layout: str, dim: int, rows: int, owned: list[range]) -> Partition:
    """The rows of a mixer's tensor each rank holds: its parts ("|": "w" for equal parts, else the block attribute
    holding the part's rows), each a run of whole heads, every head the same rows."""
    parts = [part.strip() for part in layout.split("|")]
    named = [getattr(block, part, None) for part in parts]
    sizes: list = [rows // len(parts)] * len(parts) if all(part == "w" for part in parts) else named
    heads = owned[-1].stop
    if sum(s if isinstance(s, int) else 0 for s in sizes) != rows or any(
        not isinstance(s, int) or s % heads for s in sizes
    ):
        raise ValueError(f"{where}: {rows} rows along dim {dim} are not layout {layout!r} ({sizes}) of {heads} heads")
    runs: list[list[tuple[int, int]]] = [[] for _ in owned]
    offset = 0
    for size in sizes:
        unit = size // heads
        for rank, mine in enumerate(owned):
            runs[rank].append((offset + mine.start * unit, len(mine) * unit))
        offset += size
    return Partition(dim, rows, tuple(tuple(r) for r in runs))


def _params(block: nn.Module, names) -> dict[str, nn.Parameter] | None:
    """The parameters at the dotted `names` under `block` (one that is None, such as an absent bias, left out), or
    None if any is missing or not a parameter: not this block."""
    found = {}
    for name in names:
        owner, _, attr = name.rpartition(".")
        try:
            module = block.get_submodule(owner)
        except AttributeError:
            return None
        if not hasattr(module, attr):
            return None
        param = getattr(module, attr)
        if param is not None and not isinstance(param, nn.Parameter):
            return None
        if param is not None:
            found[name] = param
    return found


def _plan_gathered(path: str, block: nn.Module, rule: Rule, tp: int, acc: _Accumulator) -> bool:
    """The rule's gathered linears (a gate multiplying the row layer's sum, as RWKV's channel mixing's receptance):
    each split evenly by output, its output gathered whole; False if one is missing (not this block)."""
    children = _children(block, rule.gathered_outputs)
    if children is None:
        return False
    for name, module in children.items():
        rows = features(module)[0]
        _check_width(f"{path}.{name}", "output width", rows, tp)
        partition = Partition.even(weight_dim(module, "column"), rows, tp)
        layer = LayerPlan(f"{path}.{name}", "column", tuple(module.weight.shape), partition, "output gathered", path)
        acc.layers.append(layer)
        acc.gathered_outputs.append(layer.path)
    return True
