"""TRL's fused LM head under vocab parallelism runs over chunks of `loss_chunk` scored tokens: per-token log-probs,
entropy and every gradient equal one process's run with TRL's own fused head, while autograd keeps less than the
unchunked head keeps (each chunk's logits recomputed in the backward, not held).

Tolerances: fp32, the order of the sums over the vocabulary (TP) and over tokens differs: values 1e-5, gradients
`grad_error` <= GRAD_RTOL.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import autotp
from autotp.integrations.fused_head import make_vocab_parallel
from autotp.state import find_state
from autotp.testing import GRAD_RTOL, full_tensor, grad_error, run_ranks, tiny_config
from autotp.testing.memory import KeptForBackward

OUTPUTS = ("log_probs", "entropy")
BATCH, SEQ = 2, 24  # 2 x 23 scored positions, 5 of them ignored: 41 tokens, 6 chunks of 8


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama")).train()


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (BATCH, SEQ), generator=generator)
    labels = ids.clone()
    labels[0, :6] = -100  # a prompt: its positions are not scored
    weights = torch.randn(BATCH, SEQ - 1, generator=generator)  # d loss / d log p, as an RL advantage weighs it
    return ids, labels, weights


def step(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """One fused-head forward and backward; the per-token outputs and the bytes autograd kept for the backward."""
    ids, labels, weights = batch(model.config.vocab_size)
    kept = KeptForBackward(model)
    with kept.hooks:
        out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    saved = kept.bytes()
    ((out.log_probs * weights).sum() + 0.1 * out.entropy.sum()).backward()
    return {name: getattr(out, name).detach() for name in OUTPUTS}, saved


def sharded(rank: int, world: int, chunk: int | None) -> dict:
    from trl.trainer.utils import add_fused_lm_head

    model = autotp.wrap(build(), world, vocab_parallel=True, loss_chunk=chunk)
    add_fused_lm_head(model, outputs=OUTPUTS)
    state = find_state(model)
    make_vocab_parallel(model, state, vars(model)["forward"], "test")
    values, saved = step(model)
    grads = {n: full_tensor(p.grad, p, state.tp_group) for n, p in model.named_parameters() if p.grad is not None}
    return {"values": values, "saved": saved, "grads": grads}


@pytest.mark.timeout(120)
def test_trls_fused_head_over_chunks_matches_one_process_and_keeps_less() -> None:
    from trl.trainer.utils import add_fused_lm_head

    reference = build()
    add_fused_lm_head(reference, outputs=OUTPUTS)
    expected, _ = step(reference)
    grads = {n: p.grad for n, p in reference.named_parameters()}
    (chunked, _), (whole, _) = run_ranks(sharded, 2, 8), run_ranks(sharded, 2, None)
    for name in OUTPUTS:
        torch.testing.assert_close(chunked["values"][name], expected[name], atol=1e-5, rtol=0, msg=name)
    assert chunked["grads"].keys() == grads.keys()
    worst = max((grad_error(chunked["grads"][n], grads[n]), n) for n in grads)
    assert worst[0] <= GRAD_RTOL, worst
    # the unchunked head keeps each scored token's logits shard (41 x 128 fp32 and their softmax); chunked, only the
    # hidden states of each chunk and one chunk's values at a time
    assert chunked["saved"] < whole["saved"], (chunked["saved"], whole["saved"])
