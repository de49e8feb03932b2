"""A model autotp cannot fully understand keeps its numerics: what it cannot prove safe stays replicated."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp.planning.plan import Replicated
from autotp.testing import assert_parity, parity
from autotp.testing.spawn import run_ranks
from models import SoftmaxMLP, batch, tiny_model


def custom_model(model_type: str) -> nn.Module:
    model = tiny_model("llama")
    torch.manual_seed(5)
    model.model.layers[1].mlp = SoftmaxMLP(64, 96)
    model.config.model_type = model_type  # "llama": the shipped policy; anything else: detection
    return model


def custom_parity(rank: int, world: int, model_type: str) -> dict:
    model = custom_model(model_type)
    report = parity.compare_training(model, batch(), world)
    plan = autotp.explain(custom_model(model_type), world)
    report["replicated"] = [path for path, why in plan.replicated if why.reason is Replicated.NOT_VERIFIED]
    report["sharded_paths"] = [layer.path for layer in plan.layers]
    return report


@pytest.mark.parametrize("model_type", ["llama", "my_custom_lm"])
def test_unknown_block_is_replicated_and_parity_holds(model_type: str) -> None:
    for report in run_ranks(custom_parity, 2, model_type):
        assert_parity(report)
        assert "model.layers.1.mlp.down_proj" in report["replicated"], report["replicated"]
        assert "model.layers.0.mlp.down_proj" in report["sharded_paths"]
        assert not any(p.startswith("model.layers.1.mlp") for p in report["sharded_paths"])
