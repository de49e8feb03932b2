"""Single process vs tensor parallel on the same model and batch: loss, every gradient, parameters.

Tolerances (fp32): TP changes only the order of floating-point sums (partial matmuls all-reduced),
so results agree to rounding. Loss: 1e-5 absolute (observed ~1e-6). Gradients: max |diff| within
1e-5 of the largest reference entry of the same tensor, floored at 1e-3 (observed <1e-6); the floor
covers gradients that are zero in exact arithmetic (a key bias under softmax) and hold only rounding
noise. A missing or doubled reduction is off by 50% or more of a real gradient. Parameters after 3 AdamW steps (lr 1e-3, so at most 3e-3 of
movement): 3e-5 absolute (observed <1e-5); Adam divides by sqrt(v), which magnifies rounding in
near-zero gradients, hence the gradient check is the sharp one.
"""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from autotp.comm import all_gather_full
from models import FAMILIES, batch, tiny_model
from ranks import run_ranks

LOSS_ATOL, GRAD_RTOL, PARAM_ATOL = 1e-5, 1e-5, 3e-5
GRAD_FLOOR = 1e-3


def grad_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |diff| relative to the tensor's largest reference gradient (floored, see above)."""
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(GRAD_FLOOR)).item()


def full(tensor: torch.Tensor, param: torch.nn.Parameter, group) -> torch.Tensor:
    """The whole tensor behind a shard (a parameter or its gradient)."""
    shard = getattr(param, "autotp_shard", None)
    return tensor.detach() if shard is None else all_gather_full(tensor.detach(), shard.partition, group)


def compare_training(rank: int, world: int, family: str, steps: int = 3, policy=None,
                     config: dict | None = None) -> dict:
    """Train a reference and a wrapped copy side by side; report the worst differences."""
    reference = tiny_model(family, **(config or {}))
    model = autotp.wrap(copy.deepcopy(reference), world, policy=policy)
    group = model.autotp_state.tp_group
    ids = batch()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    ref_params = dict(reference.named_parameters())
    report = {"loss": 0.0, "grad": {}, "param": {}}
    for step in range(steps):
        losses = []
        for m in (reference, model):
            loss = m(ids, labels=ids).loss
            loss.backward()
            losses.append(loss.item())
        report["loss"] = max(report["loss"], abs(losses[0] - losses[1]))
        if step == 0:
            for name, p in model.named_parameters():
                expected = ref_params[name].grad
                report["grad"][name] = grad_error(full(p.grad, p, group), expected)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for name, p in model.named_parameters():
        report["param"][name] = (full(p, p, group) - ref_params[name].detach()).abs().max().item()
    report["sharded"] = sum(hasattr(p, "autotp_shard") for p in model.parameters())
    return report


def assert_parity(report: dict) -> None:
    assert report["loss"] <= LOSS_ATOL, f"loss differs by {report['loss']:.3g}"
    worst = max(report["grad"].items(), key=lambda kv: kv[1])
    assert worst[1] <= GRAD_RTOL, f"gradient of {worst[0]} differs by {worst[1]:.3g} (relative to its max)"
    worst = max(report["param"].items(), key=lambda kv: kv[1])
    assert worst[1] <= PARAM_ATOL, f"{worst[0]} differs by {worst[1]:.3g} after AdamW steps"


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
