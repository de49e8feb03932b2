"""`autotp.vocab.tokens.token_log_probs` on a wrapped tiny Llama: every next token's log-probability, and the
gradients through it, equal one process's `log_softmax(model(ids).logits).gather(next)`, at tp=2 with the vocabulary
split unevenly (250 rows) and with vocab parallelism off; the vocab-parallel path gathers no vocab-wide logits.

Tolerances as in autotp.testing.parity (fp32, only the order of the sums differs): LOSS_ATOL on log-probs of
order 5, GRAD_RTOL on gradients relative to their largest entry.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from autotp.vocab.tokens import token_log_probs
from models import batch, tiny_model

VOCAB = 250  # 125 rows a rank at tp=2; TEMPERATURE as a GRPO sampler's
TEMPERATURE = 0.7


def weighted(log_probs: torch.Tensor) -> torch.Tensor:
    """A loss on the per-token log-probs with a different weight per token, as an advantage gives."""
    weights = torch.linspace(-1, 1, log_probs.numel()).view(log_probs.shape)
    return (log_probs * weights).sum()


def tokens(rank: int, world: int, vocab_parallel: bool) -> dict:
    ids = batch(vocab=VOCAB)
    reference = tiny_model("llama", vocab_size=VOCAB)
    logits = reference(input_ids=ids).logits[:, :-1] / TEMPERATURE
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    weighted(expected).backward()
    model = autotp.wrap(tiny_model("llama", vocab_size=VOCAB), world, vocab_parallel=vocab_parallel)
    gathers = []  # all-gathers of vocab-wide tensors (the last dimension a rank's 125 vocabulary rows)
    real = dist.all_gather

    def counted(buffers, tensor, *args, **kwargs):
        gathers.extend([tuple(tensor.shape)] if tensor.shape[-1] == VOCAB // world else [])
        return real(buffers, tensor, *args, **kwargs)

    dist.all_gather = counted
    try:
        got = token_log_probs(model, ids, temperature=TEMPERATURE)
        weighted(got).backward()
    finally:
        dist.all_gather = real
    group = model.autotp_state.tp_group
    expected_grads = dict(reference.named_parameters())
    grad = max(
        parity.grad_error(parity.full_tensor(p.grad, p, group), expected_grads[n].grad)
        for n, p in model.named_parameters()
    )
    return {
        "error": (got - expected).abs().max().item(),
        "shape": list(got.shape),
        "grad": grad,
        "gathers": gathers,
        "head_rows": model.lm_head.weight.shape[0],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_token_log_probs_and_their_gradients_are_one_processs(vocab_parallel: bool) -> None:
    for report in run_ranks(tokens, 2, vocab_parallel):
        assert report["shape"] == list(batch(vocab=VOCAB)[:, 1:].shape)
        assert report["error"] <= parity.LOSS_ATOL, report["error"]
        assert report["grad"] <= parity.GRAD_RTOL, report["grad"]
        assert report["head_rows"] == (VOCAB // 2 if vocab_parallel else VOCAB)
        assert report["gathers"] == [], report["gathers"]  # the head's logits stay sharded
