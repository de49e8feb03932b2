"""PEFT adapters other than LoRA after wrap (tests/tp/test_lora.py) are not tensor-parallel, so every other way of
combining them with a sharded model stops at once, naming the module and the method, instead of training on wrong
numbers (an adapter on a shard sees only that rank's rows, and its update is never reduced)."""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model

import autotp
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


OTHERS = {  # PEFT config -> the slot refused first and the PEFT class that took it
    "ia3": (
        lambda: IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "model.layers.0.self_attn.q_proj",
        "peft.tuners.ia3",
    ),
    "lora on the vocab-parallel embedding": (
        lambda: LoraConfig(r=4, target_modules=["embed_tokens"]),
        "model.embed_tokens",
        "peft.tuners.lora.layer.Embedding",
    ),
}


def other_after_wrap(rank: int, world: int, kind: str) -> str:
    model = autotp.wrap(tiny_model("llama"), world)
    peft_model = get_peft_model(model, OTHERS[kind][0]())
    ids = batch()
    try:
        peft_model(input_ids=ids, labels=ids).loss.backward()
    except RuntimeError as err:
        return str(err)
    return "trained"


@pytest.mark.parametrize("kind", sorted(OTHERS))
def test_other_peft_methods_after_wrap_stop_at_the_first_forward(kind: str) -> None:
    _, slot, cls = OTHERS[kind]
    for message in run_ranks(other_after_wrap, 2, kind):
        assert f"autotp: {slot} was replaced after wrap by {cls}" in message, message
        assert "autotp shards only LoRA" in message


def test_wrap_points_from_a_peft_model_to_the_model_inside() -> None:
    peft_model = get_peft_model(tiny_model("llama"), LoraConfig(**LORA))
    with pytest.raises(TypeError, match=r"autotp.wrap\(peft_model.base_model.model, tp_size\)"):
        autotp.wrap(peft_model, 1)


@pytest.mark.parametrize(
    "config,error,match",
    [
        (
            lambda: IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
            TypeError,
            r"model.layers.0.self_attn.q_proj is a peft.tuners.ia3.*only LoRA on linear layers",
        ),
        (
            lambda: LoraConfig(**LORA, use_dora=True),
            NotImplementedError,
            r"model.layers.0.self_attn.q_proj uses a LoRA variant",
        ),
        (
            lambda: LoraConfig(**LORA, modules_to_save=["lm_head"]),
            TypeError,
            r"lm_head is a peft.utils.other.ModulesToSaveWrapper \(PEFT's modules_to_save\), which wrap cannot shard. "
            r"get_peft_model after autotp.wrap works",
        ),  # supported after wrap (tests/tp/test_lora.py), not before
    ],
)
def test_wrap_refuses_other_adapters_unchanged(config, error, match) -> None:
    """A model holding adapters autotp does not shard is refused before anything changes (LoRA layers included)."""
    inner = get_peft_model(tiny_model("llama"), config()).base_model.model
    before = {name: type(module) for name, module in inner.named_modules()}
    with pytest.raises(error, match=match):
        autotp.wrap(inner, 1)
    assert {name: type(module) for name, module in inner.named_modules()} == before


def test_adapter_at_tp1_trains_as_without_autotp() -> None:
    """tp_size=1 shards nothing, so an adapter sees whole weights: no guard, same loss as plain PEFT."""
    torch.manual_seed(0)
    reference = get_peft_model(tiny_model("llama"), LoraConfig(**LORA, init_lora_weights=False))
    torch.manual_seed(0)
    wrapped = get_peft_model(autotp.wrap(tiny_model("llama"), 1), LoraConfig(**LORA, init_lora_weights=False))
    ids = batch()
    assert torch.allclose(wrapped(input_ids=ids, labels=ids).loss, reference(input_ids=ids, labels=ids).loss)


QLORA_BASE = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}


def test_a_quantised_base_is_refused_naming_the_method_unchanged() -> None:
    """QLoRA: a base loaded with BitsAndBytesConfig carries it as config.quantization_config (bitsandbytes itself is
    not installed here, so this base holds full-precision weights, as the refusal must come before reading any)."""
    inner = get_peft_model(tiny_model("llama"), LoraConfig(**LORA)).base_model.model
    inner.config.quantization_config = dict(QLORA_BASE)
    before = {name: type(module) for name, module in inner.named_modules()}
    with pytest.raises(NotImplementedError, match=r"LlamaForCausalLM is quantised \(bitsandbytes.*QLoRA"):
        autotp.wrap(inner, 1)
    assert {name: type(module) for name, module in inner.named_modules()} == before


def test_from_pretrained_refuses_a_quantised_checkpoint(tmp_path) -> None:
    import json

    tiny_model("llama").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": QLORA_BASE}))
    with pytest.raises(NotImplementedError, match=r"quantised \(bitsandbytes"):
        autotp.from_pretrained(tmp_path, 1)
