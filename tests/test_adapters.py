"""PEFT adapters are not tensor-parallel yet, so every way of combining them with a sharded model stops at once,
naming the module, instead of training on wrong numbers (an adapter on a shard sees only that rank's rows, and
its update is never reduced)."""

from __future__ import annotations


import pytest
import torch
from peft import LoraConfig, get_peft_model

import autotp
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def peft_after_wrap(rank: int, world: int) -> str:
    model = autotp.wrap(tiny_model("llama"), world)
    peft_model = get_peft_model(model, LoraConfig(**LORA))
    ids = batch()
    try:
        peft_model(input_ids=ids, labels=ids).loss.backward()
    except RuntimeError as err:
        return str(err)
    return "trained"


def test_peft_after_wrap_stops_at_the_first_forward() -> None:
    for message in run_ranks(peft_after_wrap, 2):
        assert "model.layers.0.self_attn.q_proj was replaced after wrap by peft" in message, message
        assert "not supported yet" in message


@pytest.mark.parametrize("inside", [False, True])
def test_wrap_refuses_a_model_holding_adapters(inside: bool) -> None:
    peft_model = get_peft_model(tiny_model("llama"), LoraConfig(**LORA))
    target = peft_model.base_model.model if inside else peft_model
    with pytest.raises(TypeError, match=r"is a peft\..*not supported yet"):
        autotp.wrap(target, 1)


def test_adapter_at_tp1_trains_as_without_autotp() -> None:
    """tp_size=1 shards nothing, so an adapter sees whole weights: no guard, same loss as plain PEFT."""
    torch.manual_seed(0)
    reference = get_peft_model(tiny_model("llama"), LoraConfig(**LORA, init_lora_weights=False))
    torch.manual_seed(0)
    wrapped = get_peft_model(autotp.wrap(tiny_model("llama"), 1), LoraConfig(**LORA, init_lora_weights=False))
    ids = batch()
    assert torch.allclose(wrapped(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss)
