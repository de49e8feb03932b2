"""Declarative per-family sharding policies (the TOML files in `policies/`).

A policy names, per block pattern, which child linears are column- or row-parallel and the row
layout of each (see `autotp.planning.sharding` for layout strings), and which expert tensors shard inside
each expert. It is data only: `autotp.planning.plan` turns it into partitions for one model and tp size.
Rules may carry `when = {config_field = value}` so one family file can cover its variants; a
block no rule covers stays replicated, which is always correct.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

_LAYOUT_ROLES = {"attention": {"q", "k", "v"}, "mlp": {"w"}, "experts": {"w"}, "mixer": {"w"}}  # mixer: see `_rule`


class Origin(Enum):
    """Where a policy (and so a plan) came from; decisions read this, never display text."""

    SHIPPED = "shipped policy"
    USER = "user policy"
    HF_PLAN = "transformers' base_model_tp_plan"
    HF_PLAN_FILLED = "transformers' base_model_tp_plan, with structural detection for the blocks it leaves out"
    DETECTED = "structural detection"

    @property
    def checked_by_hand(self) -> bool:
        """Written and parity-tested for the family (shipped) or vouched for by the user, not derived."""
        return self in (Origin.SHIPPED, Origin.USER)

    @property
    def from_hf_plan(self) -> bool:
        """Transformers' plan spoke for some blocks (an explicit plan: one that cannot be verified is refused)."""
        return self in (Origin.HF_PLAN, Origin.HF_PLAN_FILLED)


@dataclass(frozen=True)
class Rule:
    """One block pattern and how to shard it."""

    kind: str  # "attention", "mlp", "experts" or "mixer" (a recurrent or convolutional token mixer)
    match: str
    column: Mapping[str, str] = field(default_factory=dict)  # child path -> layout
    row: Mapping[str, str] = field(default_factory=dict)
    params: Mapping[str, tuple[int, str]] = field(default_factory=dict)  # experts, mixer: name -> (dim, layout)
    heads: str | int = "num_attention_heads"
    kv_heads: str | int | None = None
    when: Mapping[str, Any] = field(default_factory=dict)
    head_norms: tuple[str, ...] = ()
    head_inputs: tuple[str, ...] = ()  # kwargs holding (batch*heads, ...) tensors, such as ALiBi
    local_config: tuple[str, ...] = ()  # config fields the block reads as head counts
    local_attrs: tuple[str, ...] = ()  # mixer: attributes (dotted, under the block) holding its head count or width
    state: Mapping[str, Any] = field(default_factory=dict)  # mixer: a recurrent state passed in (`MixerState`)
    gathered_outputs: tuple[str, ...] = ()  # mlp, mixer: split by output, the output gathered (a gate on the sum)
    whole: tuple[str, ...] = ()  # mixer: modules or parameters under it computed whole on its replicated input
    refuse: str = ""  # mixer: why a block it recognises stays replicated (it cannot be split exactly)
    head_params: tuple[str, ...] = ()  # attention: parameters with one entry per query head on dim 0 (sinks)
    head_repeats: str | int = 1  # attention: how many times over its per-head outputs hold the heads (JetMoE: top-k)
    bias_once: tuple[str, ...] = ()  # experts: per-expert output biases, added on one TP rank (the sum counts it once)
    sharded_norms: Mapping[str, str] = field(
        default_factory=dict
    )  # norm over the split width -> "mean" or "sum" of x^2
    # attention, mlp: a list of low-rank adapters (Zamba2's) -> the column projection each adds its output to
    adapters: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Policy:
    name: str
    model_types: tuple[str, ...]
    rules: tuple[Rule, ...]
    origin: Origin
    description: str = ""
    path: str | None = field(default=None, compare=False)  # the TOML file, when read from one
    no_vocab_parallel: str = ""  # why the vocabulary must stay replicated (its loss is computed inline), if so


def _policy_dir() -> Path:
    installed = Path(__file__).parent.parent / "policies"  # where the wheel puts them (autotp/policies)
    return installed if installed.is_dir() else Path(__file__).parents[2] / "policies"


_RULE_KEYS = {
    "match",
    "column",
    "row",
    "params",
    "heads",
    "kv_heads",
    "when",
    "head_norms",
    "head_inputs",
    "local_config",
    "local_attrs",
    "state",
    "gathered_outputs",
    "whole",
    "refuse",
    "head_params",
    "head_repeats",
    "bias_once",
    "sharded_norms",
    "adapters",
}
_STATE_KEYS = {"arg", "items", "dim", "layer"}


def _rule(kind: str, raw: Mapping[str, Any], where: str) -> Rule:
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    if "match" not in raw:
        raise ValueError(f"{where}: missing the key 'match'")
    default = "w" if kind != "attention" else None
    if kind == "mixer" and "heads" not in raw and "refuse" not in raw:
        raise ValueError(f"{where}: a mixer rule needs 'heads' (the config field or count its width splits into)")
    column = raw.get("column", {})
    column = {name: default for name in column} if isinstance(column, list) else dict(column)
    row = raw.get("row", {})
    row = {name: default for name in row} if isinstance(row, list) else dict(row)
    params = {name: (int(spec["dim"]), spec.get("layout", "w")) for name, spec in raw.get("params", {}).items()}
    for name, layout in {**column, **row, **{k: v[1] for k, v in params.items()}}.items():
        roles = {tok.strip("()*") for part in str(layout).split("|") for tok in part.split()}
        if kind == "mixer":  # a mixer's parts: "w" (equal parts) or the block attribute holding the part's rows
            roles = {"w"} if all(role.isidentifier() for role in roles) else roles
        if layout is None or not roles <= _LAYOUT_ROLES[kind]:
            raise ValueError(f"{where}: {name} has layout {layout!r}; {kind} layouts use {sorted(_LAYOUT_ROLES[kind])}")
    return Rule(
        kind=kind,
        match=raw["match"],
        column=column,
        row=row,
        params=params,
        heads=raw.get("heads", "num_attention_heads"),
        kv_heads=raw.get("kv_heads"),
        when=dict(raw.get("when", {})),
        head_norms=tuple(raw.get("head_norms", ())),
        head_inputs=_names(raw.get("head_inputs", ()), f"{where}: head_inputs"),
        local_config=tuple(raw.get("local_config", ())),
        local_attrs=_names(raw.get("local_attrs", ()), f"{where}: local_attrs"),
        state=_state(raw.get("state", {}), f"{where}: state"),
        whole=_names(raw.get("whole", ()), f"{where}: whole"),
        refuse=str(raw.get("refuse", "")),
        gathered_outputs=_names(raw.get("gathered_outputs", ()), f"{where}: gathered_outputs"),
        head_params=_names(raw.get("head_params", ()), f"{where}: head_params"),
        head_repeats=raw.get("head_repeats", 1),
        bias_once=_names(raw.get("bias_once", ()), f"{where}: bias_once"),
        sharded_norms=_norms(raw.get("sharded_norms", {}), f"{where}: sharded_norms"),
        adapters=_adapters(raw.get("adapters", {}), column, f"{where}: adapters"),
    )


def _state(value: Any, where: str) -> dict[str, Any]:
    """A mixer's state entry: the keyword argument, which items of its list, their channel dim, the layer attribute."""
    if not value:
        return {}
    if not isinstance(value, Mapping) or set(value) != _STATE_KEYS:
        raise ValueError(f"{where} must be a table with the keys {sorted(_STATE_KEYS)}, got {value!r}")
    return {
        "arg": str(value["arg"]),
        "items": tuple(int(i) for i in value["items"]),
        "dim": int(value["dim"]),
        "layer": str(value["layer"]),
    }


def _norms(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(v in ("mean", "sum") for v in value.values()):
        raise ValueError(f'{where} maps each norm to the statistic it takes of x^2, "mean" or "sum"; got {value!r}')
    return dict(value)


def _adapters(value: Any, column: Mapping[str, str], where: str) -> dict[str, str]:
    if not isinstance(value, Mapping) or not all(target in column for target in value.values()):
        raise ValueError(f"{where} maps each adapter list to one of the rule's column projections; got {value!r}")
    return dict(value)


def _names(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where} must be a list of names, got {value!r}")
    return tuple(value)


def parse_policy(data: Mapping[str, Any], name: str, origin: Origin, path: str | None = None) -> Policy:
    """A `Policy` from a TOML-shaped dict, with errors that name the offending key."""
    known = {"description", "model_types", "no_vocab_parallel", *_LAYOUT_ROLES}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"policy {name!r}: unknown keys {sorted(unknown)}; expected some of {sorted(known)}")
    rules = tuple(
        _rule(kind, raw, f"policy {name!r}, {kind} rule {i}")
        for kind in _LAYOUT_ROLES
        for i, raw in enumerate(data.get(kind, ()))
    )
    reason = data.get("no_vocab_parallel", "")
    if not isinstance(reason, str):
        raise ValueError(f"policy {name!r}: no_vocab_parallel must be a string saying why, got {reason!r}")
    return Policy(
        name=name,
        model_types=tuple(data.get("model_types", ())),
        rules=rules,
        origin=origin,
        description=data.get("description", ""),
        path=path,
        no_vocab_parallel=reason,
    )


def load_policy(path: str | Path, origin: Origin = Origin.USER) -> Policy:
    """Read one policy file."""
    path = Path(path)
    with path.open("rb") as f:
        return parse_policy(tomllib.load(f), name=path.stem, origin=origin, path=str(path))


def builtin_policies() -> list[Policy]:
    """Every policy shipped with autotp."""
    return [load_policy(p, Origin.SHIPPED) for p in sorted(_policy_dir().glob("*.toml"))]


def mixer_rules() -> tuple[Rule, ...]:
    """The token mixers recognised in any model (`policies/mixers.toml`, which claims no model type)."""
    return load_policy(_policy_dir() / "mixers.toml", Origin.SHIPPED).rules


def find_policy(model_type: str) -> Policy | None:
    """The shipped policy covering `model_type`, if any."""
    return next((p for p in builtin_policies() if model_type in p.model_types), None)


def as_policy(policy: Policy | str | Path | Mapping[str, Any]) -> Policy:
    """Accept a user's policy as a `Policy`, a file path or a dict."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, Mapping):
        return parse_policy(policy, name="user policy", origin=Origin.USER)
    return load_policy(policy)
