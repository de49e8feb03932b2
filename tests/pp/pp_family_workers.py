"""Pipeline parallelism beyond dense decoders: the rank workers of tests/pp/test_pp_families.py (memory per stage,
MoE, hybrid and vision-language models)."""

from __future__ import annotations

import torch

import autotp
import models
from autotp.pp.cut import find_cut
from autotp.testing import tiny_config
from models import tiny_model
from pp_workers import pp_batch, pp_parity

# families tests/models.py does not list (its lists parametrize other packages' tests), built from their defaults
for _family in ("qwen3_moe", "jamba", "llava", "qwen2_vl"):
    models.CONFIGS.setdefault(_family, lambda family=_family: tiny_config(family))


def parameter_bytes(model) -> int:  # noqa: ANN001
    """The bytes of the parameters a rank holds (a tied weight once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def expected_bytes(model, stage: int, stages: int) -> dict:  # noqa: ANN001
    """The acceptance's figure for one stage, from the one-process model: 1/P of the decoder layers, plus the
    embeddings before them (and a VLM's vision tower and projector) on the first stage, and the final norm and the
    head on the last."""
    cut = find_cut(model, stages, None)
    decoder = model.get_submodule(cut.base)
    children = list(dict(decoder.named_children()))
    at = children.index(cut.layers)
    before = sum(parameter_bytes(decoder.get_submodule(c)) for c in children[:at])
    before += parameter_bytes(model.base_model) - parameter_bytes(decoder)  # a VLM's vision tower and projector
    after = sum(parameter_bytes(decoder.get_submodule(c)) for c in children[at + 1 :])
    head = model.get_output_embeddings().weight
    return {
        "layers": parameter_bytes(decoder.get_submodule(cut.layers)) / stages,
        "ends": (before if stage == 0 else 0)
        + (after + head.numel() * head.element_size() if stage == stages - 1 else 0),
        "tied": head is model.get_input_embeddings().weight,
    }


def pp_family(rank: int, world: int, family: str, tp: int, pp: int, options: dict) -> dict:
    """`pp_parity`, and this rank's parameter bytes once wrapped with the same options beside the acceptance's."""
    result = pp_parity(rank, world, family, tp, pp, options)
    config = dict(options.get("config", {}))
    wrap_options = {k: v for k, v in options.items() if k.startswith("pp_") or k == "ep_size"}
    model = autotp.wrap(tiny_model(family, **config), tp, pp_size=pp, **wrap_options)
    result["bytes"] = parameter_bytes(model)
    result["expected_bytes"] = expected_bytes(tiny_model(family, **config), autotp.pp_rank(model), pp)
    return result


def with_images(inputs: dict, config) -> dict:  # noqa: ANN001
    """`inputs` with one image a row: its image tokens before the text (no loss on them), and its pixels."""
    rows, tokens = inputs["input_ids"].shape[0], config.image_seq_length
    size = config.vision_config.image_size
    generator = torch.Generator().manual_seed(int(inputs["input_ids"].sum()))
    image = torch.full((rows, tokens), config.image_token_id)
    return {
        "input_ids": torch.cat([image, inputs["input_ids"]], 1),
        "attention_mask": torch.cat([torch.ones_like(image), inputs["attention_mask"]], 1),
        "labels": torch.cat([torch.full_like(image, -100), inputs["labels"]], 1),
        "pixel_values": torch.randn(rows, 3, size, size, generator=generator),
    }


def pp_vlm(rank: int, world: int) -> dict:
    """llava at pp 2 with one image a row; qwen2_vl on text rows; and what a VLM batch may not hold under a pipeline
    (qwen2_vl's flattened patches with image_grid_thw, two images a row), refused by name before any step."""
    results = {"llava": pp_family(rank, world, "llava", 1, 2, dict(pp_microbatches=4, images=with_images))}
    results["qwen2_vl"] = pp_parity(rank, world, "qwen2_vl", 1, 2, dict(pp_microbatches=4))
    refused = {}
    qwen2_vl = autotp.wrap(tiny_model("qwen2_vl"), 1, pp_size=2)
    grid = torch.tensor([[1, 2, 2]] * 4)
    llava = autotp.wrap(tiny_model("llava"), 1, pp_size=2)
    two = with_images(pp_batch(), llava.config)
    two["pixel_values"] = torch.cat([two["pixel_values"]] * 2)
    for name, model, inputs in [
        ("image_grid_thw", qwen2_vl, dict(pp_batch(), pixel_values=torch.zeros(16, 1176), image_grid_thw=grid)),
        ("two images a row", llava, two),
    ]:
        try:
            autotp.forward_backward(model, **inputs)
        except NotImplementedError as err:
            untouched = all(p.grad is None for p in model.parameters())
            refused[name] = (str(err), untouched)
    results["refused"] = refused
    return results
