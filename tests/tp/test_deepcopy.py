"""`copy.deepcopy` of a wrapped model is a wrapped model of its own (an EMA or reference model), and a deep copy of one
sharded layer (PEFT's modules_to_save) copies the layer, not the model.

Tolerances (fp32, only the order of sums differs between one process and the shards): logits 1e-5, parameters after
one SGD step `PARAM_ATOL` (3e-5). A deep copy and its original run the same shards through the same operations, so
their logits must be bit-identical.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from autotp.testing.parity import PARAM_ATOL
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

IDS = batch()


def one_process_copy_step() -> dict:
    twin = copy.deepcopy(tiny_model("llama", num_key_value_heads=1))
    twin(input_ids=IDS, labels=IDS).loss.backward()
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    with torch.no_grad():
        logits = twin(input_ids=IDS).logits
    return {"params": {n: p.detach().clone() for n, p in twin.named_parameters()}, "logits": logits}


def deep_copied(rank: int, world: int, path: str) -> dict:
    model = autotp.wrap(tiny_model("llama", num_key_value_heads=1), 2)  # replicated KV rows: gradient hooks copied
    with autotp.GatherReplacedLayerParams(model), pytest.raises(RuntimeError, match="deepcopy of a wrapped model"):
        copy.deepcopy(model)  # the copy would hold full weights with nothing to split them again
    twin = copy.deepcopy(model)
    assert autotp.tp_group(twin) is autotp.tp_group(model) and autotp.tp_size(twin) == 2
    with torch.no_grad():
        equal = torch.equal(model(input_ids=IDS).logits, twin(input_ids=IDS).logits)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    twin(input_ids=IDS, labels=IDS).loss.backward()
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    untouched = all(torch.equal(p, original[n]) and p.grad is None for n, p in model.named_parameters())
    with autotp.GatherReplacedLayerParams(twin):
        gathered = {n: p.detach().clone() for n, p in twin.named_parameters()}
    autotp.save_pretrained(twin, path)
    with torch.no_grad():
        logits = twin(input_ids=IDS).logits
    return {"equal": equal, "untouched": untouched, "gathered": gathered, "logits": logits}


def test_deepcopy_of_a_wrapped_model_is_a_wrapped_model_of_its_own(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    expected = one_process_copy_step()
    reports = run_ranks(deep_copied, 2, str(tmp_path))
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)(input_ids=IDS).logits
    assert (loaded - expected["logits"]).abs().max().item() <= 1e-5
    for report in reports:
        assert report["equal"] and report["untouched"]
        worst = max(((report["gathered"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
        assert worst[0] <= PARAM_ATOL, worst
        assert (report["logits"] - loaded).abs().max().item() <= 1e-5


def copy_one_layer(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("qwen2"), world)
    out = {}
    for path in ("lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        memo: dict = {}
        layer = copy.deepcopy(model.get_submodule(path), memo)
        out[path] = {
            "model copied": id(model) in memo,
            "shard kept": hasattr(layer.weight, "autotp_shard"),
            "forward": layer(torch.ones(2, layer.in_features)).shape[0] == 2,
        }
    return out


def test_deepcopy_of_one_sharded_layer_copies_the_layer_not_the_model() -> None:
    """PEFT's modules_to_save deep-copies one layer: the copy shares the model's state and never reaches the model
    itself (before, the state-dict hooks' module set and the mesh guard dragged the whole model into the copy, and a
    row layer's copy could fail with `instance must not be None`)."""
    for report in run_ranks(copy_one_layer, 2):
        assert all(not r["model copied"] and r["shard kept"] and r["forward"] for r in report.values()), report
