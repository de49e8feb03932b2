"""The parameters a stage does not own, released: each rank holds its stages' layers, the embedding on the first
stage and the final norm and head on the last (`autotp.pp.cut.owner` says which stage owns each parameter).

Every stage runs the decoder model's own forward from the start (`autotp.pp.schedule.StageModule`), so a stage after
the first still calls the embeddings: there they become `ShapeOnly`, which yields zeros of the embedding's shape and
dtype without its weight (the hidden states are replaced at the stage's first layer). The final norm and the head,
which a stage before the last never reaches, become `Released`. A tied head keeps its weight on the last stage: it is
the embedding's, owned by the first and the last stage alike.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

from .cut import Cut, base_of, before_layers, trainers


class Released(nn.Module):
    """A module another stage owns and this stage never runs (the final norm or the head before the last stage). Its
    parameters stay readable as meta tensors (plain attributes: shape and dtype, no storage), one per tied weight,
    so `get_output_embeddings().weight is get_input_embeddings().weight` still tells a tied head."""

    def __init__(self, module: nn.Module, path: str, metas: dict[int, torch.Tensor]):
        super().__init__()
        self.path = path
        for name, param in module.named_parameters(recurse=False):
            meta = metas.setdefault(id(param), torch.empty(param.shape, dtype=param.dtype, device="meta"))
            object.__setattr__(self, name, meta)

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError(f"{self.path} belongs to another pipeline stage; this stage released it and cannot run it")


class ShapeOnly(Released):
    """An embedding another stage owns, which this stage runs: zeros of its output's shape and dtype (the stage's
    first layer replaces the hidden states), on the ids' device, or the released weight's where a decoder model moved
    the ids to this stand-in's meta weight first (Llama-4's `input_ids.to(self.embed_tokens.weight.device)`)."""

    weight: torch.Tensor

    def __init__(self, module: nn.Module, path: str, metas: dict[int, torch.Tensor]):
        super().__init__(module, path, metas)
        self.device = module.weight.device

    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        ids = args[0]
        assert isinstance(ids, torch.Tensor)  # an embedding's input: the token ids
        device = self.device if ids.device.type == "meta" else ids.device
        return torch.zeros(*ids.shape, self.weight.shape[-1], dtype=self.weight.dtype, device=device)


def unowned(model: nn.Module, cut: Cut, stages: list[int]) -> dict[str, nn.Module]:
    """The modules outside the decoder layers whose parameters none of `stages` owns, by path, each with what
    replaces it: an embedding before the layers (this stage runs it) `ShapeOnly`, a module after them `Released`
    (not on the last stage, which runs them all), and in a composite model what the base model holds beside the
    decoder model (a VLM's vision tower and projector, which only the first stage is given inputs for) `Released`.
    A module holding a parameter one of `stages` owns (a tied head's weight) stays, as does any other module before
    the layers (its output would be this stage's to compute)."""
    base = model.get_submodule(cut.base)
    root = f"{cut.base}.{cut.layers}" if cut.base else cut.layers
    mine = {p for p, trained in trainers(model, cut).items() if trained.intersection(stages)}
    before = {f"{cut.base}.{c}" if cut.base else c for c in before_layers(base, cut.layers)}
    outer = next(n for n, m in model.named_modules() if m is base_of(model))
    replaced: dict[str, nn.Module] = {}
    metas: dict[int, torch.Tensor] = {}
    for path, module in model.named_modules():
        held = list(module.parameters())
        if not held or path == root or path.startswith(f"{root}.") or any(id(p) in mine for p in held):
            continue
        decoder = f"{cut.base}.".startswith(f"{path}.") or path.startswith(f"{cut.base}.")  # it, in it, around it
        if path.startswith(f"{outer}.") and not decoder:  # beside the decoder model: a VLM's vision tower
            replaced[path] = Released(module, path, metas)
        elif not list(module.parameters(recurse=False)):
            continue
        elif any(path == b or path.startswith(f"{b}.") for b in before):
            if isinstance(module, nn.Embedding):
                replaced[path] = ShapeOnly(module, path, metas)
        elif cut.stages - 1 not in stages:
            replaced[path] = Released(module, path, metas)
    return {p: m for p, m in replaced.items() if not any(p.startswith(f"{q}.") for q in replaced if q != p)}


def release(model: nn.Module, modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """Put `unowned`'s replacements in their slots (the released modules' parameters are freed with them); returns
    what they replaced, by path."""
    replaced = {}
    for path, module in modules.items():
        parent, _, name = path.rpartition(".")
        replaced[path] = model.get_submodule(path)
        setattr(model.get_submodule(parent), name, module)
    return replaced


@contextmanager
def released(model: nn.Module, modules: dict[str, nn.Module]) -> Iterator[None]:
    """`release` for the duration (one stage's view of a whole model, as `autotp.pp.chain` runs it)."""
    replaced = release(model, modules)
    try:
        yield
    finally:
        release(model, replaced)
