"""vLLM's own tensor-parallel rows, where they differ from `autotp.wrap(model, N)`'s (`EngineLayout.vllm(N)`).

Why: an engine rank that takes pre-cut rows must get the rows its own loader would cut. vLLM's
`VocabParallelEmbedding` and `ParallelLMHead` pad the vocabulary to a multiple of 64 and give each rank an equal
block of the padded rows (vocab 250 at tp 4: rows 0-63, 64-127, 128-191 and 192-249, the last rank's 6 padding rows
its own zeros), where `wrap` splits the real rows evenly (63/63/62/62). vLLM also reorders the per-head interleaved
fused q/k/v of Bloom, GPT-NeoX and Falcon into q|k|v before cutting; those rows are not produced here, so those
models are refused by name. Every other sharded tensor gets `wrap`'s rows, which are vLLM's where its sizes divide
evenly (heads, KV heads replicated when fewer than ranks, MLP rows).
"""

from __future__ import annotations

from torch import nn

from ...planning.plan import Plan
from ...planning.sharding import Partition

PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
INTERLEAVED_QKV = {"bloom": "Bloom", "gpt_neox": "GPT-NeoX", "falcon": "Falcon"}


def vocab_partition(vocab: int, tp_size: int) -> Partition:
    """vLLM's vocabulary rows per rank: the padded vocabulary cut in equal blocks, each clipped to the real rows."""
    padded = -(-vocab // PADDING) * PADDING
    if padded % tp_size:
        raise ValueError(
            f"autotp: EngineLayout.vllm({tp_size}): vLLM splits the {padded} padded vocabulary rows "
            f"evenly over its ranks, which {tp_size} does not divide"
        )
    block = padded // tp_size
    runs = tuple(((min(r * block, vocab), max(0, min((r + 1) * block, vocab) - r * block)),) for r in range(tp_size))
    return Partition(0, vocab, runs)


def vllm_partitions(model: nn.Module, plan: Plan, partitions: dict[str, Partition]) -> dict[str, Partition]:
    """`wrap`'s partitions (`plan.sharded_params`) with vLLM's vocabulary rows; refuse what vLLM cuts otherwise."""
    model_type = getattr(model.config, "model_type", None)
    if model_type in INTERLEAVED_QKV:
        raise NotImplementedError(
            f"autotp: EngineLayout.vllm: vLLM reorders {INTERLEAVED_QKV[model_type]}'s per-head interleaved fused "
            f"q/k/v into q|k|v before cutting its ranks' rows, which autotp does not produce; send full tensors "
            f"(target=None, what vLLM's load_weights takes) instead"
        )
    if plan.vocab is None:
        raise NotImplementedError(
            f"autotp: EngineLayout.vllm: vLLM splits the vocabulary over its ranks, and autotp's plan for "
            f"{type(model).__name__} keeps the LM head whole; send full tensors (target=None) instead"
        )
    rows = vocab_partition(plan.vocab.partition.full_size, plan.tp_size)
    out = dict(partitions)
    for name in (
        f"{plan.vocab.head}.weight",
        f"{plan.vocab.head}.bias",
        *([f"{plan.vocab.embedding}.weight"] if plan.vocab.embedding is not None else []),
    ):
        if name in out:
            out[name] = rows.with_dim(out[name].dim)
    return out
