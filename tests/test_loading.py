"""`autotp.from_pretrained` reads only this rank's slices and equals wrap-after-load, tensor for tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model


def load_both_ways(rank: int, world: int, path: str) -> dict:
    direct = autotp.from_pretrained(path, world)
    reference = autotp.wrap(AutoModelForCausalLM.from_pretrained(path), world)
    ours, theirs = direct.state_dict(), reference.state_dict()
    buffers = dict(reference.named_buffers())
    ids = batch()
    with torch.no_grad():
        logits = (direct(ids).logits - reference(ids).logits).abs().max().item()
    # Both must also train alike: one step, same loss and gradients.
    losses = []
    for model in (direct, reference):
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
    grads = dict(reference.named_parameters())
    return {
        "keys": set(ours) == set(theirs),
        "unequal": [k for k in theirs if not torch.equal(ours[k], theirs[k])],
        "buffers": [n for n, b in direct.named_buffers() if not torch.equal(b, buffers[n])],
        "shards": sum(hasattr(p, "autotp_shard") for p in direct.parameters()),
        "logits": logits,
        "loss": losses[0] - losses[1],
        "grads": [n for n, p in direct.named_parameters() if not torch.equal(p.grad, grads[n].grad)],
    }


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3"])
def test_from_pretrained_equals_wrap_after_load(tmp_path: Path, family: str, layout: str, tp: int) -> None:
    tiny_model(family).save_pretrained(tmp_path, max_shard_size="5GB" if layout == "single" else "60KB")
    assert (tmp_path / "model.safetensors.index.json").exists() == (layout == "sharded")
    for report in run_ranks(load_both_ways, tp, str(tmp_path)):
        assert report["keys"] and report["unequal"] == [] and report["buffers"] == [], report
        assert report["shards"] > 0
        assert report["logits"] == 0.0 and report["loss"] == 0.0 and report["grads"] == [], report


@pytest.mark.parametrize("family", ["olmo", "gpt_neo"])
def test_from_pretrained_shards_derived_plans_like_wrap(tmp_path: Path, family: str) -> None:
    """No shipped policy: HF's plan (olmo) or detection (gpt_neo), verified on a twin while on meta."""
    tiny_model(family).save_pretrained(tmp_path)
    for report in run_ranks(load_both_ways, 2, str(tmp_path)):
        assert report["keys"] and report["unequal"] == [] and report["buffers"] == [], report
        assert report["shards"] > 0
        assert report["logits"] == 0.0 and report["loss"] == 0.0 and report["grads"] == [], report
