"""Declarative per-family sharding policies (the TOML files in `policies/`).

A policy names, per block pattern, which child linears are column- or row-parallel and how their
rows are counted (attention heads from config fields, or plain MLP width). It is data only: the
plan builder turns it into concrete partitions for one model and tp size.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping


@dataclass(frozen=True)
class AttentionRule:
    """Heads-aligned sharding of one attention block pattern."""

    match: str
    heads: str
    kv_heads: str
    column: Mapping[str, str]
    row: Mapping[str, str]
    head_norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class MLPRule:
    """Width sharding of one MLP block pattern."""

    match: str
    column: tuple[str, ...]
    row: tuple[str, ...]


@dataclass(frozen=True)
class Policy:
    name: str
    model_types: tuple[str, ...]
    attention: tuple[AttentionRule, ...] = ()
    mlp: tuple[MLPRule, ...] = ()
    description: str = ""
    source: str = field(default="", compare=False)


def _policy_dir() -> Path:
    installed = Path(__file__).parent / "policies"  # where the wheel puts them
    return installed if installed.is_dir() else Path(__file__).parent.parent / "policies"


def parse_policy(data: Mapping[str, Any], name: str, source: str = "") -> Policy:
    """A `Policy` from a TOML-shaped dict, with errors that name the offending key."""
    known = {"description", "model_types", "attention", "mlp"}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"policy {name!r}: unknown keys {sorted(unknown)}; expected some of {sorted(known)}")
    try:
        attention = tuple(
            AttentionRule(
                match=r["match"], heads=r["heads"], kv_heads=r.get("kv_heads", r["heads"]),
                column=dict(r["column"]), row=dict(r["row"]), head_norms=tuple(r.get("head_norms", ())),
            )
            for r in data.get("attention", ())
        )
        mlp = tuple(
            MLPRule(match=r["match"], column=tuple(r["column"]), row=tuple(r["row"])) for r in data.get("mlp", ())
        )
    except KeyError as err:
        raise ValueError(f"policy {name!r}: a block is missing the key {err}") from None
    for rule in attention:
        bad = {k: v for k, v in {**rule.column, **rule.row}.items() if v not in ("heads", "kv_heads")}
        if bad:
            raise ValueError(f"policy {name!r}, block {rule.match!r}: head counts must be 'heads' or 'kv_heads', got {bad}")
    return Policy(
        name=name, model_types=tuple(data.get("model_types", ())), attention=attention, mlp=mlp,
        description=data.get("description", ""), source=source,
    )


def load_policy(path: str | Path) -> Policy:
    """Read one policy file."""
    path = Path(path)
    with path.open("rb") as f:
        return parse_policy(tomllib.load(f), name=path.stem, source=str(path))


def builtin_policies() -> list[Policy]:
    """Every policy shipped with autotp."""
    return [load_policy(p) for p in sorted(_policy_dir().glob("*.toml"))]


def find_policy(model_type: str) -> Policy | None:
    """The shipped policy covering `model_type`, if any."""
    return next((p for p in builtin_policies() if model_type in p.model_types), None)


def as_policy(policy: "Policy | str | Path | Mapping[str, Any]") -> Policy:
    """Accept a user's policy as a `Policy`, a file path or a dict."""
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, Mapping):
        return parse_policy(policy, name="user policy", source="dict")
    return load_policy(policy)
