"""Vocab parallelism for models no policy covers (issue 51): the LM head's path to the loss and the logits is checked by
emulation (`autotp.planning.logits_path`). Falcon-H1 (planned by detection, its logits scaled by `lm_head_multiplier`)
splits its vocabulary and trains and generates as one process; a model that mixes the vocabulary between its head and
its loss keeps the head whole, says why in the plan, and still trains as one process; an embedding with a norm of its
own (Inkling2-Loop's) stays whole beside a split head; the hybrids' default configs planned on meta split the
vocabulary."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPTNeoForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import autotp
from autotp.planning.policy import Origin
from autotp.state import state_of
from autotp.testing import assert_parity, compare_training, tiny_config
from autotp.testing.spawn import run_ranks
from models import CONFIGS, batch

PROMPT = torch.randint(3, 256, (2, 6), generator=torch.Generator().manual_seed(3))


class MixingGPTNeoForCausalLM(GPTNeoForCausalLM):
    """GPT-Neo (planned by detection) whose forward hands its loss log-probabilities: a log-softmax over the whole
    vocabulary, which on one rank's slice of it computes something else."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        logits = out.logits.log_softmax(-1)
        loss = None if labels is None else self.loss_function(logits, labels, self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=out.past_key_values)


def hybrid() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("falcon_h1"), dtype=torch.float32)


def mixing() -> torch.nn.Module:
    torch.manual_seed(0)
    return MixingGPTNeoForCausalLM(CONFIGS["gpt_neo"]())


def normed() -> torch.nn.Module:
    """Inkling2-Loop: its embedding normalises each looked-up row with a weight of its own."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("inkling2_loop_text"), dtype=torch.float32)


def complete(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


def ranks_detected(rank: int, world: int) -> dict:
    """The hybrid's and the mixing model's parity reports; the hybrid's plan origin, whether it split its vocabulary,
    and whether its greedy generation with a cache gives one process's tokens."""
    out = {
        name: compare_training(build(), batch(), world, steps=2)
        for name, build in (("hybrid", hybrid), ("mixing", mixing), ("normed", normed))
    }
    wrapped = autotp.wrap(hybrid().eval(), world)
    plan = state_of(wrapped).plan
    out["hybrid"].update(origin=plan.origin, vocab=plan.vocab is not None, reason=plan.vocab_reason)
    out["hybrid"]["generate"] = torch.equal(complete(wrapped), complete(hybrid().eval()))
    return out


def test_detected_models_split_the_vocabulary_only_where_their_logits_allow() -> None:
    """Before, every plan no policy wrote kept the vocabulary whole ("only models covered by a policy")."""
    plan = autotp.build_plan(hybrid(), 2)
    assert plan.origin is Origin.DETECTED and plan.vocab is not None, plan.vocab_reason
    refused = autotp.build_plan(mixing(), 2)
    assert refused.origin is Origin.DETECTED and refused.vocab is None
    assert "the logits given to self.loss_function differ" in refused.vocab_reason, refused.vocab_reason
    assert "not elementwise" in refused.vocab_reason
    # an embedding with a norm of its own keeps its rows whole (split, each rank trained that norm on its rows' tokens
    # alone: gradients 1.2 apart at tp 2, found by the causal sweep); the head alone is split
    split = autotp.build_plan(normed(), 2).vocab
    assert split is not None and split.embedding is None, split


@pytest.mark.slow
def test_detected_models_train_and_generate_as_one_process() -> None:
    """The hybrid with its vocabulary split and the mixing model with its head whole both train as one process."""
    for reports in run_ranks(ranks_detected, 2):
        # fp32, the harness's tolerances: the sharded head's sums differ from one process's only in rounding order;
        # the mixing model's head is replicated, and trains as one process
        assert_parity(reports["hybrid"])
        assert_parity(reports["mixing"])
        assert_parity(reports["normed"])
        hybrid_report = reports["hybrid"]
        assert hybrid_report["origin"] is Origin.DETECTED and hybrid_report["vocab"], hybrid_report["reason"]
        assert hybrid_report["generate"], "generate with a cache differs from one process"


# the share of the parameter bytes the largest rank held at tp 8 before the vocabulary was split (issue 51's table)
BEFORE = {"nemotron_h": 0.602, "zamba2": 0.250}


@pytest.mark.parametrize("model_type", sorted(BEFORE))
def test_hybrid_defaults_split_the_vocabulary_on_meta(model_type: str) -> None:
    """At tp 8 on the family's default config the LM head and embedding are split (their logits' path checked on the
    structural twin), so a rank holds less than before."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    plan = autotp.build_plan(model, 8)
    assert plan.vocab is not None, plan.vocab_reason
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    share = max(plan.param_bytes(model)) / whole
    assert share < BEFORE[model_type], share
