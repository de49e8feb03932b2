"""Ranks that agree before sharding: every rank of a TP or DP group must build the same model and wrap it alike.

Ranks that built different configs, passed different options or derived different plans would otherwise train
silently apart, or die in a collective whose sizes differ. `check_sizes` compares the sizes the groups are built from
over the world before any group is (building them is collective); `check_agreement` then compares a fingerprint of the
config, the options and the plan over each group before the model is touched, and names the first difference.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import fields
from typing import Any

import torch.distributed as dist
from torch import nn

from ..mesh import Group, group_size, named_failure
from ..options import AGREED_OPTIONS, WrapOptions
from ..planning.plan import Plan


def check_sizes(sizes: dict[int, tuple[tuple[tuple[str, int], ...], bool]], call: str) -> None:
    """Raise the same ValueError on every rank unless every rank passed the same mesh sizes (`WrapOptions.sizes`:
    tp_size, cp_size, ...) and gave a tp_group or not alike.

    The groups are built from these by collective calls, each rank its own sequence of them: ranks that differ
    would wait on each other until the timeout, with an error that names neither the ranks nor the sizes.
    """
    if len(set(sizes.values())) <= 1:
        return
    by_sizes: dict[tuple, list[int]] = {}
    for rank, theirs in sorted(sizes.items()):
        by_sizes.setdefault(theirs, []).append(rank)
    shown = {axis for axes, _ in by_sizes for axis, n in axes if n != 1} | {"tp", "cp"}  # no ep_size=1 on every rank
    described = "; ".join(
        f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}: "
        + ", ".join(f"{axis}_size={n}" for axis, n in axes if axis in shown)
        + (", tp_group given" if given else "")
        for (axes, given), ranks in by_sizes.items()
    )
    names = " and ".join(f"{axis}_size" for axis, _ in next(iter(by_sizes))[0])
    raise ValueError(
        f"ranks called {call} with different sizes ({described}). Every rank must call {call} with the "
        f"same {names}, and pass tp_group on every rank or on none; no group was built and "
        f"nothing was changed."
    )


def _fingerprint(model: nn.Module, tp_size: int, options: WrapOptions, plan: Plan) -> dict[str, dict[str, str]]:
    """What every rank of a group must share: the config, the options and the plan, as named strings."""
    config: Any = getattr(model, "config", None)
    flat = _flatten(config.to_dict()) if hasattr(config, "to_dict") else {}
    flat.pop("_name_or_path", None)  # each rank may load its own copy of the files
    agreed = {
        "tp_size": str(tp_size),
        **{f.name: str(getattr(options, f.name)) for f in fields(options) if f.name in AGREED_OPTIONS},
    }
    return {"config key": flat, "option": agreed, "plan entry": _plan_entries(plan)}


def _flatten(values: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value, sort_keys=True, default=str)
    return out


def _plan_entries(plan: Plan) -> dict[str, str]:
    """The plan's decisions by module; not its reasons, whose details (verification errors) depend on the weights."""
    entries = {
        f"{layer.path}": f"{layer.style} {layer.shape} dim {layer.partition.dim} {layer.partition.runs}"
        for layer in plan.layers
    }
    for region in plan.regions:
        entries[region.path] = f"experts {[(name, shape, p.dim, p.runs) for name, shape, p in region.partitions]}"
        entries[region.path] += f" bias once {region.bias_once}" if region.bias_once else ""
    for norm in plan.norms:
        entries[norm.path] = f"sharded norm {norm.stat} over {norm.width}"
    for param in plan.params:
        entries[param.path] = f"in place {param.shape} dim {param.partition.dim} {param.partition.runs}"
    for mixer_state in plan.states:
        entries[f"{mixer_state.path}({mixer_state.arg}=...)"] = (
            f"state {mixer_state.items} {mixer_state.partition.runs}"
        )
    for attr in plan.attrs:
        entries[f"{attr.path}.{attr.name}"] = f"{attr.full} {attr.local}"
    for head_input in plan.head_inputs:
        entries[f"{head_input.path}.{head_input.name}"] = f"heads {head_input.heads} {head_input.local}"
    entries.update({path: "replicated" for path, _ in plan.replicated})
    entries["per-head norms"] = str(plan.head_norms)
    entries["gathered outputs"] = str(plan.gathered_outputs)
    entries["whole inside mixers"] = str(plan.whole)
    entries["shared blocks"] = str(plan.shared)
    vocab = plan.vocab
    entries["vocab"] = (
        "none" if vocab is None else f"{vocab.head} {vocab.embedding} {vocab.tied} {vocab.partition.runs}"
    )
    return entries


def check_agreement(
    model: nn.Module, tp_size: int, options: WrapOptions, plan: Plan, groups: list[tuple[str, Group]], call: str
) -> None:
    """Raise on every rank, naming the first difference, unless every rank of each group has the same fingerprint of
    `model`'s config, `options` and `plan` (`fingerprint`).

    Run before the model is touched: ranks that built different models would otherwise train silently apart, or
    die in a collective whose sizes differ. One all-gather of a hash per group; the fingerprints travel only when the
    hashes differ.
    """
    fingerprint = _fingerprint(model, tp_size, options, plan)
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    for kind, group in groups:
        if group_size(group) == 1:
            continue
        ranks = dist.get_process_group_ranks(group)
        with named_failure(group, f"comparing the ranks' configs, options and plans in {call}"):
            digests: list = [None] * len(ranks)
            dist.all_gather_object(digests, digest, group=group)
            if len(set(digests)) == 1:
                continue
            everyone: list = [None] * len(ranks)
            dist.all_gather_object(everyone, fingerprint, group=group)
        raise RuntimeError(_difference(everyone, ranks, kind, call))


def _difference(everyone: list[dict[str, dict[str, str]]], ranks: list[int], kind: str, call: str) -> str:
    """The first entry in which a rank's fingerprint differs from the group's first rank's, as a sentence."""
    first = everyone[0]
    for section in first:
        for rank, theirs in zip(ranks[1:], everyone[1:]):
            ours, other = first[section], theirs[section]
            for key in [*ours, *(k for k in other if k not in ours)]:
                if ours.get(key) != other.get(key):
                    return (
                        f"ranks disagree before sharding: {section} {key} is {ours.get(key, '(absent)')} on rank "
                        f"{ranks[0]} but {other.get(key, '(absent)')} on rank {rank} ({kind} group {ranks}). Every "
                        f"rank must build the same model and call {call} with the same options; nothing was "
                        f"changed."
                    )
    return f"ranks {ranks} of a {kind} group disagree before sharding; nothing was changed"
