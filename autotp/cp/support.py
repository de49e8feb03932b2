"""What context parallelism can run with parity: the refusals at wrap time (the model's attention, layers, loss)
and before each forward (the keywords a split forward cannot honour), each naming what to change."""

from __future__ import annotations

import sys

from torch import nn

from ..compat.hf import attn_implementation
from .attention import is_varlen

_SUPPORTED = ("sdpa", "eager")


def refuse_unsupported(model: nn.Module, cp_size: int) -> str:
    """The model's attention implementation, or a refusal naming what context parallelism cannot do with parity."""
    config = model.config
    implementation = attn_implementation(config)
    if implementation is None or (implementation not in _SUPPORTED and not is_varlen(implementation)):
        raise NotImplementedError(
            f"cp_size={cp_size}: attention '{implementation}' is not supported under context "
            f"parallelism; load the model with attn_implementation='sdpa', 'eager' or a "
            f"flash-attention one"
        )
    kinds = set(getattr(config, "layer_types", None) or [])
    if kinds - {"full_attention"}:
        raise NotImplementedError(
            f"cp_size={cp_size}: layers of type {sorted(kinds - {'full_attention'})} "
            f"(sliding-window, chunked, Mamba or linear-attention mixers) are not supported "
            f"under context parallelism; only full attention is"
        )
    if not kinds and getattr(config, "sliding_window", None) is not None:
        raise NotImplementedError(
            f"cp_size={cp_size}: sliding-window attention (sliding_window="
            f"{config.sliding_window}) is not supported under context parallelism"
        )
    if getattr(config, "attention_chunk_size", None):
        raise NotImplementedError(f"cp_size={cp_size}: chunked attention is not supported under context parallelism")
    for key, value in config.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and "att" in key and isinstance(value, (int, float)) and value > 0:
            raise NotImplementedError(
                f"cp_size={cp_size}: {key}={value}: attention-probability dropout under context "
                f"parallelism (one process's masks cannot be matched without an [S, S] mask); "
                f"set it to 0 or use cp_size=1"
            )
    if getattr(model, "loss_type", None) not in (None, "ForCausalLM") or getattr(config, "vision_config", None):
        raise NotImplementedError(
            f"cp_size={cp_size}: {type(model).__name__} is not a text-only causal LM; context "
            f"parallelism splits a causal LM's sequence and computes its next-token loss"
        )
    modules = attention_modules(model)
    if not modules:
        raise NotImplementedError(
            f"cp_size={cp_size}: no attention module of {type(model).__name__} calls "
            f"transformers' attention interface, which context parallelism goes through"
        )
    bidirectional = [type(m).__name__ for m in modules if getattr(m, "is_causal", True) is False]
    if bidirectional:
        raise NotImplementedError(
            f"cp_size={cp_size}: {bidirectional[0]} is not causal (an encoder or cross-"
            f"attention); context parallelism masks causally"
        )
    return implementation


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules calling transformers' attention interface (they define an eager function beside them)."""
    return [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx")
        and hasattr(m, "scaling")
        and callable(getattr(sys.modules.get(type(m).__module__), "eager_attention_forward", None))
    ]


def refuse_forward(module: nn.Module, kwargs: dict, drops: bool, pass_layout: bool) -> None:
    """Refuse, before a CP forward runs, what a split forward cannot give as one process does (`drops`: the model
    has dropout; `pass_layout`: its forward passes keyword arguments on to its attention)."""
    if module.training and getattr(module, "is_activation_checkpointing", False) and (drops or not pass_layout):
        raise NotImplementedError(
            "activation checkpointing under context parallelism with dropout (a layer "
            "recomputed in backward would draw other masks), or in a model whose forward "
            "does not pass keyword arguments on to its attention; turn one of them off"
        )
    if kwargs.get("output_attentions"):
        raise NotImplementedError(
            "output_attentions under context parallelism: each rank holds its queries' rows "
            "against every key, never the whole [S, S] probabilities; use cp_size=1"
        )
    mask = kwargs.get("attention_mask")
    if (
        (kwargs.get("output_router_logits") or getattr(module.config, "output_router_logits", False))
        and mask is not None
        and not bool(mask.all())
    ):
        raise NotImplementedError(
            "the MoE auxiliary loss (output_router_logits) with padding under context "
            "parallelism: transformers masks it with the attention mask, which CP does "
            "not pass on; pack without padding, or leave output_router_logits off"
        )
