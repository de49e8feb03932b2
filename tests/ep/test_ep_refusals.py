"""What expert parallelism refuses by name, each before the model changes (or, inside a context, before a gradient
lands): experts kept as per-expert modules (switch_transformers, nllb-moe) and a backward inside
`GatherReplacedLayerParams` at ep > 1."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

import autotp
from autotp.testing import run_ranks, tiny_config

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
    return {"types": [(n, type(m)) for n, m in model.named_modules()],
            "tensors": {n: t.clone() for n, t in model.state_dict().items()}}


def unchanged(model: torch.nn.Module, before: dict) -> bool:
    after = snapshot(model)
    return after["types"] == before["types"] and after["tensors"].keys() == before["tensors"].keys() and all(
        torch.equal(t, before["tensors"][n]) for n, t in after["tensors"].items())


def wrap_per_expert(rank: int, world: int, family: str) -> dict:
    model = per_expert_model(family)
    before = snapshot(model)
    try:
        autotp.wrap(model, 1, ep_size=2)
        message = "accepted"
    except NotImplementedError as err:
        message = str(err)
    return {"message": message, "unchanged": unchanged(model, before)}


@pytest.mark.parametrize("family,path,cls", [
    ("switch_transformers", "encoder.block.1.layer.1.mlp.experts", "SwitchTransformersExperts"),
    ("nllb-moe", "model.encoder.layers.1.ffn.experts", "NllbMoeExperts")])
def test_per_expert_modules_are_refused_by_name_before_the_model_changes(family: str, path: str, cls: str) -> None:
    """switch_transformers' and nllb-moe's experts are an `nn.ModuleDict` of per-expert modules routed by a one-hot
    mask; wrap at ep 2 sliced each expert's own Linear by rows (switch) or named an expert's bias (nllb-moe)."""
    expected = (f"ep_size=2: {type(per_expert_model(family)).__name__} ({family}) keeps its experts "
                f"as per-expert modules: {path} ({cls}) is an nn.ModuleDict of 4 expert modules")
    with pytest.raises(NotImplementedError) as refused:
        autotp.explain(per_expert_model(family), 1, ep_size=2)
    assert expected in str(refused.value)
    for report in run_ranks(wrap_per_expert, 2, family):
        assert expected in report["message"] and "Leave ep_size at 1" in report["message"], report["message"]
        assert report["unchanged"]
