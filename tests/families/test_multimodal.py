"""Vision-language models: the language model and the vision tower's blocks sharded, each planned from its own
sub-config, and training on image + text inputs matching one process. Tolerances as in test_parity (fp32: only
the order of the TP partial sums differs)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText

import autotp
from autotp.planning.probe import probe_inputs
from autotp.testing import assert_parity, parity, run_ranks, tiny_config

# (model type, sub-model path of the vision tower, of the language model)
VLMS = {
    "llava": ("model.vision_tower", "model.language_model"),
    "paligemma": ("model.vision_tower", "model.language_model"),
    "gemma3": ("model.vision_tower", "model.language_model"),
    "qwen2_vl": ("model.visual", "model.language_model"),
    "qwen2_5_vl": ("model.visual", "model.language_model"),
    "idefics3": ("model.vision_model", "model.text_model"),
    "aya_vision": ("model.vision_tower", "model.language_model"),
    "mistral3": ("model.vision_tower", "model.language_model"),
}


# Their language models have a shipped policy, so their vocabulary is split too.
VOCAB_PARALLEL = {"idefics3", "llava", "mistral3", "paligemma"}


def tiny_vlm(model_type: str) -> torch.nn.Module:
    """A tiny model whose image path carries gradient: matrices initialised to zero (Gemma3's image projection)
    get random values, or the vision tower would be checked against zeros."""
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(tiny_config(model_type))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and not param.any():
                param.normal_(0, 0.02)
    return model


@pytest.mark.parametrize("model_type", sorted(VLMS))
def test_meta_device_plan_equals_wrap_plan(model_type: str) -> None:
    """from_pretrained and `autotp plan` plan on the meta device: verified on the composite's structural twin."""
    with torch.device("meta"):
        meta = AutoModelForImageTextToText.from_config(tiny_config(model_type))
    assert autotp.explain(meta, 2) == autotp.build_plan(tiny_vlm(model_type), 2)


def hf_methods_on_a_wrapped_vlm(rank: int, world: int, model_type: str, path: str) -> dict:
    """transformers' own save_pretrained and resize_token_embeddings, called on the wrapped model."""
    reference = tiny_vlm(model_type)
    model = autotp.wrap(tiny_vlm(model_type), world)
    model.save_pretrained(path)  # every rank: the save is collective
    report = {}
    if rank == 0:
        reloaded = AutoModelForImageTextToText.from_pretrained(path).eval()
        inputs = probe_inputs(reference, batch=2, seed=3)
        with torch.no_grad():
            report["reload"] = (reloaded(**inputs).logits - reference.eval()(**inputs).logits).abs().max().item()
    rows = reference.get_input_embeddings().num_embeddings + 8
    for m in (reference, model):
        torch.manual_seed(1)  # transformers initialises the new rows from the generator
        m.resize_token_embeddings(rows)
    ids, labels, inputs = parity.training_inputs(reference, seq=8)
    losses = [m.train()(input_ids=ids, labels=labels, **inputs).loss.item() for m in (reference, model)]
    report["resized loss"] = abs(losses[0] - losses[1])
    return report


@pytest.mark.parametrize("model_type", ["llava", "qwen2_vl"])  # vocab-parallel, and not
def test_save_pretrained_and_resize_on_a_wrapped_vlm(tmp_path, model_type: str) -> None:
    reports = run_ranks(hf_methods_on_a_wrapped_vlm, 2, model_type, str(tmp_path))
    assert reports[0]["reload"] == 0.0  # the saved tensors are the gathered shards, bit for bit
    assert all(r["resized loss"] <= parity.LOSS_ATOL for r in reports), reports


def test_image_reaches_the_loss() -> None:
    """Guards the parity tests: every tower's first layer gets a gradient from the image."""
    for model_type, (vision, _) in VLMS.items():
        model = tiny_vlm(model_type)
        inputs = probe_inputs(model, batch=2, seed=1)
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        grads = [
            p.grad
            for n, p in model.named_parameters()
            if n.startswith(vision) and (".layers.0." in n or ".blocks.0." in n) and p.dim() == 2
        ]
        assert grads and all(g is not None and g.abs().max() > 1e-6 for g in grads), model_type


def vlm_parity(rank: int, world: int, model_type: str) -> dict:
    reference = tiny_vlm(model_type)
    ids, labels, inputs = parity.training_inputs(reference, seq=8)  # no loss on image positions
    return parity.compare_training(reference, ids, world, labels=labels, inputs=inputs)


@pytest.mark.parametrize("model_type", sorted(VLMS))
def test_plan_shards_language_and_vision_blocks(model_type: str) -> None:
    vision, language = VLMS[model_type]
    plan = autotp.build_plan(tiny_vlm(model_type), 2)
    paths = [layer.path for layer in plan.layers]
    assert any(p.startswith(language + ".") for p in paths), f"nothing of {language} sharded"
    assert any(p.startswith(vision + ".") for p in paths), f"nothing of {vision} sharded: {plan.replicated}"
    unexplained = [p for p, why in plan.replicated if not str(why)]
    assert not unexplained
    if model_type in VOCAB_PARALLEL:
        assert plan.vocab is not None and plan.vocab.head == "lm_head", plan.vocab_reason
    else:
        assert plan.vocab is None and "policy" in plan.vocab_reason
    projector = [p for p, why in plan.replicated if "projector" in p or "connector" in p or "merger" in p]
    assert all(not p.startswith(language) for p in projector)


def eval_logits_error(rank: int, world: int, model_type: str) -> float:
    """Evaluation without labels: the wrapped model's (gathered) logits against one process."""
    reference = tiny_vlm(model_type).eval()
    inputs = probe_inputs(reference, batch=2, seed=2)
    model = autotp.wrap(tiny_vlm(model_type), world).eval()
    with torch.no_grad():
        return (model(**inputs).logits - reference(**inputs).logits).abs().max().item()


@pytest.mark.parametrize("model_type", sorted(VOCAB_PARALLEL))
def test_vlm_eval_logits_match(model_type: str) -> None:
    # fp32, only the order of partial sums differs; logits are O(1)
    assert max(run_ranks(eval_logits_error, 2, model_type)) < 1e-4


# The sweep is in the slow tier but for LLaVA at tp=2; every VLM's plan and eval logits above stay quick.
@pytest.mark.parametrize(
    "model_type,tp",
    [
        pytest.param(m, tp, marks=[] if (m, tp) == ("llava", 2) else [pytest.mark.slow])
        for m in sorted(VLMS)
        for tp in (2, 4)
    ],
)
def test_vlm_training_parity(model_type: str, tp: int) -> None:
    for report in run_ranks(vlm_parity, tp, model_type):
        assert_parity(report)
        assert report["sharded"] > 0, "nothing was sharded"
