"""Single process vs tensor parallel on the same model and batch: loss, every gradient, parameters.

Tolerances (fp32): TP changes only the order of floating-point sums (partial matmuls all-reduced),
so results agree to rounding. Loss: 1e-5 absolute (observed ~1e-6). Gradients: max |diff| within
1e-5 of the largest reference entry of the same tensor, floored at 1e-3 (observed <1e-6); the floor
covers gradients that are zero in exact arithmetic (a key bias under softmax) and hold only rounding
noise (see autotp.testing.parity.grad_error). A missing or doubled reduction is off by 50% or more of a real
gradient. Parameters after 3 AdamW steps (lr 1e-3, so at most 3e-3 of movement): 3e-5 absolute (observed <1e-5); Adam divides by sqrt(v), which magnifies rounding in
near-zero gradients, hence the gradient check is the sharp one.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import assert_parity, parity, run_ranks, tiny_config
from autotp.tp.layers import LinearLayer
from models import LLAMA_FAMILY, batch, family_parity, tiny_model

SLOW = pytest.mark.slow


# tp=1 (a group of size 1: every collective returns at once) on Llama only; the other families' tp=1 runs repeated it.
@pytest.mark.parametrize(
    "family,tp",
    [("llama", 1)]
    + [pytest.param(family, tp, marks=[SLOW] if tp == 4 else []) for family in LLAMA_FAMILY for tp in (2, 4)],
)
def test_training_parity(family: str, tp: int) -> None:
    reports = run_ranks(family_parity, tp, family)
    for report in reports:
        assert report["sharded"] > 0, "nothing was sharded"
        assert_parity(report)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=SLOW)])
def test_uneven_mlp_width_parity(tp: int) -> None:
    for report in run_ranks(family_parity, tp, "llama", 3, None, {"intermediate_size": 90}):
        assert_parity(report)


def checkpointed(rank: int, world: int, family: str) -> dict:
    """HF activation checkpointing: parity, and the block inputs the shared entries still hold after a step."""
    enable = lambda model: model.gradient_checkpointing_enable()  # noqa: E731
    reference = tiny_model(family)
    enable(reference)
    report = parity.compare_training(reference, batch(), world, edit=enable)
    model = autotp.wrap(tiny_model(family), world)
    enable(model)
    model(batch(), labels=batch()).loss.backward()
    report["inputs_held"] = sum(m.entry.holds_input() for m in model.modules() if isinstance(m, LinearLayer))
    return report


@pytest.mark.parametrize("family,tp", [("llama", 1), ("llama", 2), ("gpt2", 2)])  # gpt2 at tp=1 repeated llama's
def test_activation_checkpointing_keeps_parity_and_no_recomputed_input(family: str, tp: int) -> None:
    """A checkpointed layer's recomputation stops once the backward has what it needs, before the block's forward
    hook; the column layers' shared entry must still let go of the recomputed input (and the recomputed graph behind
    it) when the block's backward is done, or checkpointing keeps nearly every layer's activations."""
    for report in run_ranks(checkpointed, tp, family):
        assert report.pop("inputs_held") == 0
        assert_parity(report)


def frozen_norms(rank: int, world: int, unfreeze_after_wrap: bool) -> dict:
    reference = tiny_model("qwen3")
    for name, p in reference.named_parameters():
        if "q_norm" in name or "k_norm" in name:
            p.requires_grad_(False)

    def unfreeze(model: nn.Module) -> None:
        model.requires_grad_(True)

    return parity.compare_training(reference, batch(), world, edit=unfreeze if unfreeze_after_wrap else None)


@pytest.mark.parametrize("unfreeze_after_wrap", [False, True])
def test_frozen_per_head_norms_wrap_and_keep_their_reduction_when_unfrozen(unfreeze_after_wrap: bool) -> None:
    for report in run_ranks(frozen_norms, 2, unfreeze_after_wrap):
        assert_parity(report)
        assert ("model.layers.0.self_attn.q_norm.weight" in report["grad"]) == unfreeze_after_wrap


# bf16 tolerances: bf16 keeps 8 significant bits (rounding 2**-9 relative, one unit 2**-8 near the largest entries),
# and every partial sum is rounded to it, so TP's other order of sums shows at the 1e-2 level (observed: loss 6e-4,
# gradients 1.4e-2 of the tensor's max, parameters 3.4e-3). Loss (computed in fp32 by HF): 5e-3 absolute. Gradients:
# 5e-2 of the tensor's largest entry (a missing or doubled reduction is off by 50%). Parameters after 3 AdamW steps:
# 1e-2 absolute, about one bf16 unit at the largest weights (norms at 1.0).
BF16_LOSS_ATOL, BF16_GRAD_RTOL, BF16_PARAM_ATOL = 5e-3, 5e-2, 1e-2


def bf16_parity(rank: int, world: int, family: str) -> dict:
    """A verified plan (transformers' base_model_tp_plan) on a bf16 model: trained against one process, and how
    many parameters fp32 shards."""
    config = tiny_config(family)
    torch.manual_seed(0)
    report = parity.compare_training(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16), batch(), world)
    torch.manual_seed(0)
    fp32 = autotp.wrap(AutoModelForCausalLM.from_config(config, dtype=torch.float32), world)
    report["fp32_sharded"] = sum(hasattr(p, "autotp_shard") for p in fp32.parameters())
    return report


@pytest.mark.parametrize("family", ["cohere", "granite", "olmo"])
def test_bf16_models_with_a_verified_plan_shard_as_fp32_and_train_alike(family: str) -> None:
    """Verification judged bf16 rounding at fp32's tolerance, so a bf16 model whose plan is verified kept nothing."""
    for report in run_ranks(bf16_parity, 2, family):
        assert report["sharded"] == report["fp32_sharded"] > 0
        assert report["loss"] <= BF16_LOSS_ATOL, report["loss"]
        assert max(report["grad"].values()) <= BF16_GRAD_RTOL, max(report["grad"].items(), key=lambda kv: kv[1])
        assert max(report["param"].values()) <= BF16_PARAM_ATOL, max(report["param"].items(), key=lambda kv: kv[1])
