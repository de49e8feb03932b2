"""TRL's fused LM head (`add_fused_lm_head`) made vocab-parallel: per-token log-probabilities for GRPO, RLOO, DPO, KTO.

TRL's trainers patch the model's forward so that `model(..., labels=, fused_lm_head=True)` returns per-token
log-probabilities (and entropy, ...) without the batch x seq x vocab logits, reading `lm_head.weight` whole. Under
vocab parallelism each TP rank holds only its vocabulary rows, so autotp puts its own fused forward in place of
TRL's, with the same settings (read from TRL's closure): the backbone runs as TRL's does, the sharded LM head
projects only the scored positions, and `autotp.vocab.logprobs` gives the whole-vocabulary values from the shards.
"""

from __future__ import annotations

import functools
import inspect
import types
from contextlib import nullcontext
from typing import Any, Callable, Mapping

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..mesh import Group, group_rank
from ..runtime.collectives import copy_to_tp
from ..state import TPState
from ..tp.layers import LinearLayer
from ..vocab.logprobs import vocab_parallel_log_probs

# the free variables of TRL 1.16's `_fused_forward`, which carry its settings
SETTINGS = (
    "original_forward",
    "backbone_attr",
    "temperature",
    "outputs",
    "final_logit_softcapping",
    "logit_scale",
    "cast_lm_head_to_fp32",
    "text_config",
)


def make_vocab_parallel(model: nn.Module, state: TPState, fused: Callable, trainer: str) -> None:
    """Replace TRL's fused forward on `model` by the vocab-parallel one, with TRL's settings; refuse what it cannot
    express (another TRL's fused head, sequence or context parallelism, MoE router losses)."""
    function = getattr(fused, "__func__", fused)
    settings = inspect.getclosurevars(function).nonlocals
    missing = [name for name in SETTINGS if name not in settings]
    why = None
    if missing:
        why = f"its fused head lacks the settings autotp reads ({', '.join(missing)}): another TRL version"
    elif state.splits_sequence():
        why = "its fused head under sequence or context parallelism is not supported yet"
    if why is not None:
        raise ValueError(
            f"autotp: {trainer} replaced the model's forward with a fused LM head, which reads "
            f"lm_head.weight directly, where vocab parallelism holds only this rank's vocabulary rows; "
            f"{why}. Wrap with vocab_parallel=False"
        )
    model.forward = types.MethodType(_fused_forward(state, settings), model)


def _fused_forward(state: TPState, settings: Mapping[str, Any]) -> Callable:
    """TRL's fused forward (`trl.trainer.utils.add_fused_lm_head`) on vocab-sharded logits, one shard at a time."""
    from trl.trainer.utils import FusedCausalLMOutput

    original, outputs = settings["original_forward"], tuple(settings["outputs"])
    temperature, softcap, scale = settings["temperature"], settings["final_logit_softcapping"], settings["logit_scale"]
    vocab, chunk = state.plan.vocab, state.options.loss_chunk
    assert vocab is not None  # always: the only caller (`autotp.integrations.trl`) makes it vocab-parallel only then
    partition = vocab.partition
    ((start, _),) = partition.runs[group_rank(state.tp_group)]
    cast, text_config = settings["cast_lm_head_to_fp32"], settings["text_config"]

    def project(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary rows of the logits of `hidden`, through the head's own forward."""
        state.forwards += 1  # inside the model's forward the head keeps its logits sharded (PEFT skips hooks)
        try:
            return head(hidden)
        finally:
            state.forwards -= 1

    def score(project: Callable, hidden: torch.Tensor, target: torch.Tensor) -> tuple:
        """Per-token values of `hidden`'s rows from this rank's vocabulary rows, as TRL's head transforms them."""
        with torch.autocast(hidden.device.type, enabled=False) if cast else nullcontext():
            logits = project(hidden.float() if cast else hidden).float() * scale
            if softcap is not None:
                logits = softcap * torch.tanh(logits / softcap)
            if temperature != 1.0:
                logits = logits / temperature
            return vocab_parallel_log_probs(logits, target, start, partition.full_size, state.tp_group, outputs)

    @functools.wraps(getattr(original, "__func__", original))  # `generate` checks its keywords against the signature
    def forward(
        self, *args, fused_lm_head: bool = False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        if not fused_lm_head:
            passed = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return original(*args, **kwargs, **{k: v for k, v in passed.items() if v is not None})
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):  # MoE: the router logits, as the model's forward
            kwargs.setdefault("output_router_logits", True)
        backbone = getattr(self, settings["backbone_attr"])(*args, **kwargs)
        hidden = backbone.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        labels = labels.to(hidden.device)
        mask = labels != -100
        scored = hidden[mask]  # the same count on every TP rank: they read the same batch
        head = self.get_output_embeddings()
        if chunk and scored.shape[0] > chunk and _chunkable(head):
            per_token = _chunked(score, head, scored, labels[mask], chunk, state.tp_group)
        else:
            per_token = score(functools.partial(project, head), scored, labels[mask])
        # masked_scatter keeps an all-masked micro-batch connected to the model, as TRL's does
        first, *statistics = per_token  # the log-probs, always computed; the statistics not asked for are None
        log_probs = first.new_zeros(mask.shape).masked_scatter(mask, first)
        entropy, log_sum_sq, mean, top1 = (
            None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in statistics
        )
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss, aux = -log_probs.sum() / count, None
        if kwargs.get("output_router_logits"):  # the routers are whole on every rank: TRL's load-balancing loss
            aux = router_loss(backbone.router_logits, text_config, kwargs.get("attention_mask"))
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux
        return FusedCausalLMOutput(
            loss=loss,
            log_probs=log_probs,
            entropy=entropy,
            log_sum_sq_probs=log_sum_sq,
            mean_logits=mean,
            is_top1=top1,
            label_mask=mask,
            aux_loss=aux,
        )

    return forward


def router_loss(router_logits: Any, config: Any, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mixtral's load-balancing loss, the one TRL's fused head adds for every MoE family, on the routers' logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    return load_balancing_loss_func(router_logits, config.num_experts, config.num_experts_per_tok, attention_mask)


def _chunkable(head: nn.Module) -> bool:
    """Whether the head's projection can be recomputed chunk by chunk as it ran: autotp's plain vocab-parallel
    column layer (not float8, whose tensorwise scale is the whole batch's; not LoRA's wrapper; not under SP)."""
    return isinstance(head, LinearLayer) and head.float8 is None and not head.sequence_parallel


def _chunked(
    score: Callable, head: LinearLayer, hidden: torch.Tensor, target: torch.Tensor, chunk: int, group: Group
) -> tuple:
    """`score` over chunks of `chunk` scored tokens (the `loss_chunk` option), each chunk's logits recomputed in the
    backward (activation checkpointing) rather than kept: autograd holds the hidden states and one chunk's logits at
    a time. The projection is the head's local matmul after one entry into TP for all chunks (the hidden states'
    gradient all-reduced once): the head's forward defers its weight gradient to its block, which a recompute would
    not repeat alike. Every TP rank scores the same tokens, so the chunks' collectives match."""
    project = functools.partial(_local_logits, head)
    entered = copy_to_tp(hidden, group)
    parts = [
        checkpoint(score, project, h, t, use_reentrant=False) for h, t in zip(entered.split(chunk), target.split(chunk))
    ]
    return tuple(None if values[0] is None else torch.cat(values) for values in zip(*parts))


def _local_logits(head: LinearLayer, hidden: torch.Tensor) -> torch.Tensor:
    return head.local_linear(hidden, head.bias)
