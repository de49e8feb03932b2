"""Parity (loss, every gathered gradient, parameters after AdamW) for fused, MQA/GQA, MoE and encoder families,
KV-head replication and uneven heads. Tolerances as in test_parity."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from autotp.testing import assert_parity, compare_training, tiny_config
from autotp.testing.spawn import run_ranks
from models import DERIVED, MORE_FAMILIES, OTHER_POLICY_FAMILIES, batch, family_parity

pytestmark = pytest.mark.slow  # the all-family sweep; test_parity.py keeps the Llama family in the quick tier


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", OTHER_POLICY_FAMILIES)
def test_family_parity(family: str, tp: int) -> None:
    for report in run_ranks(family_parity, tp, family):
        assert_parity(report)
        assert report["sharded"] > 0, "nothing was sharded"


@pytest.mark.parametrize(
    "family,heads,kv,tp",
    [
        ("llama", 8, 1, 2),
        ("llama", 8, 1, 4),
        ("llama", 8, 2, 4),  # KV heads replicated over tp/kv ranks
        ("qwen3", 8, 2, 4),  # ... with per-head norms
        ("llama", 6, 6, 4),
        ("llama", 6, 2, 4),
        ("llama", 14, 14, 4),  # uneven heads: 2/2/1/1, 2/1/2/1, 4/4/3/3
    ],
)
def test_head_layouts_parity(family: str, heads: int, kv: int, tp: int) -> None:
    config = {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 8}
    for report in run_ranks(family_parity, tp, family, 3, None, config):
        assert_parity(report)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", sorted(DERIVED))
def test_derived_plan_parity(family: str, tp: int) -> None:
    """No shipped policy: HF's plan or detection, verified by emulation, must still match exactly."""
    for report in run_ranks(family_parity, tp, family):
        assert_parity(report)
        assert report["sharded"] > 0, "nothing was sharded"


def ranks_more_families(rank: int, world: int) -> dict:
    reports = {family: family_parity(rank, world, family) for family in MORE_FAMILIES}
    torch.manual_seed(0)  # a composite whose language model is the root model itself, trained on text
    phi4 = AutoModelForCausalLM.from_config(tiny_config("phi4_multimodal"), dtype=torch.float32)
    reports["phi4_multimodal"] = compare_training(phi4, batch(), world)
    return reports


def test_more_families_parity() -> None:
    """TrOCR (its decoder layers' MLP), Moshi (attention through its linear wrappers, packed gate|up MLP), Beam
    (gated attention, its per-head gate bias split with the heads) and Phi-4-multimodal (its root language model by
    the Phi-3 policy, beside its vision and audio sub-models): sharded, and equal to one process at tp 2."""
    for reports in run_ranks(ranks_more_families, 2):
        for report in reports.values():
            assert_parity(report)
        assert not [family for family, report in reports.items() if not report["sharded"]], "nothing was sharded"
