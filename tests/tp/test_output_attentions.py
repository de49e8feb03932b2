"""`output_attentions=True` under TP returns every head's weights in order, gathered differentiably: what one process
returns (fp32, only the reduction order differs: the weights within 1e-5, gradients 1e-5 relative)."""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

FP32 = 1e-5


def attention_weights(rank: int, world: int, family: str, return_dict: bool) -> dict:
    """`output_attentions=True` on eager attention, against one process's model (same seed, same calls): every
    layer's weights, and the gradients of a loss on them (query and key projections, embeddings) as one process's."""
    reference = tiny_model(family)
    reference.set_attn_implementation("eager")
    model = autotp.wrap(copy.deepcopy(reference), world)
    ids = batch()
    outputs = {}
    for name, m in (("one", reference), ("tp", model)):
        out = m(input_ids=ids, output_attentions=True, return_dict=return_dict)
        weights = out.attentions if return_dict else out[-1]  # (logits, attentions) without a cache
        torch.stack(weights).pow(2).sum().backward()  # a loss on the weights themselves
        outputs[name] = weights
    group = model.autotp_state.tp_group
    grads = {
        n: parity.grad_error(parity.full_tensor(p.grad, p, group), reference.get_parameter(n).grad)
        for n, p in model.named_parameters()
        if reference.get_parameter(n).grad is not None
    }
    shapes = [tuple(w.shape) for w in outputs["tp"]] == [tuple(w.shape) for w in outputs["one"]]
    return {
        "shapes": shapes,
        "grad": max(grads.values()),
        "weights": max((a - b).abs().max().item() for a, b in zip(outputs["one"], outputs["tp"])) if shapes else 1,
    }


@pytest.mark.parametrize(
    "family,return_dict", [("llama", True), ("llama", False), ("gpt2", True), ("bert", True)]
)  # BERT's weights are recorded inside the block
def test_output_attentions_returns_every_head_in_order(family: str, return_dict: bool) -> None:
    """Before, each rank's weights held its own heads only (4 of 8); now they are gathered, differentiably, into what
    one process returns (fp32: the weights within 1e-5, gradients 1e-5 relative)."""
    for report in run_ranks(attention_weights, 2, family, return_dict):
        assert report["shapes"], report
        assert report["weights"] <= FP32 and report["grad"] <= FP32, report
