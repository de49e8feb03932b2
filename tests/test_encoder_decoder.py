"""Encoder-decoders (self- and cross-attention, T5's relative bias) and encoders with task heads: sharded, and training
matching one process. Tolerances as in test_parity (fp32: only the order of the TP partial sums differs)."""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import autotp
from autotp.probe import probe_inputs
from autotp.testing import assert_parity, parity, run_ranks, tiny_config

SEQ2SEQ = ["bart", "blenderbot", "blenderbot-small", "m2m_100", "marian", "mbart", "pegasus", "plbart", "t5", "whisper"]
ENCODERS = {"bert": tf.AutoModelForSequenceClassification, "roberta": tf.AutoModelForMaskedLM,
            "xlm-roberta": tf.AutoModelForTokenClassification}


def tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    auto = ENCODERS.get(model_type) or (tf.AutoModelForSpeechSeq2Seq if model_type == "whisper"
                                        else tf.AutoModelForSeq2SeqLM)
    return auto.from_config(tiny_config(model_type))


def seq2seq_parity(rank: int, world: int, model_type: str) -> dict:
    reference = tiny(model_type)
    inputs = probe_inputs(reference, batch=2, seq=12, seed=1)
    labels = inputs.pop("decoder_input_ids")  # the model shifts them right into the decoder's inputs
    return parity.compare_training(reference, inputs.pop("input_ids", None), world, labels=labels, inputs=inputs)


def encoder_parity(rank: int, world: int, model_type: str) -> dict:
    reference = tiny(model_type)
    ids = probe_inputs(reference, batch=2, seq=12, seed=1)["input_ids"]
    labels = {tf.AutoModelForSequenceClassification: torch.tensor([0, 1]),
              tf.AutoModelForTokenClassification: ids % 2}.get(ENCODERS[model_type], ids)
    return parity.compare_training(reference, ids, world, labels=labels)


def test_cross_attention_is_column_over_encoder_output() -> None:
    plan = autotp.build_plan(tiny("bart"), 2)
    styles = {layer.path: layer.style for layer in plan.layers}
    cross = "model.decoder.layers.0.encoder_attn"
    assert [styles[f"{cross}.{p}"] for p in ("q_proj", "k_proj", "v_proj", "out_proj")] == ["column"] * 3 + ["row"]
    assert styles["model.encoder.layers.0.fc1"] == "column" and styles["model.encoder.layers.0.fc2"] == "row"


def test_t5_self_attention_with_relative_bias_stays_replicated_with_reason() -> None:
    plan = autotp.build_plan(tiny("t5"), 2)
    why = dict(plan.replicated)["encoder.block.0.layer.0.SelfAttention.q"]
    assert "relative_attention_bias" in why
    assert any(layer.path.startswith("decoder.block.0.layer.1.EncDecAttention.") for layer in plan.layers)
    assert any(layer.path.startswith("encoder.block.0.layer.1.DenseReluDense.") for layer in plan.layers)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model_type", SEQ2SEQ)
def test_seq2seq_training_parity(model_type: str, tp: int) -> None:
    for report in run_ranks(seq2seq_parity, tp, model_type):
        assert_parity(report)
        assert report["sharded"] > 0, "nothing was sharded"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model_type", sorted(ENCODERS))
def test_encoder_task_head_parity(model_type: str, tp: int) -> None:
    for report in run_ranks(encoder_parity, tp, model_type):
        assert_parity(report)
        assert report["sharded"] > 0, "nothing was sharded"
