"""Pipeline parallelism beyond dense decoders, against one process: each stage's memory (it holds its layers and
only the embedding or the head it trains), a MoE with its load-balancing loss added across stages, pp x ep, a
hybrid (Mamba and attention layers) and a vision-language model.

Parity as tests/pp/test_pipeline.py (`pp_parity`, `assert_pp_parity`): fp32, so only the order of reductions
differs: the loss within 1e-5 at every step and every parameter within 3e-5 after 3 AdamW steps, micro-batches of
different label counts. The fast tier runs qwen3_moe at pp 2 (its load-balancing loss, and each stage's bytes); the
other layouts and families are slow.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from autotp.mesh import Mesh, check_world, dense_grid, expert_grid
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import tiny_model
from pp_family_workers import pp_family, pp_vlm
from pp_workers import assert_pp_parity, pp_batch, pp_parity

AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)
MOE_NAMES = 3 + 2 * 11  # embedding, norm, head; 11 a layer (attention 8, router, the experts' 2 tensors)


def assert_stage_bytes(results: list[dict]) -> None:
    """Each rank holds 1/P of the decoder layers (within 5%) plus the embeddings on the first stage and the final
    norm and the head on the last (a tied head: the embedding's one weight)."""
    for result in results:
        expected = result["expected_bytes"]
        assert abs(result["bytes"] - expected["layers"] - expected["ends"]) <= 0.05 * expected["layers"], result


def test_pp2_moe_load_balancing_loss_and_stage_bytes() -> None:
    """qwen3_moe at pp 2 with `output_router_logits`: the routers' load-balancing loss of both stages adds up to one
    process's over every layer and the whole batch, loss and gradients; and each stage holds only what it trains."""
    results = run_ranks(pp_family, 2, "qwen3_moe", 1, 2, dict(pp_microbatches=4, clip=0.5, config=AUX))
    assert_pp_parity(results, reference_names=MOE_NAMES)
    plain = tiny_model("qwen3_moe")(**pp_batch(seq=16, seed=1)).loss.item()
    assert results[0]["expected"][0] - plain > 0.1, "the load-balancing loss must count"
    assert_stage_bytes(results)
    assert results[0]["bytes"] < 0.6 * (results[0]["bytes"] + results[1]["bytes"])


def test_a_stage_or_micro_batch_local_load_balancing_loss_is_not_one_process() -> None:
    """The control: the Switch loss is a product of means over every layer and token, so adding each stage's (its
    layers') or each micro-batch's (its rows') own loss fails the tolerance."""
    torch.manual_seed(0)
    logits, mask = (torch.randn(64, 4), torch.randn(64, 4)), torch.ones(4, 16)
    mask[1, 10:] = 0
    whole = load_balancing_loss_func(logits, 4, 2, mask).item()
    per_stage = sum(load_balancing_loss_func((x,), 4, 2, mask).item() for x in logits)
    rows = [tuple(x[i * 16 : (i + 1) * 16] for x in logits) for i in range(4)]
    per_micro_batch = sum(load_balancing_loss_func(r, 4, 2, mask[i : i + 1]).item() for i, r in enumerate(rows)) / 4
    for other in (per_stage / 2, per_micro_batch):
        assert abs(whole - other) > 100 * parity.LOSS_ATOL, (whole, other)


def test_expert_data_parallel_stays_inside_a_pipeline_stage() -> None:
    """pp 2 x tp 2 x ep 2 on 8 ranks: EP groups of consecutive ranks, expert-DP between the stage's two EP groups,
    never across stages (whose experts are other layers'); an EP group wider than a stage is refused."""
    sizes = {"pp": 2, "tp": 2, "ep": 2}
    mesh = Mesh(dense_grid(sizes, 8), experts=expert_grid(sizes, 8))
    assert mesh.rank_groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert mesh.rank_groups("ep") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert mesh.rank_groups("edp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    with pytest.raises(ValueError, match="ranks of a pipeline stage"):
        check_world({"pp": 4, "tp": 1, "ep": 4}, 8)


@pytest.mark.slow
def test_pp4_stage_bytes_with_tied_embeddings() -> None:
    """pp 4, qwen2 with tied embeddings: the middle stages hold their layer only; the first the embedding, the last
    the final norm and the tied head (the embedding's weight)."""
    config = dict(tie_word_embeddings=True, num_hidden_layers=4, layer_types=["full_attention"] * 4)
    results = run_ranks(pp_family, 4, "qwen2", 1, 4, dict(pp_microbatches=4, config=config))
    assert all(r["tied"] for r in results)
    assert_pp_parity(results, reference_names=1 + 4 * 12 + 1)
    assert_stage_bytes(results)
    assert results[1]["bytes"] == results[2]["bytes"] == results[1]["expected_bytes"]["layers"]


@pytest.mark.slow
def test_pp2_tp2_ep2_moe_with_load_balancing_loss() -> None:
    """4 ranks: each stage a TP pair whose two ranks split the experts (EP over the TP ranks, dp 1), the
    load-balancing loss on (its routers' logits read inside checkpointed layers), gradients clipped by the whole
    model's norm."""
    options = dict(pp_microbatches=4, ep_size=2, clip=0.5, checkpointing=True, config=AUX)
    results = run_ranks(pp_family, 4, "qwen3_moe", 2, 2, options)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert_pp_parity(results, reference_names=MOE_NAMES)


@pytest.mark.slow
def test_pp2_ep2_moe_with_expert_data_parallel_inside_each_stage() -> None:
    """4 ranks at tp 1: each stage's two ranks are DP replicas that split the experts (ep 2). The replicas' halves of
    the batch hold equal label counts (their mean is one process's loss) and each replica's two micro-batches
    different ones. The same layout at pp 1 (dp 2 x ep 2, 2 ranks) ends 3.2e-4 from one process on the embedding
    rows of this padded batch, at pp 1 as here (a DP x EP matter, not the pipeline's): so the pipeline is held to
    that layout's parameters within 1e-6, and every other parameter to one process's tolerance."""
    options = dict(pp_microbatches=2, ep_size=2, clip=0.5, pads=(0, 3, 0, 3))
    flat = run_ranks(pp_parity, 2, "qwen3_moe", 1, 1, options)[0]["errors"]
    results = run_ranks(pp_parity, 4, "qwen3_moe", 1, 2, options)
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    for result in results:
        assert max(abs(a - b) for a, b in zip(result["losses"], result["expected"])) < parity.LOSS_ATOL, result
        for name, error in result["errors"].items():
            assert abs(error - flat[name]) < 1e-6, (name, error, flat[name])
            assert name == "model.embed_tokens.weight" or error < parity.PARAM_ATOL, (name, error)
    assert len(set().union(*(r["errors"] for r in results))) == MOE_NAMES


@pytest.mark.slow
def test_pp2_hybrid_jamba() -> None:
    """Jamba, cut with no per-model code: a Mamba layer on the first stage, an attention layer with experts (and its
    load-balancing loss) on the last."""
    config = dict(attn_layer_offset=1, attn_layer_period=2, **AUX)
    results = run_ranks(pp_family, 2, "jamba", 1, 2, dict(pp_microbatches=4, config=config))
    assert_pp_parity(results)
    assert sum(len(r["errors"]) for r in results) == len(dict(tiny_model("jamba", **config).named_parameters()))


@pytest.mark.slow
def test_pp2_vision_language_models() -> None:
    """llava at pp 2, one image a row: the vision tower and the projector on the first stage, trained there and
    released on the last, which is given no pixels; qwen2_vl on text rows. A batch whose inputs are not per row
    (qwen2_vl's flattened patches with image_grid_thw, two images a row) is refused by name before any step."""
    results = run_ranks(pp_vlm, 2)
    llava = [r["llava"] for r in results]
    assert_pp_parity(llava)  # its tower's last layer is unused (vision_feature_layer -2): no gradient anywhere
    trained = [{name.split(".")[1] for name in r["errors"]} for r in llava]  # lm_head.weight: "weight"
    assert trained == [{"vision_tower", "multi_modal_projector", "language_model"}, {"language_model", "weight"}]
    assert_stage_bytes(llava)
    assert_pp_parity([r["qwen2_vl"] for r in results])
    refused = results[0]["refused"]
    assert "image_grid_thw" in refused["image_grid_thw"][0] and refused["image_grid_thw"][1], refused
    assert "one image a row" in refused["two images a row"][0] and refused["two images a row"][1], refused
