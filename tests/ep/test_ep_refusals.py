"""What expert parallelism refuses by name, each before the model changes (or, inside a context, before a gradient
lands): experts kept as per-expert modules (switch_transformers, nllb-moe) and a backward inside
`GatherReplacedLayerParams` at ep > 1."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

import autotp
from autotp.testing import run_ranks, tiny_config
from ep_workers import GLOBAL, moe_model

pytestmark = pytest.mark.timeout(240)


def per_expert_model(family: str) -> torch.nn.Module:
    """A tiny encoder-decoder whose experts are an `nn.ModuleDict` of `expert_<i>` modules; nllb-moe's tiny
    2-layer default has no sparse layer (one in 4), so every second layer is made sparse."""
    config = tiny_config(family)
    if family == "nllb-moe":
        config.encoder_sparse_step = config.decoder_sparse_step = 2
    torch.manual_seed(0)
    return AutoModelForSeq2SeqLM.from_config(config)


def snapshot(model: torch.nn.Module) -> dict:
    return {
        "types": [(n, type(m)) for n, m in model.named_modules()],
        "tensors": {n: t.clone() for n, t in model.state_dict().items()},
    }


def unchanged(model: torch.nn.Module, before: dict) -> bool:
    after = snapshot(model)
    return (
        after["types"] == before["types"]
        and after["tensors"].keys() == before["tensors"].keys()
        and all(torch.equal(t, before["tensors"][n]) for n, t in after["tensors"].items())
    )


def wrap_per_expert(rank: int, world: int, family: str) -> dict:
    model = per_expert_model(family)
    before = snapshot(model)
    try:
        autotp.wrap(model, 1, ep_size=2)
        message = "accepted"
    except NotImplementedError as err:
        message = str(err)
    return {"message": message, "unchanged": unchanged(model, before)}


@pytest.mark.parametrize(
    "family,path,cls",
    [
        ("switch_transformers", "encoder.block.1.layer.1.mlp.experts", "SwitchTransformersExperts"),
        ("nllb-moe", "model.encoder.layers.1.ffn.experts", "NllbMoeExperts"),
    ],
)
def test_per_expert_modules_are_refused_by_name_before_the_model_changes(family: str, path: str, cls: str) -> None:
    """switch_transformers' and nllb-moe's experts are an `nn.ModuleDict` of per-expert modules routed by a one-hot
    mask; wrap at ep 2 sliced each expert's own Linear by rows (switch) or named an expert's bias (nllb-moe)."""
    expected = (
        f"ep_size=2: {type(per_expert_model(family)).__name__} ({family}) keeps its experts "
        f"as per-expert modules: {path} ({cls}) is an nn.ModuleDict of 4 expert modules"
    )
    with pytest.raises(NotImplementedError) as refused:
        autotp.explain(per_expert_model(family), 1, ep_size=2)
    assert expected in str(refused.value)
    for report in run_ranks(wrap_per_expert, 2, family):
        assert expected in report["message"] and "Leave ep_size at 1" in report["message"], report["message"]
        assert report["unchanged"]


def backward_inside_gather(rank: int, world: int) -> dict:
    model = autotp.wrap(moe_model("qwen3_moe"), 1, ep_size=2)
    before = snapshot(model)
    refused, grads = [], []
    for call in (
        lambda: model(input_ids=GLOBAL[:2], labels=GLOBAL[:2]).loss,  # the model's outputs
        lambda: model.model(input_ids=GLOBAL[:2]).last_hidden_state.sum(),
    ):  # a submodule called on its own
        with autotp.GatherReplacedLayerParams(model):
            loss = call()
            try:
                loss.backward()
                refused.append("accepted")
            except RuntimeError as err:
                refused.append(str(err))
        grads.append([n for n, p in model.named_parameters() if p.grad is not None])
        model.zero_grad()
    return {
        "refused": refused,
        "unchanged": unchanged(model, before),
        "grads": grads[0],
        "expert_grads": [n for n in grads[1] if ".experts." in n],
    }


def test_backward_inside_gather_at_ep2_is_refused_by_name() -> None:
    """Inside the context every rank holds all 4 experts; a gradient computed there kept the full (4, ...) shape
    against the parameter's (2, ...), and AdamW failed on it after the context. The refusal runs at the model's
    outputs, the first node of the backward, so no gradient lands."""
    experts = moe_model("qwen3_moe").model.layers[0].mlp.experts
    gate_up, down = tuple(experts.gate_up_proj.shape), tuple(experts.down_proj.shape)
    held = (gate_up[0] // 2, *gate_up[1:])
    for report in run_ranks(backward_inside_gather, 2):
        for message in report["refused"]:
            assert "backward inside autotp.GatherReplacedLayerParams at ep_size=2" in message, message
        assert (
            f"model.layers.0.mlp.experts.gate_up_proj: {gate_up}, of which this rank holds {held}, 2 of the 4 "
            f"experts" in report["refused"][0]
        ), report["refused"][0]
        assert report["unchanged"] and report["grads"] == [], report["grads"]
        # called on its own, the decoder reaches the first expert parameter's hook: named, and no expert gradient
        assert f".mlp.experts.down_proj: {down}, of which this rank holds {(2, *down[1:])}" in report["refused"][1]
        assert report["expert_grads"] == [], report["expert_grads"]
