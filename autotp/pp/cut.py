"""The stage cut: which decoder layers each pipeline stage runs, found with no per-model code.

A causal LM is a decoder model holding one list of decoder layers, with a head. Each stage runs the model's own
forward (`autotp.pp.schedule.StageModule`), so whatever the decoder model computes around its layers (embeddings,
learned or rotary position embeddings, a scaling, the attention mask) is computed as one process computes it; the
layers of other stages pass the hidden states through (`Skipped`). This module finds the list and decides the cut.
"""

from __future__ import annotations

import inspect
import math
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
    base = model.base_model
    if base is model or model.get_output_embeddings() is None:
        raise NotImplementedError(f"pp_size > 1 on {name}: a pipeline needs a causal LM with its head (a loss)")
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


def _decoder(model: nn.Module) -> nn.Module:
    """The decoder model: the base model, or in a composite model (a VLM: vision tower, projector, text model) the
    module holding the input embedding beside one list of layers (its text model)."""
    base, embedding = model.base_model, model.get_input_embeddings()
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


def owner(model: nn.Module, cut: Cut) -> Callable[[str], int]:
    """Which stage trains (and saves) each parameter or buffer, by its name: a decoder layer's its stage; the decoder
    model's children registered before its layer list (the embeddings), the input embedding, and in a composite
    model what its base model holds beside the decoder model (a VLM's vision tower and projector) the first stage; the
    rest (the final norm, the head outside the decoder model) the last. A tied head is the embedding's one weight."""
    base = model.get_submodule(cut.base)
    prefix = f"{cut.base}." if cut.base else ""
    children = list(dict(base.named_children()))
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    first = tuple(f"{prefix}{c}." for c in children[: children.index(cut.layers)]) + (f"{embedding}.",)
    outer = next(f"{n}." for n, m in model.named_modules() if m is model.base_model)
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
