"""The plan: which module gets which style, as data.

`build_plan` reads a model (meta device is fine) and returns a `Plan` that says, for one tp size,
every linear's style and partition, the expert tensors sharded in place, the attention attributes
to adjust, and the parameters whose gradients need a TP sum. It touches no process group, so it
can be printed and tested anywhere; every inconsistency is reported here, before the model is
changed. Where the plan comes from, in order: a shipped or user policy, the model config's
`base_model_tp_plan` (translated), structural detection (see `autotp.detect`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Mapping

from torch import nn

from .policy import Policy, Rule, as_policy, find_policy
from .sharding import HeadLayout, Partition, layout_partition, split_ranges

# Attributes HF attention code may read to reshape heads, and which count each holds.
_HEAD_ATTRS = {
    "num_heads": "q", "num_attention_heads": "q", "n_heads": "q", "n_head": "q",
    "num_key_value_heads": "kv", "num_kv_heads": "kv", "n_kv_heads": "kv",
}
_WIDTH_ATTRS = {"split_size": "q", "embed_dim": "q", "all_head_size": "q", "hidden_size": "q", "kv_dim": "kv"}


@dataclass(frozen=True)
class LayerPlan:
    """One linear to replace: style, full weight shape as stored, and weight partition."""

    path: str
    style: str  # "column" or "row"
    shape: tuple[int, ...]
    partition: Partition
    reason: str
    block: str = ""  # the attention / MLP block it belongs to


@dataclass(frozen=True)
class RegionPlan:
    """A module whose parameters shard in place (MoE experts): inputs enter TP, the output is reduced."""

    path: str
    partitions: tuple[tuple[str, tuple[int, ...], Partition], ...]  # (param name, full shape, partition)
    reason: str


@dataclass(frozen=True)
class AttrPlan:
    """An integer a block reads as a head count or width (`config.x` for a config field): full and per rank."""

    path: str
    name: str
    full: int
    local: tuple[int, ...]

    def assign(self, module: nn.Module, value: int) -> None:
        """Set the attribute on the module at `path` (or on its config, for `config.x`)."""
        target, name = module, self.name
        if name.startswith("config."):
            target, name = module.config, name.removeprefix("config.")
        setattr(target, name, value)


@dataclass(frozen=True)
class HeadInputPlan:
    """A tensor passed to an attention block with all heads folded into dim 0 (ALiBi): sliced per rank."""

    path: str
    name: str
    heads: int
    local: tuple[tuple[int, int], ...]  # (first head, head count) per rank


@dataclass(frozen=True)
class VocabPlan:
    """Vocab parallelism: the LM head (a column layer in `layers`) and the embedding share this row split."""

    head: str
    embedding: str | None  # None: the embedding stays replicated
    tied: bool
    partition: Partition


@dataclass(frozen=True)
class Plan:
    tp_size: int
    source: str
    layers: tuple[LayerPlan, ...] = ()
    regions: tuple[RegionPlan, ...] = ()
    attrs: tuple[AttrPlan, ...] = ()
    head_norms: tuple[str, ...] = ()
    head_inputs: tuple[HeadInputPlan, ...] = ()
    replicated: tuple[tuple[str, str], ...] = ()
    vocab: VocabPlan | None = None
    vocab_reason: str = ""

    def partitions(self) -> list[Partition]:
        return [layer.partition for layer in self.layers] + [p for r in self.regions for _, _, p in r.partitions]

    def replica_groups(self) -> set[tuple[int, ...]]:
        """Sets of TP ranks that hold the same rows of some tensor (replicated KV heads)."""
        return set().union(*(p.replica_groups() for p in self.partitions()))

    def sharded_params(self, model: nn.Module) -> dict[str, Partition]:
        """Parameter name -> partition, for every parameter the plan shards."""
        out = {}
        for layer in self.layers:
            out[f"{layer.path}.weight"] = layer.partition
            if layer.style == "column" and getattr(model.get_submodule(layer.path), "bias", None) is not None:
                out[f"{layer.path}.bias"] = layer.partition.with_dim(0)
        for region in self.regions:
            out.update({f"{region.path}.{name}": partition for name, _, partition in region.partitions})
        if self.vocab is not None and self.vocab.embedding is not None:
            out[f"{self.vocab.embedding}.weight"] = self.vocab.partition
        return out

    def param_bytes(self, model: nn.Module) -> list[int]:
        """Parameter bytes each rank will hold after `wrap` (tied parameters counted once)."""
        sharded = self.sharded_params(model)
        totals = [0] * self.tp_size
        for name, p in model.named_parameters():
            part = sharded.get(name)
            for rank in range(self.tp_size):
                numel = p.numel() if part is None else p.numel() // p.shape[part.dim] * part.local_size(rank)
                totals[rank] += numel * p.element_size()
        return totals

    def describe(self, model: nn.Module | None = None) -> str:
        """A table of every decision, for people; with the model, also each rank's parameter bytes."""
        lines = [f"autotp plan: tp_size={self.tp_size}, from {self.source}"]
        for layer in self.layers:
            lines.append(f"  {layer.style:<10} {layer.path}  {layer.shape} -> {_local_shapes(layer.shape, layer.partition)}"
                         f"  ({layer.reason})")
        for region in self.regions:
            for name, shape, partition in region.partitions:
                lines.append(f"  {'experts':<10} {region.path}.{name}  {shape} -> {_local_shapes(shape, partition)}"
                             f"  ({region.reason})")
        for path in self.head_norms:
            lines.append(f"  {'head-norm':<10} {path}  replicated, gradient summed over TP (acts on sharded heads)")
        for attr in self.attrs:
            lines.append(f"  {'attribute':<10} {attr.path}.{attr.name}  {attr.full} -> {list(attr.local)}")
        for head_input in self.head_inputs:
            lines.append(f"  {'head-input':<10} {head_input.path}({head_input.name}=...)  sliced to each rank's heads")
        for path, why in self.replicated:
            lines.append(f"  {'replicated':<10} {path}  ({why})")
        if self.vocab is not None:
            embedding = (f"embedding {self.vocab.embedding} split the same way" + (" (tied)" if self.vocab.tied else "")
                         if self.vocab.embedding else "embedding replicated")
            lines.append(f"  {'vocab':<10} {self.vocab.head}: logits stay sharded, cross-entropy on the shards; "
                         f"{embedding}")
        elif self.vocab_reason:
            lines.append(f"  {'vocab':<10} not vocab-parallel: {self.vocab_reason}")
        if model is not None:
            full = sum(p.numel() * p.element_size() for p in model.parameters())
            per_rank = self.param_bytes(model)
            lines.append(f"  parameter bytes per rank: {' / '.join(f'{b / 2**20:.2f} MiB' for b in per_rank)}"
                         f" (unsharded {full / 2**20:.2f} MiB)")
        return "\n".join(lines)


def _local_shapes(shape: tuple[int, ...], partition: Partition) -> str:
    shapes = []
    for rank in range(partition.tp_size):
        local = list(shape)
        local[partition.dim] = partition.local_size(rank)
        shapes.append(tuple(local))
    return f"{shapes[0]} each" if len(set(shapes)) == 1 else " / ".join(map(str, shapes))


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a linear whose weight is stored [in, out]."""
    return type(module).__name__ == "Conv1D"


def features(module: nn.Module) -> tuple[int, int]:
    """(out, in) of an nn.Linear or a GPT-2 Conv1D (whose weight is stored [in, out])."""
    if is_conv1d(module):
        return module.weight.shape[1], module.weight.shape[0]
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    raise TypeError(f"expected an nn.Linear or Conv1D, found {type(module).__name__}")


def is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_conv1d(module)


def weight_dim(module: nn.Module, style: str) -> int:
    """The dim of the stored weight that a column (output) or row (input) split cuts."""
    transposed = is_conv1d(module)
    return (1 if transposed else 0) if style == "column" else (0 if transposed else 1)


def build_plan(model: nn.Module, tp_size: int, policy: Policy | str | Path | Mapping[str, Any] | None = None,
               vocab_parallel: bool = True) -> Plan:
    """The plan for `model` at `tp_size`: from `policy`, else a shipped policy, HF's plan or detection.

    `vocab_parallel` shards the embedding and LM head by vocabulary where the model allows it
    (policy-covered causal LMs whose loss goes through `self.loss_function`).
    """
    plan = _build_plan(model, tp_size, policy)
    if not vocab_parallel:
        return replace(plan, vocab_reason="vocab_parallel=False")
    return _with_vocab(model, plan)


def _build_plan(model: nn.Module, tp_size: int, policy) -> Plan:
    config = model.config
    model_type = getattr(config, "model_type", type(model).__name__)
    from .detect import derive_policy, verify_by_emulation  # imported here: detect builds on this module

    chosen = as_policy(policy) if policy is not None else find_policy(model_type)
    if chosen is None:
        return verify_by_emulation(model, plan_from_policy(model, tp_size, derive_policy(model)))
    return verify_by_emulation(model, plan_from_policy(model, tp_size, chosen), only_custom=True)


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
    if policy.rules and not claimed and policy.source not in ("hf-plan", "detected"):
        raise ValueError(f"policy {policy.name!r} shards nothing in {type(model).__name__}: no rule matches its modules")
    order = {name: i for i, name in enumerate(modules)}
    acc.layers.sort(key=lambda layer: order[layer.path])
    sharded = {layer.path for layer in acc.layers}
    replicated = tuple(
        (name, "not covered by the plan; replicated, which is always correct")
        for name, m in modules.items() if is_linear(m) and name not in sharded
    )
    source = f"policy {policy.name!r}" + (f" ({policy.description})" if policy.description else "")
    return Plan(tp_size, source, tuple(acc.layers), tuple(acc.regions), tuple(acc.attrs), tuple(acc.head_norms),
                tuple(acc.head_inputs), replicated)


@dataclass
class _Accumulator:
    layers: list[LayerPlan] = field(default_factory=list)
    regions: list[RegionPlan] = field(default_factory=list)
    attrs: list[AttrPlan] = field(default_factory=list)
    head_norms: list[str] = field(default_factory=list)
    head_inputs: list[HeadInputPlan] = field(default_factory=list)


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
            acc.layers.append(LayerPlan(f"{path}.{name}", style, tuple(module.weight.shape), partition,
                                        f"{spec} over {heads} heads / {kv} kv heads of {head_dim}", path))
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
    acc.head_inputs.extend(HeadInputPlan(path, name, heads, tuple((r.start, len(r)) for r in layout.q))
                           for name in rule.head_inputs)
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
    owned = {"w": split_ranges(width, tp)}
    for style, mapping in (("column", rule.column), ("row", rule.row)):
        for name, spec in mapping.items():
            module = children[name]
            partition = layout_partition(spec, weight_dim(module, style), owned, {"w": 1})
            parts = f" x {_parts(spec)} parts" if _parts(spec) > 1 else ""
            acc.layers.append(LayerPlan(f"{path}.{name}", style, tuple(module.weight.shape), partition,
                                        f"MLP width {width}{parts}", path))
    return True


def _plan_experts(path: str, block: nn.Module, rule: Rule, config, tp: int, acc: _Accumulator) -> bool:
    params = {name: getattr(block, name, None) for name in rule.params}
    if any(not isinstance(p, nn.Parameter) for p in params.values()):
        return False
    widths = {name: params[name].shape[dim] // _parts(spec) for name, (dim, spec) in rule.params.items()}
    width = next(iter(widths.values()))
    if any(w != width for w in widths.values()):
        raise ValueError(f"{path}: the expert tensors disagree on the expert width: {widths}")
    owned = {"w": split_ranges(width, tp)}
    partitions = tuple((name, tuple(params[name].shape), layout_partition(spec, dim, owned, {"w": 1}))
                       for name, (dim, spec) in rule.params.items())
    acc.regions.append(RegionPlan(path, partitions, f"each expert's width {width} split"))
    return True


def _with_vocab(model: nn.Module, plan: Plan) -> Plan:
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
    return replace(plan, layers=plan.layers + (layer,), vocab=vocab,
                   replicated=tuple(r for r in plan.replicated if r[0] != head_path))


def _vocab_refusal(model: nn.Module, plan: Plan) -> str:
    if plan.tp_size == 1:
        return "tp_size=1"
    if not plan.source.startswith("policy ") or "(from transformers'" in plan.source or "detection" in plan.source:
        return "only models covered by a policy (the loss and logits path of others is unchecked)"
    if not type(model).__name__.endswith("ForCausalLM"):
        return f"{type(model).__name__} is not a causal LM"
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear) or any(layer.path.endswith(".lm_head") for layer in plan.layers):
        return "no plain nn.Linear LM head"
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    allowed = {id(embedding.weight)} if embedding is not None and embedding.weight is head.weight else set()
    names: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        names[id(param)] = names.get(id(param), 0) + 1
    shared = [p for p in (head.weight, head.bias) if p is not None and names.get(id(p), 0) > 1 and id(p) not in allowed]
    if shared:
        return "the LM head shares a parameter with another module (besides a tied embedding)"
    try:
        uses_loss_function = "self.loss_function" in inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        uses_loss_function = False
    if not uses_loss_function:
        return "the model computes its loss itself, not through self.loss_function"
    return ""
