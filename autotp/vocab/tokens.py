"""`token_log_probs`: each next token's log-probability under a wrapped causal LM, from the LM head's vocab shards.

Why: hand-written RL losses (GRPO, RLOO, DPO) need `log_softmax(logits).gather(next token)` per token. Under vocab
parallelism the model's logits are gathered to the whole vocabulary when read, batch x seq x vocab per rank; this
runs the backbone, keeps the head's logits sharded and takes the whole-vocabulary values from the shards
(`vocab.logprobs`: two small all-reduces). Without vocab parallelism it is the plain `log_softmax` on the logits.
"""

from __future__ import annotations

import torch
from torch import nn

from ..mesh import group_rank, group_size
from ..state import find_state
from .logprobs import vocab_parallel_log_probs


def token_log_probs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """log p(input_ids[:, t + 1] | input_ids[:, :t + 1]) as [batch, seq - 1], fp32, differentiable; logits divided
    by `temperature` first (as a sampler's). Collective over the TP group when the LM head is vocab-sharded: every
    TP rank calls it with the same batch."""
    state = find_state(model)
    vocab = None if state is None else state.plan.vocab
    target = input_ids[:, 1:]
    if state is None or vocab is None or group_size(state.tp_group) == 1:  # vocab is None without a state
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).squeeze(-1)
    if state.splits_sequence():
        raise NotImplementedError(
            "autotp: token_log_probs under sequence or context parallelism is not supported "
            "yet (the backbone's output is split by sequence there)"
        )
    ((start, _),) = vocab.partition.runs[group_rank(state.tp_group)]
    state.forwards += 1  # as inside the model's forward: the head keeps its logits sharded
    try:
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        logits = model.get_output_embeddings()(hidden.last_hidden_state[:, :-1])
    finally:
        state.forwards -= 1
    config = model.config.get_text_config()  # what the model's own forward applies to its logits
    logits = logits.float() * (getattr(config, "logit_scale", None) or 1.0)
    # Gemma 2's name for the tanh cap, and RecurrentGemma's
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(config, "logits_soft_cap", None)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    log_probs = vocab_parallel_log_probs(
        logits.flatten(0, 1), target.flatten(), start, vocab.partition.full_size, state.tp_group
    )[0]
    return log_probs.view(target.shape)
