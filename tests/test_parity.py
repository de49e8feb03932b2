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

import autotp
from autotp.parallel.layers import LinearLayer
from autotp.testing import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL, assert_parity, parity, run_ranks
from models import FAMILIES, batch, tiny_model

def compare_training(rank: int, world: int, family: str, steps: int = 3, policy=None,
                     config: dict | None = None) -> dict:
    """Runs on each rank: a tiny `family` model, single process vs wrapped at tp=world."""
    return parity.compare_training(tiny_model(family, **(config or {})), batch(), world, steps, policy)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_training_parity(family: str, tp: int) -> None:
    reports = run_ranks(compare_training, tp, family)
    for report in reports:
        assert report["sharded"] > 0, "nothing was sharded"
        assert_parity(report)


@pytest.mark.parametrize("tp", [2, 4])
def test_uneven_mlp_width_parity(tp: int) -> None:
    for report in run_ranks(compare_training, tp, "llama", 3, None, {"intermediate_size": 90}):
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
    report["inputs_held"] = sum(m._shared_input._source is not None for m in model.modules()
                                if isinstance(m, LinearLayer))
    return report


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_activation_checkpointing_keeps_parity_and_no_recomputed_input(family: str, tp: int) -> None:
    """A checkpointed layer's recomputation stops once the backward has what it needs, before the block's forward
    hook; the column layers' shared entry must still let go of the recomputed input (and the recomputed graph behind
    it) when the block's backward is done, or checkpointing keeps nearly every layer's activations."""
    for report in run_ranks(checkpointed, tp, family):
        assert report.pop("inputs_held") == 0
        assert_parity(report)
