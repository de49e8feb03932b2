"""The stage cut: which decoder layers each pipeline stage runs, found with no per-model code.

A causal LM is a decoder model holding one list of decoder layers, with a head. Each stage runs the model's own
forward (`autotp.pp.schedule.StageModule`), so whatever the decoder model computes around its layers (embeddings,
learned or rotary position embeddings, a scaling, the attention mask) is computed as one process computes it; the
layers of other stages pass the hidden states through (`Skipped`). This module finds the list and decides the cut.
"""

from __future__ import annotations

import inspect
import math
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn


class Skipped(nn.Module):
    """A decoder layer another stage runs: it hands the hidden states on unchanged. It keeps the layer's index in the
    list, so parameter names and per-layer lookups by index (the mask of a sliding-window layer) keep theirs, and the
    layer's plain attributes (not its modules or tensors), which some decoder models' loops read."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name in dir(layer):  # what decoder models' loops read (attention_type, layer_idx...), properties too
            if name.startswith("_") or hasattr(nn.Module, name):
                continue
            try:
                value = getattr(layer, name)
            except Exception:  # a property that cannot be read on its own
                continue
            if not callable(value) and not isinstance(value, (nn.Module, torch.Tensor)):
                setattr(self, name, value)

    def forward(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return hidden_states


@dataclass(frozen=True)
class Cut:
    """Where a model is cut: the decoder model's path, its layer list's name in it, and the first layer of each
    stage (`bounds[s]` to `bounds[s + 1]`; the last bound is the layer count)."""

    base: str
    layers: str
    bounds: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def layer_range(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def prefixes(self, stages: list[int]) -> tuple[str, ...]:
        """The parameter-name prefixes of the layers that `stages` do not run (the plan's entries dropped there)."""
        kept = {i for s in stages for i in self.layer_range(s)}
        root = f"{self.base}.{self.layers}" if self.base else self.layers
        return tuple(f"{root}.{i}." for i in range(self.bounds[-1]) if i not in kept)

    def stage_of(self, layer: int) -> int:
        """The stage that runs decoder layer `layer`."""
        return next(s for s in range(self.stages) if layer < self.bounds[s + 1])


def find_cut(model: nn.Module, stages: int, split_points: tuple[int, ...] | None) -> Cut:
    """The cut of `model` into `stages` stages, or an error naming what cannot be cut."""
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise NotImplementedError(f"pp_size > 1 on {name}: encoder-decoder models are not cut into stages")
    if model.get_output_embeddings() is None:
        raise NotImplementedError(
            f"pp_size > 1 on {name}: it has no head (get_output_embeddings() is None), and a pipeline's last stage "
            f"computes the loss from the head; use the model's causal-LM class"
        )
    if base_of(model) is None:
        text = _causal_lm_class(model)
        raise NotImplementedError(
            f"pp_size > 1 on {name}: a composite model (its children {list(dict(model.named_children()))}: a "
            f"vision-language or conditional-generation model) whose base_model is the model itself "
            f"(base_model_prefix {model.base_model_prefix!r} names none of them), so the pipeline cannot tell its "
            f"text model from its other parts; "
            + (
                f"train the text model alone as {text} (AutoModelForCausalLM from the same config or checkpoint)"
                if text
                else "train it at pp_size=1"
            )
        )
    if "loss_function" not in _source(type(model).forward):
        raise NotImplementedError(
            f"pp_size > 1 on {name}: its forward computes the loss itself, not through transformers' loss_function, "
            f"so a micro-batch's loss could not be normalised over the whole batch's label tokens"
        )
    decoder = _decoder(model)
    base_path = next(path for path, module in model.named_modules() if module is decoder)
    children = dict(decoder.named_children())
    lists = [n for n, m in children.items() if isinstance(m, nn.ModuleList)]
    if len(lists) != 1:
        raise NotImplementedError(
            f"pp_size > 1 on {name}: its decoder model {type(decoder).__name__} does not hold one list of decoder "
            f"layers (found {lists})"
        )
    return Cut(base_path, lists[0], bounds(len(children[lists[0]]), stages, split_points))


def base_of(model: nn.Module) -> nn.Module | None:
    """The model's base model: transformers' `base_model` (its decoder model, or a composite model's vision and text
    parts). Where `base_model_prefix` names none of the model's children (Llama4ForCausalLM and MllamaForCausalLM say
    "language_model" and hold their decoder model as `.model`), `base_model` is the model itself: the base model is
    then its one child holding the input embedding, if the model holds nothing else but its head; else None."""
    base = model.base_model
    if base is not model:
        return base
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    others = [c for c in model.children() if c is not head]
    holds = len(others) == 1 and any(m is embedding for m in others[0].modules())
    return others[0] if holds else None


def _causal_lm_class(model: nn.Module) -> str | None:
    """The name of the text-only causal-LM class transformers maps the model's type to, if not the model's own."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(model.config, "model_type", ""))
    return name if isinstance(name, str) and name != type(model).__name__ else None


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder model: the base model, or in a composite model (a VLM: vision tower, projector, text model) the
    module holding the input embedding beside one list of layers (its text model)."""
    base, embedding = base_of(model), model.get_input_embeddings()
    assert base is not None  # `find_cut` refused the model otherwise
    if sum(isinstance(m, nn.ModuleList) for m in base.children()) == 1:
        return base
    found = [
        m
        for m in base.modules()
        if any(c is embedding for c in m.children()) and sum(isinstance(c, nn.ModuleList) for c in m.children()) == 1
    ]
    return found[0] if len(found) == 1 else base


def _source(function: object) -> str:
    """A function's source, or "" where Python has none (then the loss is not known to be transformers')."""
    try:
        return inspect.getsource(function)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def bounds(layers: int, stages: int, split_points: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Each stage's first layer, then `layers`. Balanced by a cost model in which the embedding and the head each
    count as one layer (torchtitan's weighting), so the first and last stages take one layer fewer; or the user's
    `split_points` (the first layer of every stage but the first)."""
    if layers < stages:
        raise ValueError(f"pp stages={stages} need at least one decoder layer each; the model has {layers}")
    if split_points is None:
        units = layers + 2
        split_points = tuple(
            min(max(math.floor(s * units / stages + 0.5) - 1, s), layers - stages + s) for s in range(1, stages)
        )
    points = (0, *split_points, layers)
    if len(split_points) != stages - 1 or any(b <= a for a, b in zip(points, points[1:])):
        raise ValueError(
            f"pp_split_points={split_points}: give {stages - 1} increasing layer indices between 1 and {layers - 1} "
            f"(the first layer of every stage but the first)"
        )
    return points


def skip_others(model: nn.Module, cut: Cut, stages: list[int]) -> None:
    """Keep only the layers of this rank's `stages`; the others pass the hidden states through."""
    layers = model.get_submodule(cut.base).get_submodule(cut.layers)
    kept = {i for s in stages for i in cut.layer_range(s)}
    for i in range(len(layers)):
        if i not in kept:
            layers[i] = Skipped(layers[i])


def before_layers(decoder: nn.Module, layers: str) -> list[str]:
    """The decoder model's children that run before its layers: those registered before its layer list (the
    embeddings), less those its forward's source first names after the layers (OPT registers its final_layer_norm and
    project_out before its layers and runs them after). A child its forward never names keeps its registration's
    place; the chain check (`autotp.pp.chain`) then tells a wrong guess, where a stage would use what another holds."""
    children = list(dict(decoder.named_children()))
    source = _source(type(decoder).forward)
    loop = re.search(rf"self\.{re.escape(layers)}\b", source)
    if loop is None:
        return children[: children.index(layers)]
    first = {c: re.search(rf"self\.{re.escape(c)}\b", source) for c in children}
    return [c for c in children[: children.index(layers)] if (m := first[c]) is None or m.start() < loop.start()]


def after_layers(decoder: nn.Module, layers: str) -> list[str]:
    """The decoder model's children with parameters that run after its layers (the final norm): those its forward's
    source first names after the layers, or, where it names them nowhere, registered after them (as `before_layers`
    reads the order; Phi-4-multimodal registers its image embedding after its layers and runs it before)."""
    order = list(dict(decoder.named_children()))
    source = _source(type(decoder).forward)
    loop = re.search(rf"self\.{re.escape(layers)}\b", source)

    def after(child: str) -> bool:
        named = re.search(rf"self\.{re.escape(child)}\b", source)
        if named is None or loop is None:
            return order.index(child) > order.index(layers)
        return named.start() > loop.start()

    children = decoder.named_children()
    return [c for c, m in children if c != layers and next(m.parameters(), None) is not None and after(c)]


def owner(model: nn.Module, cut: Cut) -> Callable[[str], int]:
    """Which stage trains (and saves) each parameter or buffer, by its name: a decoder layer's its stage; the decoder
    model's children that run before its layers (`before_layers`: the embeddings), the input embedding, and in a
    composite model what its base model holds beside the decoder model (a VLM's vision tower and projector) the first
    stage; the rest (the final norm, the head outside the decoder model) the last. A tied head is the embedding's one
    weight."""
    base = model.get_submodule(cut.base)
    prefix = f"{cut.base}." if cut.base else ""
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    first = tuple(f"{prefix}{c}." for c in before_layers(base, cut.layers)) + (f"{embedding}.",)
    outer = next(f"{n}." for n, m in model.named_modules() if m is base_of(model))
    root = f"{prefix}{cut.layers}."

    def stage(name: str) -> int:
        if name.startswith(root):
            return cut.stage_of(int(name[len(root) :].split(".", 1)[0]))
        beside = outer != prefix and name.startswith(outer) and not name.startswith(prefix)  # a VLM's vision tower
        return 0 if name.startswith(first) or beside else cut.stages - 1

    return stage


def trainers(model: nn.Module, cut: Cut) -> dict[int, set[int]]:
    """The stages that train each parameter, by its id: the owners of all its names (`owner`), so a tied weight's are
    the first and the last stage."""
    stage = owner(model, cut)
    found: dict[int, set[int]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), set()).add(stage(name))
    return found


def stage_view(model: nn.Module, cut: Cut, stage: int) -> dict[str, nn.Module]:
    """What `swapped` puts in the decoder model for one stage: a list holding its layers only."""
    layers = model.get_submodule(cut.base).get_submodule(cut.layers)
    mine = cut.layer_range(stage)
    return {cut.layers: nn.ModuleList(layer if i in mine else Skipped(layer) for i, layer in enumerate(layers))}


@contextmanager
def swapped(module: nn.Module, children: dict[str, nn.Module]) -> Iterator[None]:
    """`module`'s named children replaced for the duration (a stage's view of the shared decoder model)."""
    saved = {name: module.get_submodule(name) for name in children}
    try:
        for name, child in children.items():
            setattr(module, name, child)
        yield
    finally:
        for name, child in saved.items():
            setattr(module, name, child)
