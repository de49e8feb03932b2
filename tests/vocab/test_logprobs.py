"""Vocab-parallel per-token log-probabilities (autotp.vocab.logprobs): values and gradients equal one process's
`log_softmax(logits).gather(target)` and entropy, on an uneven split (250 rows at tp=2 and tp=3), with a target tied
with an earlier maximum (is_top1 false) and a row whose maximum another rank holds.

Tolerances: fp32, only the order of the sums over the vocabulary differs (1e-5 on values of order 5, 1e-6 on
gradients of order 1e-2).
"""

from __future__ import annotations

import pytest
import torch

from autotp.planning.sharding import Partition
from autotp.testing.spawn import run_ranks
from autotp.vocab.logprobs import STATISTICS, vocab_parallel_log_probs

VOCAB = 250


def one_process(logits: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """The statistics as one process computes them from the whole logits (TRL's definitions)."""
    log_p = logits.log_softmax(-1)
    return {
        "log_probs": log_p.gather(-1, target.unsqueeze(-1)).squeeze(-1),
        "entropy": -(log_p.exp() * log_p).sum(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * log_p, -1),
        "mean_logits": logits.mean(-1),
        "is_top1": logits.argmax(-1) == target,
    }


def inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(12, VOCAB, generator=generator) * 3
    target = torch.randint(0, VOCAB, (12,), generator=generator)
    logits[0, 5] = logits[0].max() + 1  # row 0: the target (200) ties with an earlier maximum: not top-1
    target[0], logits[0, 200] = 200, logits[0, 5]
    target[1] = 3  # row 1: the target is the maximum, on rank 0, and the highest logits elsewhere on rank 1
    logits[1, 3] = logits[1].max() + 2
    weights = torch.randn(12, generator=generator), torch.randn(12, generator=generator)  # d loss / d (log p, entropy)
    return logits, target, *weights


def sharded(rank: int, world: int) -> dict:
    logits, target, w_logp, w_entropy = inputs()
    partition = Partition.even(1, VOCAB, world)
    ((start, count),) = partition.runs[rank]
    mine = logits[:, start : start + count].clone().requires_grad_()
    group = torch.distributed.group.WORLD
    out = dict(
        zip(
            ("log_probs", *STATISTICS),
            vocab_parallel_log_probs(mine, target, start, VOCAB, group, ("log_probs", *STATISTICS)),
        )
    )
    ((out["log_probs"] * w_logp).sum() + (out["entropy"] * w_entropy).sum()).backward()
    return {"values": {k: v.detach() for k, v in out.items()}, "grad": mine.grad, "start": start, "count": count}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, 3])
def test_per_token_log_probs_and_their_gradients_are_one_processs(tp: int) -> None:
    logits, target, w_logp, w_entropy = inputs()
    reference = logits.clone().requires_grad_()
    expected = one_process(reference, target)
    ((expected["log_probs"] * w_logp).sum() + (expected["entropy"] * w_entropy).sum()).backward()
    assert not expected["is_top1"][0] and expected["is_top1"][1]
    for rank in run_ranks(sharded, tp):
        for name, value in rank["values"].items():
            if name == "is_top1":
                assert torch.equal(value, expected[name])
            else:
                torch.testing.assert_close(value, expected[name].detach(), atol=1e-5, rtol=0, msg=name)
        grad = reference.grad[:, rank["start"] : rank["start"] + rank["count"]]
        torch.testing.assert_close(rank["grad"], grad, atol=1e-6, rtol=0)


@pytest.mark.timeout(60)
def test_an_entropy_read_for_logging_only_leaves_the_log_prob_gradient_alone() -> None:
    """One rank (a group of one): the gradient of log p alone is `onehot - softmax`, the entropy given none."""
    logits, target, _, _ = inputs()
    mine = logits.clone().requires_grad_()
    log_probs, entropy, *_ = vocab_parallel_log_probs(mine, target, 0, VOCAB, None, ("entropy",))
    log_probs.sum().backward()
    expected = torch.nn.functional.one_hot(target, VOCAB) - logits.softmax(-1)
    torch.testing.assert_close(mine.grad, expected, atol=1e-6, rtol=0)
    assert entropy is not None and entropy.requires_grad
