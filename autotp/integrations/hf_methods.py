"""The Hugging Face model methods that must know about shards, bound onto every wrapped model.

A user calls `model.save_pretrained(dir)` and `model.resize_token_embeddings(n)` as on any HF
model. transformers' own versions read `weight.shape` and would write, or build from, this rank's
shard alone: a checkpoint that cannot be reloaded, or a vocabulary the ranks disagree on.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..io.hf.save import save_pretrained
from ..planning.planner import with_vocab
from ..runtime.process_hooks import patched
from ..runtime.replicas import broadcast_tensors
from ..runtime.shards import forget_shard
from ..state import TPState
from ..tp.layers import ParallelLinear
from ..vocab.apply import apply_vocab
from .guards import SwapGuard


class SavePretrained:
    """`model.save_pretrained(dir, ...)` on a wrapped model: the full checkpoint, as `autotp.save_pretrained`.

    Collective: call it on every rank (rank 0 writes). Inside `GatherReplacedLayerParams` the model
    holds full weights, and transformers' own method runs unchanged.
    """

    _REFUSED = {
        "state_dict": None,
        "safe_serialization": True,
        "variant": None,
        "save_function": None,
        "push_to_hub": False,
    }

    def __init__(self, model: nn.Module, state: TPState):
        self.model, self.state = model, state

    def __call__(
        self, save_directory: str | os.PathLike, *args: Any, max_shard_size: int | str = "5GB", **kwargs: Any
    ) -> None:
        if self.state.is_gathered():
            return type(self.model).save_pretrained(
                self.model, save_directory, *args, max_shard_size=max_shard_size, **kwargs
            )
        if args:
            raise TypeError("save_pretrained on a wrapped model takes the directory and keyword arguments only")
        for name, default in self._REFUSED.items():
            if name in kwargs and kwargs[name] != default:
                raise ValueError(
                    f"save_pretrained({name}={kwargs[name]!r}) is not supported on a model wrapped by autotp: it "
                    f"writes the full safetensors checkpoint gathered from every rank. Save without {name}, or "
                    f"inside autotp.GatherReplacedLayerParams(model) with transformers' own options"
                )
        save_pretrained(self.model, save_directory, max_shard_size=max_shard_size, into_existing=True)


class ResizeTokenEmbeddings:
    """`model.resize_token_embeddings(n)` on a wrapped model: resized as transformers does, then split again.

    The embedding and LM head are gathered, transformers resizes them (its own initialisation of the
    new rows, ties, config), TP rank 0's result is broadcast so the ranks agree even on random rows,
    and the new vocabulary is split again (vocab parallelism stays on where it was on).
    """

    def __init__(self, model: nn.Module, state: TPState):
        self.model, self.state = model, state

    def __call__(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        model, state = self.model, self.state
        resize = type(model).resize_token_embeddings
        if new_num_tokens is None and pad_to_multiple_of is None:
            return model.get_input_embeddings()
        if state.is_gathered():
            raise RuntimeError("resize_token_embeddings inside GatherReplacedLayerParams: call it outside the context")
        for dimension in state.dims.values():  # a pipeline's stages hold the embedding and the head apart
            dimension.refuse_resize()
        if state.fsdp:
            raise NotImplementedError(
                "resize_token_embeddings under autotp.fully_shard is not supported: FSDP keeps "
                "the embedding's parameters, which a resize replaces. Resize before fully_shard"
            )
        vocab = state.plan.vocab
        if vocab is None:  # embedding and head are replicated: resize, then agree on the new rows
            embedding = resize(model, new_num_tokens, pad_to_multiple_of, mean_resizing)
            broadcast_tensors(_vocab_tensors(model), state.tp_group)
            return embedding
        head = model.get_submodule(vocab.head)
        region = model.get_submodule(vocab.embedding).autotp_region if vocab.embedding else None
        for part in (head, region):
            if part is not None:
                part.gather_()
        if region is not None:
            region.release()
            state.regions.remove(region)
        for hook in state.vocab_hooks:
            hook.remove()
        state.vocab_hooks.clear()
        users = model.loss_function if model.loss_function is not patched(model, "loss_function") else None
        model.loss_function = state.full_loss
        embedding = resize(model, new_num_tokens, pad_to_multiple_of, mean_resizing)
        broadcast_tensors(_vocab_tensors(model), state.tp_group)
        _plain_head(model, vocab.head)
        for param in _vocab_tensors(model):  # a same-size resize keeps the gathered parameters
            forget_shard(param)
        layers = tuple(layer for layer in state.plan.layers if layer.path != vocab.head)
        # the logits' path was checked when the plan split the vocabulary (`autotp.planning.logits_path`)
        plan = with_vocab(model, replace(state.plan, layers=layers, vocab=None), lambda: "")
        if plan.vocab is None:
            raise RuntimeError(f"after resizing, vocab parallelism no longer applies: {plan.vocab_reason}")
        state.plan = plan
        apply_vocab(model, plan.vocab, state.tp_group, state)
        if users is not None:  # set after wrap: kept, and given whole logits (`autotp.vocab.layers.LogitsGate`)
            model.loss_function = users
        if state.swap_guards:  # the new head and embedding replace the ones the guards watched
            SwapGuard.refresh(model, state, [path for path in (plan.vocab.head, plan.vocab.embedding) if path])
        return model.get_input_embeddings()


def _vocab_tensors(model: nn.Module) -> list[torch.Tensor]:
    tensors = {
        id(p): p
        for m in (model.get_input_embeddings(), model.get_output_embeddings())
        if m is not None
        for p in m.parameters()
    }
    return list(tensors.values())


def _plain_head(model: nn.Module, path: str) -> None:
    """A gathered parallel LM head that transformers kept (same size, or tied) becomes a plain nn.Linear."""
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    head = getattr(parent, name)
    if isinstance(head, ParallelLinear):
        rows, cols = head.weight.shape  # transformers may have given it new rows in place (a tied head)
        plain = nn.Linear(cols, rows, bias=head.bias is not None, device="meta")
        plain.weight, plain.bias = head.weight, head.bias
        setattr(parent, name, plain)
