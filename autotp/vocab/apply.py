"""The vocabulary step of `autotp.parallelize`: the LM head and embedding split by vocabulary, the loss sharded.

It runs after tensor parallelism (the head is a column layer with its own block entry) and before context
parallelism, which wraps the sharded loss.
"""

from __future__ import annotations

from torch import nn

from ..mesh import Group
from ..planning.plan import Plan, VocabPlan
from ..runtime.process_hooks import patch_attribute
from ..state import TPState
from ..tp.block_entry import BlockEntry
from ..tp.layers import LinearLayer
from .chunked import chunk_head, chunk_replicated_head
from .layers import LogitsGate, VocabParallelEmbedding, VocabParallelLoss


def apply_vocab(model: nn.Module, vocab: VocabPlan, tp_group: Group, state: TPState) -> None:
    """Split the LM head and the embedding by vocabulary; shard the loss; gather logits on demand.

    The hooks it adds to the model are kept in `state.vocab_hooks`, so a vocabulary resize can undo
    them and apply the new vocabulary's split.
    """
    head_parent, _, head_name = vocab.head.rpartition(".")
    parent = model.get_submodule(head_parent)
    entry = BlockEntry(tp_group, overlap=state.options.overlap)  # the head is the only reader of its input
    head = LinearLayer(getattr(parent, head_name), vocab.partition, tp_group, entry)
    setattr(parent, head_name, head)
    state.vocab_hooks.append(head.register_forward_hook(head.entry.clear, always_call=True))
    if vocab.embedding is not None:
        embedding = model.get_submodule(vocab.embedding)
        state.regions.append(VocabParallelEmbedding(embedding, vocab.partition, tp_group, state))
        if vocab.tied:  # one shard serves both, as one parameter served both
            head.weight = embedding.weight
    loss = VocabParallelLoss(vocab.partition, tp_group, state.full_loss)
    patch_attribute(model, "loss_function", loss)
    gate = LogitsGate(vocab.partition, tp_group, state, loss)
    chunked = chunk_head(model, head, tp_group, state)
    if chunked is not None:
        loss.chunked = chunked.loss_sum
    state.vocab_hooks += [
        model.register_forward_pre_hook(gate.before, with_kwargs=True),
        model.register_forward_hook(state.sharded_only(gate.after), with_kwargs=True),
        head.register_forward_hook(state.sharded_only(gate.head_after)),
    ]


def vocab_parallel(model: nn.Module, plan: Plan, state: TPState) -> None:
    """The `autotp.parallelize` step: the model's own loss is kept (the sharded loss falls back to it), then the split;
    without it (tp 1, or vocab parallelism off) the replicated head's loss over chunks where it applies."""
    if plan.vocab is None:
        chunk_replicated_head(model, state)
        return
    state.full_loss = model.loss_function
    apply_vocab(model, plan.vocab, state.tp_group, state)
