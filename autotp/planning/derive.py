"""Policies for models no shipped policy covers: from HF's `base_model_tp_plan`, else from structure.

Both produce an ordinary `Policy`, so the plan builder checks their shapes like any other. They
only shard what they can lay out unambiguously: separate q/k/v/o projections, plain MLPs, and
HF's packed gate|up. A fused projection whose row order cannot be read from shapes, or a block
HF itself keeps replicated (`colwise_gather_output`, `rowwise_split_input`), stays replicated.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace
from fnmatch import fnmatchcase

from torch import nn

from .linears import features, is_linear
from .policy import Origin, Policy, mixer_rules, parse_policy

_ATTENTION_HINTS = ("attn", "attention")
_WHOLE = {"colwise_gather_output", "rowwise_split_input"}  # HF's styles that keep a block's computation whole
_QKV = {"q_proj", "k_proj", "v_proj"}  # attention by its children where the block's name says "mixer" (Nemotron-H)
_OUTPUT_NAMES = {"o_proj", "out_proj", "dense", "c_proj", "proj", "wo", "o", "output", "out"}  # then verified


def derive_policy(model: nn.Module) -> Policy:
    """`_derived`, with the token mixers of `policies/mixers.toml` for the blocks neither shards (verified as every
    derived block is). A mixer HF's plan keeps whole (`colwise_gather_output`: every rank computes all of it) is
    one transformers could not split, not one that must not be: its rule applies, and verification decides."""
    policy = _derived(model)
    claimed = [rule.match for rule in policy.rules]
    hf_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    sharding = [path for path, style in zip(_hf_paths(model, hf_plan), hf_plan.values()) if style not in _WHOLE]
    mixers = tuple(r for r in mixer_rules() if r.refuse or r.match not in claimed and not _spoken(r.match, sharding))
    modules = list(dict(model.named_modules()))
    mixers = tuple(r for r in mixers if any(fnmatchcase(name, r.match) for name in modules))
    if not mixers:
        return policy
    # a mixer owns what is inside it: a block detected there (Kimi's forget gate) is a part of the mixer's
    kept = tuple(r for r in policy.rules if not any(r.match.startswith(m.match + ".") for m in mixers))
    return replace(policy, rules=kept + mixers)


def _derived(model: nn.Module) -> Policy:
    """HF's plan translated where the config has one, and structural detection for every block it leaves out.

    transformers' plans speak for some blocks only (since 5.24, the embedding alone for a dozen model types; MoE
    plans often the experts alone): a block HF's plan names keeps HF's decision, replicated included, and the
    others are detected as for a model with no plan, and experts no rule covers from transformers' own layout flags
    (`_with_flagged_experts`). All are verified by emulation before anything is sharded.
    """
    return _with_flagged_experts(model, _hf_and_detected(model))


def _hf_and_detected(model: nn.Module) -> Policy:
    hf_plan = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    detected = _from_structure(model, spoken=_hf_paths(model, hf_plan))
    if not hf_plan:
        return detected
    from_hf = _from_hf_plan(model, hf_plan)
    if not from_hf.rules:
        return detected
    if not detected.rules:
        return from_hf
    return replace(from_hf, rules=from_hf.rules + detected.rules, origin=Origin.HF_PLAN_FILLED)


_EXPERT_FLAGS = ("has_gate", "has_bias", "is_transposed", "is_concatenated", "has_post_expert_norm")


def _with_flagged_experts(model: nn.Module, policy: Policy) -> Policy:
    """`policy` with an experts rule for each experts module transformers' `use_experts_implementation` built that no
    rule covers: its flags say how the tensors are laid out, and its forward (every implementation) follows them.

    The width splits inside each expert: [gate | up] (`is_concatenated`), gate and up interleaved, or up alone
    (`has_gate` false), on dim 1 of [experts, 2 x width, hidden] or dim 2 when `is_transposed`; the output bias is
    counted once. A norm of each expert's whole output (`has_post_expert_norm`) keeps the experts whole.
    """
    covered = [rule.match for rule in policy.rules if rule.kind == "experts"]
    found: dict[str, dict] = {}
    for name, module in model.named_modules():
        if not all(isinstance(getattr(module, flag, None), bool) for flag in _EXPERT_FLAGS):
            continue
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if module.has_post_expert_norm or pattern in found or any(fnmatchcase(name, m) for m in covered):
            continue
        first = "gate_up_proj" if module.has_gate else "up_proj"
        layout = ("w | w" if module.is_concatenated else "(w w)") if module.has_gate else "w"
        width_dim, down_dim = (2, 1) if module.is_transposed else (1, 2)
        params = {first: {"dim": width_dim, "layout": layout}, "down_proj": {"dim": down_dim}}
        rule: dict = {"match": pattern, "params": params}
        if module.has_bias:
            params[f"{first}_bias"] = {"dim": 1, "layout": layout}
            rule["bias_once"] = ["down_proj_bias"]
        found[pattern] = rule
    if not found:
        return policy
    rules = parse_policy({"experts": list(found.values())}, name=policy.name, origin=policy.origin).rules
    return replace(policy, rules=policy.rules + rules)


def _prefix(model: nn.Module) -> str:
    """The base model's attribute path, which `base_model_tp_plan` keys are relative to ("" if it has none)."""
    prefix = getattr(model, "base_model_prefix", "")
    return prefix if prefix and hasattr(model, prefix) else ""


def _hf_paths(model: nn.Module, hf_plan: dict[str, str]) -> list[str]:
    """Every module pattern HF's plan names, from the model's root."""
    prefix = _prefix(model)
    return [f"{prefix}.{key}" if prefix else key for key in hf_plan]


def _spoken(block: str, paths: Sequence[str]) -> bool:
    """Whether HF's plan decides `block`: it names the block, a module inside it, or a module holding it."""
    return any(path == block or fnmatchcase(path, f"{block}.*") or fnmatchcase(block, f"{path}.*") for path in paths)


def _spoken_inside(model: nn.Module, name: str, pattern: str, paths: Sequence[str]) -> bool:
    """Whether HF's plan decides the block at `name`: it names the block's pattern or a module holding it, or a module
    this block holds (not merely one its pattern's other blocks hold: Nemotron-H's MoE `mixer.experts` say nothing of
    its attention and MLP mixers, which share the pattern)."""
    if any(path == pattern or fnmatchcase(pattern, f"{path}.*") for path in paths):
        return True
    inside = [sub for sub, _ in model.get_submodule(name).named_modules() if sub]
    return any(fnmatchcase(f"{name}.{sub}", path) for sub in inside for path in paths)


def _field(config, name: str) -> int | None:
    """A positive integer config field, or None (absent, not an int, or refused by a per-layer config)."""
    try:
        value = getattr(config, name, None)
    except Exception:  # some configs raise for fields that vary per layer
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _heads(config) -> tuple[int | None, int | None, int | None]:
    heads = _field(config, "num_attention_heads")
    if heads is None:
        return None, None, None
    kv = _field(config, "num_key_value_heads") or heads
    hidden = _field(config, "hidden_size")
    head_dim = _field(config, "head_dim") or (hidden // heads if hidden else None)
    return heads, kv, head_dim


def _block_rule(
    model: nn.Module, block: str, columns: dict[str, str], row_layers: list[str], path: str | None = None
) -> tuple[str, dict] | None:
    """An attention or MLP rule for one block pattern, from its children's shapes (those of the block at `path`, else
    of the first the pattern names); None if unclear."""
    config = model.config
    heads, kv, head_dim = _heads(config)
    modules = dict(model.named_modules())
    instance = modules.get(path) if path else next((m for name, m in modules.items() if fnmatchcase(name, block)), None)
    if instance is None or len(row_layers) != 1:
        return None
    # a bare parameter HF's plan splits with the projections (Beam's gate_bias, sinks) is no linear: it is one entry
    # per head (`head_params` below) or stays for verification to refuse
    columns = {name: s for name, s in columns.items() if not isinstance(getattr(instance, name, None), nn.Parameter)}
    try:
        children = {name: instance.get_submodule(name) for name in [*columns, *row_layers]}
    except AttributeError:
        return None
    if not all(is_linear(m) for m in children.values()):
        return None
    outs = {name: features(children[name])[0] for name in columns}
    row_in = features(children[row_layers[0]])[1]
    looks_like_attention = any(h in block.rsplit(".", 1)[-1].lower() for h in _ATTENTION_HINTS) or _QKV <= set(columns)
    if looks_like_attention and heads and kv and head_dim and row_in == heads * head_dim:  # kv is set with heads
        layout = {}
        for name, out in outs.items():
            if columns[name] != "w" or out not in (heads * head_dim, kv * head_dim):
                return None
            layout[name] = "q" if out == heads * head_dim else "k"
        rule = {
            "match": block,
            "column": layout,
            "row": {row_layers[0]: "q"},
            "heads": "num_attention_heads",
            "kv_heads": kv,
        }
        per_head = [name for name, p in instance.named_parameters(recurse=False) if p.dim() and p.shape[0] == heads]
        if per_head:  # one entry per query head (gpt-oss's sinks): split with the heads, then verified
            rule["head_params"] = per_head
        norms = _head_norms(instance, head_dim, set(children))
        if norms:  # a norm over each head's dim (Qwen3's q_norm): whole on each rank, gradient summed, then verified
            rule["head_norms"] = norms
        return "attention", rule
    parts = {name: 2 if columns[name] == "w | w" else 1 for name in columns}
    if all(out == row_in * parts[name] for name, out in outs.items()):
        return "mlp", {"match": block, "column": dict(columns), "row": list(row_layers)}
    return None


def _head_norms(block: nn.Module, head_dim: int, linears: set[str]) -> list[str]:
    """The children of an attention block, its projections aside, whose every parameter is one vector of a head's
    size: norms applied to each head alone, so each rank runs them whole on its own heads."""
    out = []
    for name, child in block.named_children():
        params = list(child.parameters())
        if name not in linears and params and all(p.shape == (head_dim,) for p in params):
            out.append(name)
    return out


def _from_hf_plan(model: nn.Module, hf_plan: dict[str, str]) -> Policy:
    blocks: dict[str, dict] = defaultdict(lambda: {"column": {}, "row": [], "other": [], "norms": []})
    for path, style in zip(_hf_paths(model, hf_plan), hf_plan.values()):
        block, _, child = path.rpartition(".")
        entry = blocks[block]
        if style == "colwise":
            entry["column"][child] = "w"
        elif style == "packed_colwise":
            entry["column"][child] = "w | w"
        elif style == "rowwise":
            entry["row"].append(child)
        elif style == "replicated_with_grad_allreduce":
            entry["norms"].append(child)
        else:
            entry["other"].append(style)
    data: dict[str, list] = {"attention": [], "mlp": [], "experts": []}
    experts = {path for path, e in blocks.items() if "moe_tp_experts" in e["other"]}
    for block, entry in blocks.items():
        parent = block.rpartition(".")[0]
        if parent in experts and set(entry["column"]) <= {"gate_up_proj"} and entry["row"] == ["down_proj"]:
            if entry["column"].get("gate_up_proj") == "w | w":
                data["experts"].append(
                    {"match": block, "params": {"gate_up_proj": {"dim": 1, "layout": "w | w"}, "down_proj": {"dim": 2}}}
                )
            continue
        if entry["other"] or not entry["column"]:
            continue  # HF keeps this block's compute replicated (or it is not a linear block)
        found = _block_rule(model, block, entry["column"], entry["row"])
        if found:
            kind, rule = found
            if kind == "attention" and entry["norms"]:
                rule["head_norms"] = sorted({*rule.get("head_norms", ()), *entry["norms"]})
            data[kind].append(rule)
    return parse_policy(data, name=model.config.model_type, origin=Origin.HF_PLAN)


def _from_structure(model: nn.Module, spoken: Sequence[str] = ()) -> Policy:
    """Blocks whose direct children are linears reading the hidden size and one linear writing it back, except those
    HF's plan decides (`spoken`: the module patterns it names)."""
    hidden = _field(model.config, "hidden_size")
    patterns: dict[tuple[str, frozenset[str]], dict] = {}
    for name, module in model.named_modules():
        linears = {child: m for child, m in module.named_children() if is_linear(m)}
        if len(linears) < 2 or not isinstance(hidden, int):
            continue
        reads = {
            c: "w"
            for c, m in linears.items()
            if features(m)[1] == hidden
            and features(m)[0] != hidden
            or features(m)[1] == hidden
            and any(h in name.lower() for h in _ATTENTION_HINTS)
        }
        writes = [c for c, m in linears.items() if features(m)[0] == hidden and c not in reads]
        if not writes and len(reads) > 2:  # square attention: the output projection is known by its name
            writes = [c for c in reads if c.lower() in _OUTPUT_NAMES][:1]
            reads = {c: "w" for c in reads if c not in writes}
        named = [c for c in writes if c.lower() in _OUTPUT_NAMES]
        if len(writes) > 1 and len(named) == 1:  # a query as wide as the hidden size, in a block not named attention
            reads.update({c: "w" for c in writes if c not in named})
            writes = named
        pattern = ".".join("*" if part.isdigit() else part for part in name.split("."))
        if reads and len(writes) == 1 and not _spoken_inside(model, name, pattern, spoken):
            # one pattern may name blocks of several kinds (Nemotron-H's `layers.*.mixer`: Mamba, attention, MLP):
            # a rule for each set of children, which claims only the blocks holding them
            patterns.setdefault((pattern, frozenset(linears)), {"column": reads, "row": writes, "path": name})
    data: dict[str, list] = {"attention": [], "mlp": [], "experts": []}
    for (block, _), entry in patterns.items():
        found = _block_rule(model, block, entry["column"], entry["row"], entry["path"])
        if found:
            data[found[0]].append(found[1])
    return parse_policy(data, name=model.config.model_type, origin=Origin.DETECTED)
