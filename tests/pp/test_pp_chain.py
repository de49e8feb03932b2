"""The chain check a pipeline runs before it cuts a model (`autotp.pp.chain`), in one process: real transformers
models whose decoder models do something a stage cut would get silently wrong are refused, each naming what, and the
models the parity tests train pass it. The sweep (scripts/sweep_pipeline.py) found each of these; without the check
dory and inkling2 trained at pp 2 with a loss 1e-2 off one process's."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from torch import nn

from autotp.pp import chain
from autotp.pp.chain import check_chain
from autotp.pp.cut import find_cut
from autotp.testing import tiny_config

REFUSED = {
    "dory": "runs decoder layer 0 2 times",  # a recurrent block: some layers looped
    "zaya": "also takes output 1 of layer 0",  # a second stream carried from layer to layer
    "deepseek_v4": "hands on hidden states of shape (1, 8, 4,",  # hyper-connections: 4 streams
    "inkling2_text": "its logits, cut into 2 stages, differ",  # block states from the embeddings, freed on stage 1
    "rwkv": "fails",  # its forward rescales every layer's weights
}


def model(model_type: str) -> tf.PreTrainedModel:
    return tf.AutoModelForCausalLM.from_config(tiny_config(model_type))


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_decoder_model_a_cut_would_get_wrong_is_refused_by_name(model_type: str) -> None:
    subject = model(model_type)
    with pytest.raises(NotImplementedError, match="pp_size=2 on") as refused:
        check_chain(subject, find_cut(subject, 2, None), 2)
    assert REFUSED[model_type] in str(refused.value), str(refused.value)


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2", "nemotron_h"])
def test_the_families_the_parity_tests_train_pass(model_type: str) -> None:
    subject = model(model_type)
    check_chain(subject, find_cut(subject, 2, None), 2)


class LateBias(tf.LlamaForCausalLM):
    """A decoder model with a learned bias registered before its layers (so the first stage owns it) and added after
    them: every stage computes it alike, so the cut's logits are right, but its gradient arises on the last stage."""

    def __init__(self, config: tf.LlamaConfig):
        super().__init__(config)
        base = self.model
        children = dict(base._modules)
        base._modules.clear()
        base._modules["embed_tokens"] = children.pop("embed_tokens")
        base._modules["bias"] = nn.Linear(1, config.hidden_size)
        base._modules.update(children)
        forward = base.forward

        def biased(*args: object, **kwargs: object) -> object:
            out = forward(*args, **kwargs)
            out.last_hidden_state = out.last_hidden_state + base.bias(torch.ones(1))
            return out

        base.forward = biased


def test_a_gradient_arising_on_a_stage_that_does_not_train_the_parameter_is_refused() -> None:
    subject = LateBias(model("llama").config)
    with pytest.raises(NotImplementedError, match="stage 1 gives a gradient to model.bias.weight, which stage 0"):
        check_chain(subject, find_cut(subject, 2, None), 2)


def test_without_a_twin_the_check_runs_on_the_model_and_leaves_its_gradients_and_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where no structural twin builds, the check runs the model itself (forwards and backwards): the user's
    gradients and train mode are as they were."""
    monkeypatch.setattr(chain, "structural_twin", lambda model: None)
    subject = model("llama").train()
    subject(input_ids=torch.tensor([[5, 6, 7]]), labels=torch.tensor([[5, 6, 7]])).loss.backward()
    before = {n: p.grad.clone() for n, p in subject.named_parameters()}
    check_chain(subject, find_cut(subject, 2, None), 2)
    assert subject.training
    assert all(torch.equal(p.grad, before[n]) for n, p in subject.named_parameters())
