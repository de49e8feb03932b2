"""Composite models: the sub-models that carry a config of their own, and plans moved between module paths.

A vision-language model holds a language model and a vision tower, each a `PreTrainedModel` with
its own sub-config (head counts, widths, model type). Each is planned as a model of its own, with
its own policy, and the plans are joined under the sub-model's path. Policies are written against a
family's head model (`model.layers.*` for Llama), so a base sub-model is seen through `Held`, which
puts it where its head model would: under its `base_model_prefix`.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn
from transformers import PreTrainedModel

from .linears import is_linear
from .plan import Plan, Replicated, Why


def components(model: nn.Module) -> list[tuple[str, PreTrainedModel]]:
    """The outermost sub-models whose config is not the model's own (empty for a plain model)."""
    found: list[tuple[str, PreTrainedModel]] = []
    for name, module in model.named_modules():
        if not name or not isinstance(module, PreTrainedModel) or module.config is model.config:
            continue
        if not any(name.startswith(outer + ".") for outer, _ in found):
            found.append((name, module))
    return found


def as_planned(component: PreTrainedModel) -> tuple[nn.Module, str]:
    """What a component is planned as, and the prefix its names then carry: a head model (Llama4's
    `Llama4ForCausalLM` inside the VLM) as it is, a base model through `Held`."""
    if component.get_output_embeddings() is not None:  # it has its own LM head: names as in its family's policy
        return component, ""
    held = Held(component)
    return held, held.prefix


class Held(nn.Module):
    """A base sub-model under its `base_model_prefix`, so names read as in its family's head model."""

    def __init__(self, component: PreTrainedModel) -> None:
        super().__init__()
        self.config = component.config
        self.prefix = component.base_model_prefix or "component"
        self.base_model_prefix = self.prefix
        parent: nn.Module = self
        *outer, last = self.prefix.split(".")  # a dotted prefix (Mllama's "language_model.model") nests
        for name in outer:
            parent.add_module(name, nn.Module())
            parent = getattr(parent, name)
        parent.add_module(last, component)

    def forward(self, *args, **kwargs):  # never run: verification runs the whole model
        raise TypeError("autotp: a held component is only planned, never run")


def rebased(plan: Plan, old: str, new: str) -> Plan:
    """`plan` with every module path under `old` moved under `new` (both dotted prefixes, no trailing dot)."""

    def move(path: str) -> str:
        if not old:
            return f"{new}.{path}" if path else new
        if path == old:
            return new
        if not path.startswith(old + "."):
            raise ValueError(f"autotp: {path} is not under {old}")
        return new + path[len(old) :]

    return replace(
        plan,
        layers=tuple(
            replace(layer, path=move(layer.path), block=move(layer.block) if layer.block else "")
            for layer in plan.layers
        ),
        regions=tuple(replace(r, path=move(r.path)) for r in plan.regions),
        attrs=tuple(replace(a, path=move(a.path)) for a in plan.attrs),
        head_norms=tuple(move(h) for h in plan.head_norms),
        head_inputs=tuple(replace(h, path=move(h.path)) for h in plan.head_inputs),
        attention=tuple(replace(a, path=move(a.path)) for a in plan.attention),
        norms=tuple(replace(n, path=move(n.path)) for n in plan.norms),
        replicated=tuple((move(p), why) for p, why in plan.replicated),
        params=tuple(replace(p, path=move(p.path), block=move(p.block)) for p in plan.params),
        states=tuple(replace(s, path=move(s.path)) for s in plan.states),
        gathered_outputs=tuple(move(g) for g in plan.gathered_outputs),
        whole=tuple(move(w) for w in plan.whole),
    )


def joined(model: nn.Module, parts: list[tuple[str, Plan]], tp_size: int) -> Plan:
    """One plan from each component's (already rebased) plan, and the model's own ("": the blocks outside every
    component that its own policy plans); the other linears outside every component stay replicated.

    Its origin is that of the component holding the input embeddings (the language model): what the
    vocabulary decisions read. `source` names every component's origin.
    """
    planned = {layer.path for _, p in parts for layer in p.layers} | {
        path for _, p in parts for path, _ in p.replicated
    }
    outside = tuple(
        (name, Why(Replicated.OUTSIDE_COMPONENTS))
        for name, m in model.named_modules()
        if is_linear(m) and name not in planned
    )
    return Plan(
        tp_size,
        _text_origin(model, parts),
        "; ".join(f"{name or 'the model itself'}: {p.origin.value} {p.source}" for name, p in parts),
        layers=tuple(layer for _, p in parts for layer in p.layers),
        regions=tuple(r for _, p in parts for r in p.regions),
        attrs=tuple(a for _, p in parts for a in p.attrs),
        head_norms=tuple(h for _, p in parts for h in p.head_norms),
        head_inputs=tuple(h for _, p in parts for h in p.head_inputs),
        attention=tuple(a for _, p in parts for a in p.attention),
        norms=tuple(n for _, p in parts for n in p.norms),
        replicated=tuple(r for _, p in parts for r in p.replicated) + outside,
        vocab_reason=next((p.vocab_reason for _, p in parts if p.vocab_reason), ""),
        params=tuple(param for _, p in parts for param in p.params),
        states=tuple(s for _, p in parts for s in p.states),
        gathered_outputs=tuple(g for _, p in parts for g in p.gathered_outputs),
        whole=tuple(w for _, p in parts for w in p.whole),
    )


def _text_origin(model: nn.Module, parts: list[tuple[str, Plan]]):
    """The origin of the part holding the input embeddings, else the least checked one."""
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    names = {id(m): name for name, m in model.named_modules()}
    where = names.get(id(embedding), "")
    for path, plan in parts:
        if where.startswith(path + "."):
            return plan.origin
    return min((p.origin for _, p in parts), key=lambda origin: origin.checked_by_hand)
