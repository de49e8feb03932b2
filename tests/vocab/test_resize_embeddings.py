"""`resize_token_embeddings` on a wrapped model (vocab-parallel or not, tied or not, grown unevenly or shrunk, after
`from_pretrained`) trains like the resized model in one process.

Parity tolerances as in test_parity (fp32: tensor parallelism only reorders sums).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import assert_parity, parity, run_ranks
from models import batch, tiny_model


def resize_parity(rank: int, world: int, family: str, new_vocab: int, vocab_parallel: bool) -> dict:
    report = parity.compare_training(
        tiny_model(family),
        batch(vocab=min(256, new_vocab)),
        world,
        vocab_parallel=vocab_parallel,
        edit=lambda m: m.resize_token_embeddings(new_vocab),
    )
    ids = torch.randint(0, new_vocab, (2, 16), generator=torch.Generator().manual_seed(3))  # new tokens too
    model = autotp.wrap(tiny_model(family), world, vocab_parallel=vocab_parallel)
    model.resize_token_embeddings(new_vocab)
    report["new_ids_loss"] = model(ids, labels=ids).loss.item()
    report["vocab_parallel"] = model.autotp_state.plan.vocab is not None
    return report


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "family,new_vocab", [("llama", 262), ("gemma", 262), ("llama", 256), ("llama", 200), ("gpt_neo", 262)]
)
def test_resize_token_embeddings_keeps_parity(family: str, new_vocab: int, tp: int) -> None:
    """Grow unevenly (262 = 66/66/65/65 at tp 4), tied (gemma) or not, same size, shrink; a plan by detection
    (gpt_neo), whose logits' path was checked when it was wrapped."""
    reports = run_ranks(resize_parity, tp, family, new_vocab, True)
    for report in reports:
        assert_parity(report)
        assert report["vocab_parallel"]
    assert len({r["new_ids_loss"] for r in reports}) == 1, "the ranks disagree on the loss after resizing"


def test_resize_token_embeddings_without_vocab_parallelism() -> None:
    for report in run_ranks(resize_parity, 2, "llama", 262, False):
        assert_parity(report)
        assert not report["vocab_parallel"]


def resize_after_loading(rank: int, world: int, path: str) -> float:
    model = autotp.from_pretrained(path, world)
    reference = AutoModelForCausalLM.from_pretrained(path)
    for m in (reference, model):
        torch.manual_seed(7)  # the new rows are drawn at random: the same draw for both
        m.resize_token_embeddings(262)
    ids = torch.randint(0, 262, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return (model(ids).logits - reference(ids).logits).abs().max().item()


def test_resize_token_embeddings_after_from_pretrained(tmp_path: Path) -> None:
    tiny_model("gemma").save_pretrained(tmp_path)
    for difference in run_ranks(resize_after_loading, 2, str(tmp_path)):
        assert difference <= 1e-5  # fp32, only the order of sums differs
