"""Encoder-decoders (self- and cross-attention, T5's relative bias) and encoders with task heads: sharded, and training
matching one process. Tolerances as in test_parity (fp32: only the order of the TP partial sums differs)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import autotp
from autotp.testing import assert_parity, parity, run_ranks, tiny_config

SEQ2SEQ = ["bart", "blenderbot", "blenderbot-small", "m2m_100", "marian", "mbart", "pegasus", "plbart", "t5", "whisper"]
ENCODERS = {
    "bert": tf.AutoModelForSequenceClassification,
    "roberta": tf.AutoModelForMaskedLM,
    "modernbert": tf.AutoModelForMaskedLM,
    "xlm-roberta": tf.AutoModelForTokenClassification,
}


def tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    auto = ENCODERS.get(model_type) or (
        tf.AutoModelForSpeechSeq2Seq if model_type == "whisper" else tf.AutoModelForSeq2SeqLM
    )
    return auto.from_config(tiny_config(model_type))


def task_parity(rank: int, world: int, model_type: str) -> dict:
    """Decoder labels for seq2seq (the model shifts them into the decoder's inputs), classes for classifiers."""
    reference = tiny(model_type)
    ids, labels, inputs = parity.training_inputs(reference, seq=12)
    return parity.compare_training(reference, ids, world, labels=labels, inputs=inputs)


def test_cross_attention_is_column_over_encoder_output() -> None:
    plan = autotp.build_plan(tiny("bart"), 2)
    styles = {layer.path: layer.style for layer in plan.layers}
    cross = "model.decoder.layers.0.encoder_attn"
    assert [styles[f"{cross}.{p}"] for p in ("q_proj", "k_proj", "v_proj", "out_proj")] == ["column"] * 3 + ["row"]
    assert styles["model.encoder.layers.0.fc1"] == "column" and styles["model.encoder.layers.0.fc2"] == "row"


def test_t5_self_attention_with_relative_bias_stays_replicated_with_reason() -> None:
    plan = autotp.build_plan(tiny("t5"), 2)
    why = str(dict(plan.replicated)["encoder.block.0.layer.0.SelfAttention.q"])
    assert "relative_attention_bias" in why
    assert any(layer.path.startswith("decoder.block.0.layer.1.EncDecAttention.") for layer in plan.layers)
    assert any(layer.path.startswith("encoder.block.0.layer.1.DenseReluDense.") for layer in plan.layers)


def test_block_failing_with_an_empty_message_stays_replicated_with_a_reason() -> None:
    """FSMT's attention asserts without a message on a shard: the plan says so instead of crashing."""
    plan = autotp.build_plan(tf.AutoModelForSeq2SeqLM.from_config(tiny_config("fsmt")), 2)
    assert any("fails to run (AssertionError)" in str(why) for _, why in plan.replicated)


def decoder_alone_parity(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    reference = tf.AutoModelForCausalLM.from_config(tiny_config("bart"))
    ids, labels, inputs = parity.training_inputs(reference, seq=12)
    return parity.compare_training(reference, ids, world, labels=labels, inputs=inputs)


def test_bart_decoder_alone_keeps_its_vocabulary_whole() -> None:
    """BartForCausalLM computes cross-entropy inline, so its policy turns vocab parallelism off, and says why."""
    plan = autotp.build_plan(tf.AutoModelForCausalLM.from_config(tiny_config("bart")), 2)
    assert plan.vocab is None and "inline" in plan.vocab_reason
    for report in run_ranks(decoder_alone_parity, 2):
        assert_parity(report)


def sweep(model_types, quick: str) -> list:
    """(model type, tp) at tp 2 and 4, all in the slow tier but `quick` at tp=2 (T5 for its relative attention bias,
    BERT for a classification head)."""
    return [
        pytest.param(m, tp, marks=[] if (m, tp) == (quick, 2) else [pytest.mark.slow])
        for m in model_types
        for tp in (2, 4)
    ]


@pytest.mark.parametrize("model_type,tp", sweep(SEQ2SEQ, "t5"))
def test_seq2seq_training_parity(model_type: str, tp: int) -> None:
    for report in run_ranks(task_parity, tp, model_type):
        assert_parity(report)
        assert report["sharded"] > 0, "nothing was sharded"


@pytest.mark.parametrize("model_type,tp", sweep(sorted(ENCODERS), "bert"))
def test_encoder_task_head_parity(model_type: str, tp: int) -> None:
    for report in run_ranks(task_parity, tp, model_type):
        assert_parity(report)
        assert report["sharded"] > 0, "nothing was sharded"
