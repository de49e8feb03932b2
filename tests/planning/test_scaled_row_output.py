"""Verification accepts a block whose output is its row projection's output times a constant (Falcon-H1's MLP
multiplies down_proj's output by `down_multiplier`): the row layer all-reduces its own output, so the factor acts on
the whole sum. A block that mixes the row's output non-linearly, or by a factor read from it, is still refused.

Planned in one process on real weights: verification's emulation runs here (its own fp32 tolerance, 1e-4 of the
output's scale); the TP run of such a block is `tests/tp/test_shared_blocks.py`'s Falcon-H1.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from autotp.planning.plan import Replicated
from autotp.planning.planner import build_plan
from models import tiny_model


class _MLP(nn.Module):
    """A gated MLP whose output is `finish(down_proj(...))`."""

    def __init__(self, hidden: int, width: int, finish):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.finish = finish

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)))


FINISHES = {
    "scaled": (lambda y: y * 0.25, None),
    "squashed": (torch.tanh, "not the row projection's output"),
    "self-scaled": (lambda y: y * y.mean(), "the sum of the emulated shards differs"),
}


@pytest.mark.parametrize("finish", list(FINISHES))
def test_row_output_times_a_constant_is_verified(finish: str) -> None:
    model = tiny_model("llama")
    model.config.model_type = "my_custom_lm"  # structural detection, verified by emulation
    function, refused = FINISHES[finish]
    torch.manual_seed(3)
    model.model.layers[1].mlp = _MLP(64, 96, function)
    plan = build_plan(model, 2)
    sharded = {layer.path for layer in plan.layers}
    why = dict(plan.replicated).get("model.layers.1.mlp.down_proj")
    assert "model.layers.0.mlp.down_proj" in sharded
    if refused is None:
        assert "model.layers.1.mlp.down_proj" in sharded, why
    else:
        assert why is not None and why.reason is Replicated.NOT_VERIFIED and refused in str(why), why
