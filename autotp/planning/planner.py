"""Building a plan: from a policy (shipped or the user's), else from HF's plan or detection, then verified.

`build_plan` reads a model (meta device is fine) and returns a `Plan`. Every inconsistency is
reported here, before the model is changed. Where the policy comes from, in order: the user's, a
shipped one, the model config's `base_model_tp_plan` (translated), structural detection (see
`autotp.planning.derive`); derived plans keep only the blocks `autotp.planning.verify` proves exact.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn
from transformers import PretrainedConfig

from ..compat.hf import is_causal_lm
from .components import as_planned, components, joined, rebased
from .derive import derive_policy
from .linears import features, is_linear, weight_dim
from .plan import AttrPlan, HeadInputPlan, HeadsPlan, LayerPlan, Plan, RegionPlan, Replicated, VocabPlan, Why
from .policy import Policy, Rule, as_policy, find_policy
from .sharding import HeadLayout, Partition, layout_partition, split_ranges
from .twin import structural_twin
from .verify import apply_verdicts, verdicts, verify_by_emulation

PolicyArg = Policy | str | Path | Mapping[str, Any] | None

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


def build_plan(
    model: nn.Module,
    tp_size: int,
    policy: PolicyArg = None,
    vocab_parallel: bool = True,
    example_inputs: Mapping[str, Any] | None = None,
) -> Plan:
    """The plan for `model` at `tp_size`: from `policy`, else a shipped policy, HF's plan or detection.

    `vocab_parallel` shards the embedding and LM head by vocabulary where the model allows it
    (policy-covered causal LMs whose loss goes through `self.loss_function`). `example_inputs` are forward
    keyword arguments verification runs the model on, for a model that takes no token ids.
    """
    if not isinstance(getattr(model, "config", None), PretrainedConfig):
        raise TypeError(
            f"autotp shards Hugging Face models (a transformers PreTrainedModel with a .config); got "
            f"{type(model).__name__}. Wrap the PreTrainedModel itself, not a module around it"
        )
    plan = _build_plan(model, tp_size, policy, example_inputs)
    if not vocab_parallel:
        return replace(plan, vocab_reason="vocab_parallel=False")
    return with_vocab(model, plan)


def _build_plan(model: nn.Module, tp_size: int, policy, example: Mapping[str, Any] | None) -> Plan:
    parts = components(model) if policy is None else []
    if parts:
        return _composite_plan(model, tp_size, parts, example)
    model_type = getattr(model.config, "model_type", type(model).__name__)
    chosen = as_policy(policy) if policy is not None else find_policy(model_type)
    derived = chosen is None
    policy = derive_policy(model) if derived else chosen
    return _verified(
        model,
        plan_from_policy(model, tp_size, policy),
        not derived,
        lambda: structural_twin(model),
        lambda twin: plan_from_policy(twin, tp_size, policy),
        example,
    )


def _verified(
    model: nn.Module,
    plan: Plan,
    only_custom: bool,
    make_twin: Callable[[], nn.Module | None],
    twin_plan: Callable[[nn.Module], Plan],
    example: Mapping[str, Any] | None,
) -> Plan:
    """`plan` with the blocks verification could not prove exact moved to replicated (`only_custom`: a shipped
    policy, whose transformers classes need no check).

    A loaded model is verified itself. A meta-device model is verified on its structural twin (from
    `make_twin`, planned by `twin_plan` as the model was); blocks the twin lacks stay replicated.
    """
    if not any(p.device.type == "meta" for p in model.parameters()):
        return verify_by_emulation(model, plan, only_custom, example)
    if not any(layer.block for layer in plan.layers):
        return plan
    with torch.device("cpu"):  # the caller may have made meta the default device
        twin = make_twin()
        if twin is None:
            return apply_verdicts(
                model,
                plan,
                {},
                only_custom,
                "the model is on the meta device and no structural twin of it could be built to run",
            )
        try:
            planned = twin_plan(twin)
        except ValueError as err:
            return apply_verdicts(model, plan, {}, only_custom, f"its structural twin plans differently ({err})")
        return apply_verdicts(
            model,
            plan,
            verdicts(twin, planned, only_custom, example),
            only_custom,
            "its block is not in the structural twin built from the config",
        )


def _composite_plan(model: nn.Module, tp_size: int, parts, example: Mapping[str, Any] | None) -> Plan:
    """A vision-language (or other composite) model: each sub-model planned from its own config and policy,
    then verified inside the whole model (or its structural twin, built once, on the meta device), whose
    forward on `autotp.planning.probe` inputs reaches every block."""
    twin = functools.cache(lambda: structural_twin(model))
    planned = []
    for path, component in parts:
        chosen = find_policy(component.config.model_type)
        policy = chosen or derive_policy(as_planned(component)[0])
        plan = _component_plan(component, path, tp_size, policy)
        planned.append(
            (
                path,
                _verified(
                    model,
                    plan,
                    chosen is not None,
                    twin,
                    lambda t, path=path, policy=policy: _component_plan(_component_at(t, path), path, tp_size, policy),
                    example,
                ),
            )
        )
    return joined(model, planned, tp_size)


def _component_at(model: nn.Module, path: str) -> nn.Module:
    """The sub-model at `path` of a composite (the twin's counterpart of a component), or ValueError."""
    found = dict(components(model)).get(path)
    if found is None:
        raise ValueError(f"it has no sub-model {path}")
    return found


def _component_plan(component: nn.Module, path: str, tp_size: int, policy: Policy) -> Plan:
    planned, prefix = as_planned(component)
    try:
        return rebased(plan_from_policy(planned, tp_size, policy), prefix, path)
    except ValueError as err:
        raise ValueError(f"{path} ({type(component).__name__}): {err}") from None


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
    order = {name: i for i, name in enumerate(modules)}
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
    )


@dataclass
class _Accumulator:
    layers: list[LayerPlan] = field(default_factory=list)
    regions: list[RegionPlan] = field(default_factory=list)
    attrs: list[AttrPlan] = field(default_factory=list)
    head_norms: list[str] = field(default_factory=list)
    head_inputs: list[HeadInputPlan] = field(default_factory=list)
    attention: list[HeadsPlan] = field(default_factory=list)


def _children(block: nn.Module, names) -> dict[str, nn.Module] | None:
    """The named descendants of `block` (dotted paths allowed), or None if any is missing."""
    found = {}
    for name in names:
        try:
            found[name] = block.get_submodule(name)
        except AttributeError:
            return None
    return found


def _count(config, spec: str | int | None, default: int | None = None) -> int:
    if spec is None:
        return default
    if isinstance(spec, int):
        return spec
    value = getattr(config, spec, None)
    if not isinstance(value, int):
        raise ValueError(f"the config has no integer field {spec!r}")
    return value


def _parts(layout: str) -> int:
    return layout.count("|") + 1


def _plan_attention(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator) -> bool:
    children = _children(block, [*rule.column, *rule.row])
    if children is None:
        return False
    heads = _count(config, rule.heads)
    kv = _count(config, rule.kv_heads, heads)
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
        role = "q" if value == heads else "kv" if value == kv else None
        if role is None:
            raise ValueError(f"{path}: config.{name}={value} is neither the query nor the key/value head count")
        _attr(acc, path, f"config.{name}", value, local[role])
    acc.head_norms.extend(f"{path}.{name}" for name in rule.head_norms if _children(block, [name]))
    local_heads = tuple((r.start, len(r)) for r in layout.q)
    acc.head_inputs.extend(HeadInputPlan(path, name, heads, local_heads) for name in rule.head_inputs)
    acc.attention.append(HeadsPlan(path, heads, local_heads))
    return True


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
    params = {name: getattr(block, name, None) for name in rule.params}
    if any(not isinstance(p, nn.Parameter) for p in params.values()):
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
    acc.regions.append(RegionPlan(path, partitions, f"each expert's width {width} split"))
    return True


def with_vocab(model: nn.Module, plan: Plan) -> Plan:
    """Add vocab parallelism when it is known to be safe, else say why not."""
    why = _vocab_refusal(model, plan)
    if why:
        return replace(plan, vocab_reason=why)
    modules = {id(m): name for name, m in model.named_modules()}
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    tied = embedding is not None and embedding.weight is head.weight
    rows = head.out_features
    partition = Partition.even(0, rows, plan.tp_size)
    embedding_ok = isinstance(embedding, nn.Embedding) and embedding.weight.shape[0] == rows
    if tied and not embedding_ok:
        return replace(plan, vocab_reason=f"the LM head is tied to a {type(embedding).__name__} autotp cannot split")
    head_path = modules[id(head)]
    layer = LayerPlan(head_path, "column", tuple(head.weight.shape), partition, f"vocab {rows}", head_path)
    vocab = VocabPlan(head_path, modules[id(embedding)] if embedding_ok else None, tied, partition)
    return replace(
        plan,
        layers=plan.layers + (layer,),
        vocab=vocab,
        replicated=tuple(r for r in plan.replicated if r[0] != head_path),
    )


def _vocab_refusal(model: nn.Module, plan: Plan) -> str:
    if plan.tp_size == 1:
        return "tp_size=1"
    if plan.vocab_reason:  # the policy says why not
        return plan.vocab_reason
    if not plan.origin.checked_by_hand:
        return "only models covered by a policy (the loss and logits path of others is unchecked)"
    if not is_causal_lm(model):
        return f"{type(model).__name__} is not a causal LM"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or any(layer.path.endswith(".lm_head") for layer in plan.layers):
        return "no plain nn.Linear LM head"
    if head.out_features < plan.tp_size:
        return f"the LM head's vocabulary ({head.out_features}) is smaller than tp_size={plan.tp_size}"
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    allowed = {id(embedding.weight)} if embedding is not None and embedding.weight is head.weight else set()
    names: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        names[id(param)] = names.get(id(param), 0) + 1
    shared = [p for p in (head.weight, head.bias) if p is not None and names.get(id(p), 0) > 1 and id(p) not in allowed]
    if shared:
        return "the LM head shares a parameter with another module (besides a tied embedding)"
    return ""
