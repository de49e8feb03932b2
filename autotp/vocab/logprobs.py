"""Per-token log-probabilities (and entropy) of the next-token labels from vocab-sharded logits.

RL losses (GRPO, RLOO, DPO, KTO) need `log_softmax(logits).gather(target)` per token, not a summed loss. Each TP rank
holds its vocabulary rows' logits; one MAX all-reduce (the row maximum, and for `is_top1` the maximum before the
target) and one SUM all-reduce (the sum of exponentials, the target's logit from the rank holding it, and the
optional statistics) give every rank the whole-vocabulary values, so the full batch x vocabulary logits are never
gathered. The backward is local: the LM head's column entry sums the hidden-state gradient over TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..mesh import group_size
from ..runtime.collectives import all_reduce
from ..runtime.second_order import refuse_second_order

STATISTICS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")  # TRL's FusedCausalLMOutput fields


class _VocabParallelLogProbs(torch.autograd.Function):
    """log p(target) and entropy over the whole vocabulary from a vocab shard: MAX then SUM all-reduces forward,
    local backward."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        start: int,
        full_vocab: int,
        group: dist.ProcessGroup,
        outputs: tuple[str, ...],
    ):
        ctx.set_materialize_grads(False)  # an entropy read for logging only gets no gradient
        z = logits.float()
        rows, width = z.shape
        local = target - start
        mine = (local >= 0) & (local < width)
        at = local.clamp(0, width - 1).unsqueeze(-1)
        picked = torch.where(mine, z.gather(-1, at).squeeze(-1), torch.zeros((), dtype=z.dtype, device=z.device))
        maxes = [z.amax(-1)]
        if "is_top1" in outputs:  # argmax takes the first maximum: a tie with an earlier token is not top-1
            before = torch.arange(width, device=z.device) < local.unsqueeze(-1)
            maxes.append(z.masked_fill(~before, float("-inf")).amax(-1))
        top = torch.stack(maxes)
        if group_size(group) > 1:
            all_reduce(top, group, dist.ReduceOp.MAX)
        exp = torch.exp(z - top[0].unsqueeze(-1))
        sums = [exp.sum(-1), picked]
        if "entropy" in outputs:
            sums.append((exp * z).sum(-1))
        if "log_sum_sq_probs" in outputs:
            sums.append(exp.square().sum(-1))
        if "mean_logits" in outputs:
            sums.append(z.sum(-1))
        del exp
        sums = torch.stack(sums)
        if group_size(group) > 1:
            all_reduce(sums, group)
        total, target_logit, *rest = sums
        log_z = top[0] + total.log()
        log_probs = target_logit - log_z
        entropy = log_z - rest.pop(0) / total if "entropy" in outputs else None
        log_sum_sq = rest.pop(0).log() - 2 * total.log() if "log_sum_sq_probs" in outputs else None
        mean = rest.pop(0) / full_vocab if "mean_logits" in outputs else None
        top1 = (target_logit >= top[0]) & (target_logit > top[1]) if "is_top1" in outputs else None
        ctx.save_for_backward(z, local, mine, log_z, log_z if entropy is None else entropy)
        ctx.dtype = logits.dtype
        ctx.mark_non_differentiable(*(x for x in (log_sum_sq, mean, top1) if x is not None))
        return log_probs, entropy, log_sum_sq, mean, top1

    @staticmethod
    def backward(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None, *_):
        refuse_second_order(
            "the vocab-parallel log-probabilities, whose backward reads values saved without a graph",
            "wrap with tp_size=1 for them",
        )
        z, local, mine, log_z, entropy = ctx.saved_tensors
        log_p = z - log_z.unsqueeze(-1)
        p = log_p.exp()
        grad = torch.zeros_like(z)
        if grad_log_probs is not None:  # d log p_t / dz_j = 1[j = t] - p_j
            grad -= grad_log_probs.float().unsqueeze(-1) * p
            grad.scatter_add_(
                -1, local.clamp(0, z.shape[-1] - 1).unsqueeze(-1), (grad_log_probs.float() * mine).unsqueeze(-1)
            )
        if grad_entropy is not None:  # d H / dz_j = -p_j (log p_j + H)
            grad -= grad_entropy.float().unsqueeze(-1) * p * (log_p + entropy.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None, None


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    full_vocab: int,
    group: dist.ProcessGroup,
    outputs: tuple[str, ...] = (),
) -> tuple:
    """`(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)` of `target` ([N]) under this rank's logit
    shard ([N, vocab rows from `start`]); the statistics not named in `outputs` are None. Collective over `group`."""
    unknown = set(outputs) - set(STATISTICS) - {"log_probs"}
    if unknown:
        raise ValueError(f"autotp: unknown per-token statistics {sorted(unknown)}; known: {STATISTICS}")
    return _VocabParallelLogProbs.apply(logits, target, start, full_vocab, group, tuple(outputs))
