"""The chain check a pipeline runs before it cuts a model (`autotp.pp.chain`), in one process: real transformers
models whose decoder models do something a stage cut would get silently wrong are refused, each naming what, and the
models the parity tests train pass it. The sweep (scripts/sweep_pipeline.py) found each of these; without the check
dory and inkling2 trained at pp 2 with a loss 1e-2 off one process's."""

from __future__ import annotations

import pytest
import transformers as tf

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
