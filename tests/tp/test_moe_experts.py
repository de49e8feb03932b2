"""MoE experts whose shard width grouped_mm refuses (a row stride not a multiple of 16 bytes) still train with
parity (autotp.testing's tolerances: fp32, only the order of sums differs)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from autotp.testing import assert_parity, compare_training, run_ranks, tiny_config
from models import batch


def moe_parity(rank: int, world: int, model_type: str) -> dict:
    config = tiny_config(model_type)
    config.moe_intermediate_size = 12  # 6 fp32 per rank: 24 bytes, not a multiple of 16 (grouped_mm's stride)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    return compare_training(reference, batch(config.vocab_size), world)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe"])
def test_moe_experts_whose_shard_width_grouped_mm_refuses_train_with_parity(model_type: str) -> None:
    for report in run_ranks(moe_parity, 2, model_type):
        assert_parity(report)
        assert report["sharded"]
