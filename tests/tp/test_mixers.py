"""Token mixers sharded by heads or channels with their recurrent state (issue 51 item 3): tiny models of each
family equal one process at tp 2 (tp 4 in the slow tier): the loss, every gradient and the parameters after AdamW
steps, and `generate` with a cache. One spawn runs every family."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import autotp
from autotp.state import state_of
from autotp.testing import assert_parity, compare_training
from autotp.testing.parity import compare_loading
from autotp.testing.spawn import run_ranks
from autotp.vocab.tokens import token_log_probs
from models import MIXERS, batch

PROMPT = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(3))


def mixer_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MIXERS[family](), dtype=torch.float32)


def complete(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)


def ranks_mixers(rank: int, world: int, saved: str) -> dict:
    """Per family: the training parity report, how many in-place mixer parameters the plan shards, whether greedy
    generation with a cache gives one process's tokens, and `autotp.from_pretrained` against `wrap` (`saved`: the
    folder holding each family's checkpoint)."""
    out = {}
    for family in MIXERS:
        report = compare_training(mixer_model(family), batch(), world, steps=2)
        report["load"] = compare_loading(rank, world, f"{saved}/{family}")
        wrapped = autotp.wrap(mixer_model(family).eval(), world)
        report["in_place"] = len(state_of(wrapped).plan.params)
        reference = mixer_model(family).eval()
        report["generate"] = torch.equal(complete(wrapped), complete(reference))
        with torch.no_grad():  # the logits' own transforms (RecurrentGemma's soft cap) on the vocab shards
            logits = reference(PROMPT).logits[:, :-1].log_softmax(-1)
            expected = logits.gather(-1, PROMPT[:, 1:, None]).squeeze(-1)
            report["log_probs"] = (token_log_probs(wrapped, PROMPT) - expected).abs().max().item()
            # a state the model returns (RWKV's list): whole on every rank, as one process's
            ours, theirs = wrapped(PROMPT, use_cache=True), reference(PROMPT, use_cache=True)
            states = zip(getattr(ours, "state", None) or [], getattr(theirs, "state", None) or [])
            report["state"] = max(
                [((a - b).abs().max() / b.abs().max().clamp(min=1)).item() for a, b in states], default=0.0
            )
        out[family] = report
    return out


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mixers_train_and_generate_as_one_process(tp: int, tmp_path) -> None:
    for family in MIXERS:
        mixer_model(family).save_pretrained(tmp_path / family)
    for reports in run_ranks(ranks_mixers, tp, str(tmp_path)):
        for family, report in reports.items():
            # fp32, the harness's tolerances: sums over shards differ from one process's only in rounding order
            assert_parity(report)
            assert report["in_place"] > 0, f"{family}: no mixer parameter was sharded"
            assert report["generate"], f"{family}: generate with a cache differs from one process"
            assert report["log_probs"] < 1e-5, f"{family}: token_log_probs differs by {report['log_probs']}"
            assert report["state"] < 1e-5, f"{family}: the returned state differs by {report['state']}"
            load = report["load"]  # each rank reads its rows of the checkpoint: bit-equal to wrap after a full load
            assert load["keys"] and not load["unequal"] and load["loss"] == 0.0 and not load["grads"], (family, load)


def ranks_mixers_pipelined(rank: int, world: int) -> dict:
    """Per family but RWKV (whose forward a stage cut cannot split: refused at pp_size > 1, as before), the parity
    report at tp 2 x pp 2."""
    return {
        family: compare_training(mixer_model(family), batch(), 2, steps=2, pp_size=world // 2)
        for family in MIXERS
        if family != "rwkv"
    }


@pytest.mark.slow
def test_mixers_under_a_pipeline_train_as_one_process() -> None:
    for reports in run_ranks(ranks_mixers_pipelined, 4):
        for report in reports.values():
            assert_parity(report)  # fp32: only the order of sums differs
