"""State-space mixers (Mamba, Mamba-2) split by heads: a detected rule, applied to every plan.

A Mamba-2 mixer (Mamba2, Nemotron-H, Bamba, Zamba2, Granite-4 hybrids) computes, per head, from one fused input
projection [z | x | B | C | dt]: z and x are `head_dim` rows per head, B and C `state_size` rows per group of
heads, dt one row per head. Each rank takes whole heads and the groups they read (`HeadLayout`, groups as
key/value heads: a group is replicated over the ranks sharing it where there are fewer groups than ranks); the
depthwise conv1d over [x | B | C] follows by channel, `A_log`, `D`, `dt_bias` by head, the gated norm's weight by
channel, and `out_proj` is row-parallel. The gated norm normalises groups of channels: exact on a shard where each
rank holds whole groups, else its statistics are summed over TP (`GroupNormPlan`).

Zamba's Mamba is per head throughout (each head its own x_proj and dt_proj), split by heads with nothing re-entering.
A Mamba (v1) mixer (Mamba, Falcon-Mamba, Jamba) is per channel: `in_proj` [x | z], conv1d, `dt_proj`, `A_log` and
`D` by channel; `x_proj` reads the channels and writes dt, B and C, which every channel reads: a row-parallel layer
whose summed output enters the TP span again (`Plan.reentries`); weighted norms on that output sum their
gradients over TP (`Plan.head_norms`).

Only transformers' own classes, whose torch path this was written for and parity-tested on; with the fused
`mamba_ssm` kernel installed (it runs the whole mixer, `out_proj` included, in one call) they stay replicated.
"""

from __future__ import annotations

import importlib.util
from dataclasses import replace

from torch import nn

from ..compat.hf import is_transformers_class
from .plan import AttrPlan, GroupNormPlan, LayerPlan, ParamPlan, Plan
from .sharding import HeadLayout, Partition, layout_partition, split_ranges

_MAMBA2 = {"in_proj": "h | h | g | g | t", "conv1d": "h | g | g", "A_log": "t", "D": "t", "dt_bias": "t"}
_MAMBA2_ATTRS = ("num_heads", "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim")
_MAMBA1_ATTRS = ("intermediate_size", "ssm_state_size", "time_step_rank")
# Zamba's Mamba: per-head x_proj / dt_proj tensors, in_proj rows (x, z) interleaved per channel
_ZAMBA = ("x_proj_weight", "dt_proj_weight", "dt_proj_bias", "A_log", "D")
_ZAMBA_ATTRS = ("n_mamba_heads", "mamba_head_dim", "intermediate_size")


def with_mixers(model: nn.Module, plan: Plan) -> Plan:
    """`plan` with every Mamba / Mamba-2 mixer it leaves whole split by heads, or the reason it stays whole."""
    if plan.tp_size == 1:
        return plan
    planned = {layer.path for layer in plan.layers}
    out = plan
    for path, module in model.named_modules():
        kind = _kind(module)
        if kind is None or any(p == path or p.startswith(path + ".") for p in planned):
            continue
        why = _refusal(module)
        try:
            if not why:
                out = {1: _mamba1, 2: _mamba2, 3: _zamba}[kind](path, module, out)
                continue
        except ValueError as err:
            why = str(err)
        out = replace(out, mixers=out.mixers + ((path, why),))
    return out


def _kind(module: nn.Module) -> int | None:
    """2 for a Mamba-2 mixer, 1 for a Mamba mixer, 3 for Zamba's per-head Mamba, None for anything else (by its
    parts, not its name)."""
    if not all(isinstance(getattr(module, name, None), nn.Linear) for name in ("in_proj", "out_proj")):
        return None
    if all(isinstance(getattr(module, name, None), nn.Parameter) for name in _ZAMBA) and _ints(module, _ZAMBA_ATTRS):
        return 3
    if not isinstance(getattr(module, "conv1d", None), nn.Conv1d) or not isinstance(
        getattr(module, "D", None), nn.Parameter
    ):
        return None
    if isinstance(getattr(module, "dt_bias", None), nn.Parameter) and _ints(module, _MAMBA2_ATTRS):
        return 2
    if isinstance(getattr(module, "x_proj", None), nn.Linear) and _ints(module, _MAMBA1_ATTRS):
        return 1
    return None


def _ints(module: nn.Module, names: tuple[str, ...]) -> bool:
    return all(isinstance(getattr(module, name, None), int) for name in names)


def _refusal(module: nn.Module) -> str:
    if not is_transformers_class(module):
        return f"{type(module).__name__} is not transformers' own mixer, whose torch path autotp splits"
    if importlib.util.find_spec("mamba_ssm") is not None:
        return "the fused mamba_ssm kernel is installed: it runs the whole mixer (out_proj included) in one call"
    return ""


def _others(module: nn.Module, known: set[str]) -> list[str]:
    """Parameters and buffers of `module` outside `known` (dotted names)."""
    names = [name for name, _ in module.named_parameters()] + [name for name, _ in module.named_buffers()]
    return [name for name in names if name not in known]


def _mamba2(path: str, mixer: nn.Module, plan: Plan) -> Plan:
    heads, head_dim, groups, state = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    layout, norm = _mamba2_layout(mixer, plan.tp_size)
    owned = {"h": layout.q, "g": layout.kv, "t": layout.q}
    units = {"h": head_dim, "g": state, "t": 1}

    def part(spec: str, dim: int = 0) -> Partition:
        return layout_partition(spec, dim, owned, units)

    what = f"{heads} heads of {head_dim} in {groups} groups of state {state}"
    in_proj = tuple(mixer.in_proj.weight.shape)
    layers = (
        LayerPlan(f"{path}.in_proj", "column", in_proj, part(_MAMBA2["in_proj"]), f"z | x | B | C | dt, {what}", path),
        LayerPlan(f"{path}.out_proj", "row", tuple(mixer.out_proj.weight.shape), part("h", 1), f"{what}", path),
    )
    params = [
        _param(path, name, tuple(getattr(mixer, name).shape), part(_MAMBA2[name]), f"per head, {what}", path)
        for name in ("A_log", "D", "dt_bias")
    ]
    for name, param in mixer.conv1d.named_parameters():
        params.append(_param(f"{path}.conv1d", name, tuple(param.shape), part(_MAMBA2["conv1d"]), "x | B | C", path))
    if norm is not None:
        params.append(_param(f"{path}.norm", "weight", tuple(norm.weight.shape), part("h"), "gated norm", path))
    mup = getattr(mixer, "mup_vector", None)
    if mup is not None:  # Falcon-H1's per-row multipliers of the projection: sliced as its rows
        rows = part(_MAMBA2["in_proj"], mup.dim() - 1)
        params.append(_param(path, "mup_vector", tuple(mup.shape), rows, "in_proj's rows", path, buffer=True))
    norms: tuple[GroupNormPlan, ...] = ()
    group_size = getattr(norm, "group_size", None)
    if isinstance(group_size, int) and groups < plan.tp_size:  # a group spans ranks: its statistics are summed
        norms = (GroupNormPlan(f"{path}.norm", groups, group_size, tuple(r.start for r in layout.kv)),)
    return _added(plan, path, layers, params, _mamba2_attrs(path, mixer, layout, norm), norms)


def _mamba2_layout(mixer: nn.Module, tp: int) -> tuple[HeadLayout, nn.Module | None]:
    """The heads and groups each rank holds, and the gated norm (None: an identity), or ValueError saying why not."""
    heads, head_dim, groups = mixer.num_heads, mixer.head_dim, mixer.n_groups
    state, inner, conv_dim = mixer.ssm_state_size, mixer.intermediate_size, mixer.conv_dim
    if heads * head_dim != inner or conv_dim != inner + 2 * groups * state:
        raise ValueError(
            f"its sizes do not make a Mamba-2 mixer ({heads} heads of {head_dim}, {inner} channels, {groups} groups "
            f"of state {state}, conv {conv_dim})"
        )
    if mixer.in_proj.out_features != inner + conv_dim + heads:
        raise ValueError(f"in_proj writes {mixer.in_proj.out_features} rows, not z, x, B, C and dt")
    known = {f"{name}.weight" for name in ("in_proj", "out_proj", "conv1d", "norm")}
    known |= {f"{name}.bias" for name in ("in_proj", "out_proj", "conv1d")} | {"A_log", "D", "dt_bias", "mup_vector"}
    extra = _others(mixer, known)
    if extra:
        raise ValueError(f"it holds {extra[0]}, which autotp does not know how to split")
    try:
        layout = HeadLayout.plan(heads, groups, tp)
    except ValueError as err:  # its words are of query and key/value heads: the mixer's heads and groups
        raise ValueError(f"its {heads} heads in {groups} groups do not split over tp_size={tp} ({err})") from None
    norm = getattr(mixer, "norm", None)
    if isinstance(norm, nn.Identity):
        return layout, None
    by_count = getattr(norm, "n_groups", None) == groups and groups % tp == 0  # Falcon-H1's: by group count
    if getattr(norm, "group_size", None) != inner // groups and not by_count:
        raise ValueError(f"its gated norm ({type(norm).__name__}) does not split over {groups} groups at this tp size")
    return layout, norm


def _mamba2_attrs(path: str, mixer: nn.Module, layout: HeadLayout, norm: nn.Module | None) -> list[AttrPlan]:
    """The counts a Mamba-2 mixer reads to split its projection and reshape its heads, per rank."""
    head_dim, groups, state = mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
    local_heads = tuple(len(r) for r in layout.q)
    local_groups = tuple(len(r) for r in layout.kv)
    local_inner = tuple(n * head_dim for n in local_heads)
    local_conv = tuple(i + 2 * g * state for i, g in zip(local_inner, local_groups))
    conv_dim = mixer.conv_dim
    attrs = [
        AttrPlan(path, "num_heads", mixer.num_heads, local_heads),
        AttrPlan(path, "n_groups", groups, local_groups),
        AttrPlan(path, "intermediate_size", mixer.intermediate_size, local_inner),
        AttrPlan(path, "conv_dim", conv_dim, local_conv),
        *(AttrPlan(f"{path}.conv1d", name, conv_dim, local_conv) for name in ("in_channels", "out_channels", "groups")),
    ]
    if isinstance(getattr(mixer, "groups_time_state_size", None), int):
        attrs.append(AttrPlan(path, "groups_time_state_size", groups * state, tuple(g * state for g in local_groups)))
    if norm is not None and getattr(norm, "n_groups", None) == groups:
        attrs.append(AttrPlan(f"{path}.norm", "n_groups", groups, local_groups))
    return attrs


def _mamba1(path: str, mixer: nn.Module, plan: Plan) -> Plan:
    inner, rank_dt, state = mixer.intermediate_size, mixer.time_step_rank, mixer.ssm_state_size
    dt_proj = getattr(mixer, "dt_proj", None)
    if (
        mixer.in_proj.out_features != 2 * inner
        or mixer.x_proj.weight.shape != (rank_dt + 2 * state, inner)
        or not isinstance(dt_proj, nn.Linear)
        or dt_proj.weight.shape != (inner, rank_dt)
        or mixer.conv1d.weight.shape[0] != inner
    ):
        raise ValueError(f"its sizes do not make a Mamba mixer ({inner} channels, dt rank {rank_dt}, state {state})")
    known = {
        f"{name}.{p}" for name in ("in_proj", "out_proj", "conv1d", "dt_proj", "x_proj") for p in ("weight", "bias")
    }
    known |= {"A_log", "D"}
    extra = _others(mixer, known)
    norms = sorted({name.rpartition(".")[0] for name in extra if name.rpartition(".")[0].endswith("layernorm")})
    extra = [name for name in extra if name.rpartition(".")[0] not in norms]
    if extra:
        raise ValueError(f"it holds {extra[0]}, which autotp does not know how to split")
    channels = Partition.even(0, inner, plan.tp_size)
    owned = {"h": [range(run[0][0], run[0][0] + run[0][1]) for run in channels.runs]}
    both = layout_partition("h | h", 0, owned, {"h": 1})
    what = f"{inner} channels"
    layers = (
        LayerPlan(f"{path}.in_proj", "column", tuple(mixer.in_proj.weight.shape), both, f"x | z, {what}", path),
        LayerPlan(
            f"{path}.x_proj",
            "row",
            tuple(mixer.x_proj.weight.shape),
            channels.with_dim(1),
            "dt | B | C, summed and read by every channel",
            "",
        ),
        LayerPlan(f"{path}.out_proj", "row", tuple(mixer.out_proj.weight.shape), channels.with_dim(1), what, path),
    )
    params = [
        _param(path, name, tuple(getattr(mixer, name).shape), channels, f"per channel, {what}", path)
        for name in ("A_log", "D")
    ]
    for sub in ("conv1d", "dt_proj"):
        for name, param in getattr(mixer, sub).named_parameters():
            params.append(_param(f"{path}.{sub}", name, tuple(param.shape), channels, f"per channel, {what}", path))
    local = tuple(channels.local_size(r) for r in range(plan.tp_size))
    attrs = [
        AttrPlan(path, "intermediate_size", inner, local),
        *(AttrPlan(f"{path}.conv1d", name, inner, local) for name in ("in_channels", "out_channels", "groups")),
        AttrPlan(f"{path}.dt_proj", "out_features", inner, local),
    ]
    out = _added(plan, path, layers, params, attrs, ())
    return replace(
        out,
        reentries=out.reentries + (f"{path}.x_proj",),
        head_norms=out.head_norms + tuple(f"{path}.{name}" for name in norms),
    )


def _zamba(path: str, mixer: nn.Module, plan: Plan) -> Plan:
    """Zamba's Mamba: each head projects its own dt, B and C (`x_proj_weight[head]`), so nothing crosses heads but
    `out_proj`; `in_proj` holds each channel's x and z rows side by side."""
    heads, head_dim, inner = mixer.n_mamba_heads, mixer.mamba_head_dim, mixer.intermediate_size
    if heads * head_dim != inner or mixer.in_proj.out_features != 2 * inner or mixer.conv1d.weight.shape[0] != inner:
        raise ValueError(f"its sizes do not make Zamba's Mamba mixer ({heads} heads of {head_dim}, {inner} channels)")
    known = {f"{name}.{p}" for name in ("in_proj", "out_proj", "conv1d") for p in ("weight", "bias")} | set(_ZAMBA)
    extra = _others(mixer, known)
    if extra:
        raise ValueError(f"it holds {extra[0]}, which autotp does not know how to split")
    if heads < plan.tp_size:
        raise ValueError(f"its {heads} heads do not give every one of tp_size={plan.tp_size} ranks a head")
    owned = {"h": split_ranges(heads, plan.tp_size)}
    what = f"{heads} heads of {head_dim}"

    def part(unit: int, dim: int = 0) -> Partition:
        return layout_partition("h", dim, owned, {"h": unit})

    layers = (
        LayerPlan(
            f"{path}.in_proj",
            "column",
            tuple(mixer.in_proj.weight.shape),
            part(2 * head_dim),
            f"(x z) per channel, {what}",
            path,
        ),
        LayerPlan(f"{path}.out_proj", "row", tuple(mixer.out_proj.weight.shape), part(head_dim, 1), what, path),
    )
    params = [
        _param(path, name, tuple(getattr(mixer, name).shape), part(1), f"per head, {what}", path) for name in _ZAMBA
    ]
    for name, param in mixer.conv1d.named_parameters():
        params.append(_param(f"{path}.conv1d", name, tuple(param.shape), part(head_dim), "channels", path))
    local = tuple(len(r) for r in owned["h"])
    channels = tuple(n * head_dim for n in local)
    attrs = [
        AttrPlan(path, "n_mamba_heads", heads, local),
        AttrPlan(path, "intermediate_size", inner, channels),
        *(AttrPlan(f"{path}.conv1d", name, inner, channels) for name in ("in_channels", "out_channels", "groups")),
    ]
    return _added(plan, path, layers, params, attrs, ())


def _param(
    module: str, name: str, shape: tuple[int, ...], partition: Partition, reason: str, mixer: str, buffer: bool = False
) -> ParamPlan:
    """`module`'s tensor `name`, split in place with `mixer`'s heads; a state-space mixer mixes tokens after its
    column projection (its convolution and scan read the whole sequence SP gathers there)."""
    return ParamPlan(f"{module}.{name}", shape, partition, mixer, reason, buffer, in_span=True)


def _added(plan: Plan, path: str, layers, params, attrs, norms) -> Plan:
    paths = {layer.path for layer in layers} | {param.module for param in params}  # Mamba's dt_proj: in place
    return replace(
        plan,
        layers=plan.layers + tuple(layers),
        params=plan.params + tuple(params),
        attrs=plan.attrs + tuple(a for a in attrs if any(v != a.full for v in a.local)),
        group_norms=plan.group_norms + tuple(norms),
        replicated=tuple(r for r in plan.replicated if r[0] not in paths),
    )
