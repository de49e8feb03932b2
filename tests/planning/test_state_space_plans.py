"""State-space families planned at their default (flagship) configs on the meta device (issue 51): every mixer split
by heads, no block lost as the model grows, and a rank's share of the parameters.

Each plan is built as `autotp plan <config> --tp 8` builds it; derived blocks are verified on the structural twin.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from autotp.planning.planner import build_plan
from autotp.planning.twin import ssm_heads, twin_config


def _plan(model_type: str, tp: int = 8):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    return model, build_plan(model, tp)


def _share(model, plan) -> float:
    return max(plan.param_bytes(model)) / sum(p.numel() * p.element_size() for p in model.parameters())


def test_mamba2_default_is_split_by_heads() -> None:
    model, plan = _plan("mamba2")
    assert not plan.mixers, plan.mixers
    assert {p.name for p in plan.params} >= {"A_log", "D", "dt_bias", "weight", "bias"}
    assert not [path for path, _ in plan.replicated], plan.replicated
    assert _share(model, plan) <= 0.16


def test_hybrid_default_keeps_every_block() -> None:
    """Nemotron-H's `layers.*.mixer` is a Mamba-2 mixer, attention, an MLP or MoE by layer, and HF's plan names the
    MoE's experts under that pattern: each kind is planned (its attention and MLP were lost at the default size, its
    shared experts unverified: the twin's experts kernel needed 16-byte strides)."""
    model, plan = _plan("nemotron_h")
    replicated = [path for path, _ in plan.replicated if path != "lm_head"]
    assert not replicated, plan.describe()
    assert not plan.mixers, plan.mixers
    mixers = {p.block for p in plan.params if p.name == "A_log"}
    assert mixers and len(mixers) == sum(1 for _, m in model.named_modules() if hasattr(m, "A_log"))


@pytest.mark.parametrize("model_type", ["bamba", "zamba2", "falcon_h1", "granitemoehybrid"])
def test_twin_mixers_fill_their_width(model_type: str) -> None:
    """The structural twin narrows the hidden size; its Mamba-2 heads keep their count (the plan splits them) and
    narrow to fill the expanded width, else the twin's probe fails and every block stays unverified (Bamba)."""
    config = twin_config(AutoConfig.for_model(model_type))
    [(heads, width, channels)] = ssm_heads(config)
    assert getattr(config, heads) == getattr(AutoConfig.for_model(model_type), heads)
    assert getattr(config, heads) * getattr(config, width) == channels


@pytest.mark.slow
def test_zamba2_default_shares_its_shared_block() -> None:
    """Zamba2's shared transformer block (attention on hidden | embeddings, fused gate|up with per-layer adapters) is
    tied across its nine hybrid layers: planned once, every other hybrid layer made that module, so its attention and
    MLP are split (they were "not covered" at the default size, and the twin's probe failed on their width). Only
    each hybrid layer's `linear` (hidden -> hidden) stays whole; with the vocabulary split as well (one eighth of the
    tied embedding: its logits' path checked by emulation, `planning.logits_path`) a rank holds at most 0.16 of the
    model."""
    model, plan = _plan("zamba2")
    replicated = {path for path, _ in plan.replicated if "adapter_list" not in path}
    assert replicated == {f"model.layers.{i}.linear" for i in model.config.hybrid_layer_ids}, replicated
    assert plan.vocab is not None and plan.vocab.tied, plan.vocab_reason
    first = f"model.layers.{model.config.hybrid_layer_ids[0]}.shared_transformer"
    assert {f"{first}.self_attn.o_proj", f"{first}.feed_forward.down_proj"} <= {layer.path for layer in plan.layers}
    assert len(plan.shared) == 2 * (len(model.config.hybrid_layer_ids) - 1)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    assert max(plan.param_bytes(model)) / whole <= 0.16, max(plan.param_bytes(model)) / whole
