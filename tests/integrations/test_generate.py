"""`generate` on a wrapped model gives one process's tokens: greedy and sampled, at tp 2 (tp 4 in the slow tier), the
same completion on every TP rank."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.testing.spawn import run_ranks
from models import tiny_model

PROMPT = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))
NEW = 12


def complete(model: torch.nn.Module, sample: bool) -> torch.Tensor:
    torch.manual_seed(5)  # the sampler's draws: the same stream in one process and on every TP rank
    with torch.no_grad():
        return model.generate(
            PROMPT, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=sample, top_k=0, temperature=1.0, pad_token_id=0
        )


def ranks_complete(rank: int, world: int, sample: bool) -> torch.Tensor:
    return complete(autotp.wrap(tiny_model("llama").eval(), world), sample)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sampled"])
def test_generate_gives_one_process_tokens_on_every_rank(tp: int, sample: bool) -> None:
    expected = complete(tiny_model("llama").eval(), sample)
    for tokens in run_ranks(ranks_complete, tp, sample):
        # fp32 logits differ from one process's only in the order of sums; on this prompt no draw or argmax sits
        # close enough to a boundary to flip, so the tokens are equal (a flip would show as a mismatch here)
        assert torch.equal(tokens, expected), (tokens, expected)
