"""Pipeline parallelism (wrap(..., pp_size=P), `autotp.forward_backward`): parity with one process, the loss over
micro-batches of different label counts, tied embeddings, and the refusals.

Parity as the other parity tests: fp32, so only the order of reductions differs: the loss within 1e-5 at every step
and every parameter a stage trains within 3e-5 of one process's after 3 AdamW steps, both runs from one seed through
the same calls (`autotp.forward_backward`, then `allreduce_gradients` and the step). The batches have 4 rows right-padded
by different amounts (labels -100), and the sequence length changes from step to step. The fast tier runs llama at
pp 2 with 4 micro-batches (one row each, so each holds another label count); the other layouts are slow.
"""

from __future__ import annotations

import pytest

from autotp.pp.cut import bounds, find_cut, owner
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import tiny_model
from pp_workers import assert_pp_parity, micro_batch_means, pp_parity, pp_refusals


def test_pp2_llama_matches_one_process_over_micro_batches_of_different_label_counts() -> None:
    results = run_ranks(pp_parity, 2, "llama", 1, 2, dict(pp_microbatches=4, clip=0.5))
    assert [r["stage"] for r in results] == [0, 1] and all(len(r["norms"]) == 3 for r in results)
    assert_pp_parity(results, reference_names=21)  # llama, 2 layers: 9 each, embedding, norm, head


@pytest.mark.slow  # 35 s on 2 CPU cores: the compile; pipeline parity itself has the fast test above
def test_pp2_llama_with_compiled_decoder_layers_matches_one_process() -> None:
    """`layer.compile()` on each decoder layer after wrap, as benchmarks/gpu.py does; one process runs eagerly."""
    assert_pp_parity(run_ranks(pp_parity, 2, "llama", 1, 2, dict(pp_microbatches=4, compile=True)), 21)


def test_a_mean_of_micro_batch_means_fails_the_tolerance() -> None:
    """The control: the same micro-batches averaged per micro-batch are not one process's loss."""
    whole, mean_of_means = micro_batch_means()
    assert abs(whole - mean_of_means) > 100 * parity.LOSS_ATOL, (whole, mean_of_means)


def test_the_cost_model_counts_the_embedding_and_the_head_as_layers() -> None:
    assert bounds(4, 2) == (0, 2, 4)  # embedding + 2 layers | 2 layers + head
    assert bounds(6, 2) == (0, 3, 6)
    assert bounds(8, 4) == (0, 2, 4, 7, 8)  # 3 | 2 | 3 | 2 units
    assert bounds(6, 3, (1, 4)) == (0, 1, 4, 6)  # the user's split points
    with pytest.raises(ValueError, match="pp_split_points"):
        bounds(6, 3, (4, 1))


def test_pp2_refuses_by_name_before_the_model_changes() -> None:
    refused = run_ranks(pp_refusals, 2)[0]
    expected = {
        "ep_size": "expert parallelism",
        "pp_schedule": "choose one of torch's schedules",
        "output_router_logits": "load-balancing loss",
        "inline loss": "computes the loss itself",
        "t5": "encoder-decoder",
        "pp_split_points": "pp_split_points",
        "pp_stages_per_rank": "looped schedule",
        "forward": "autotp.forward_backward",
        "cu_seq_lens_q": "split by rows",
        "peft after wrap": "PEFT",
    }
    for name, words in expected.items():
        message, unchanged = refused[name]
        assert words in message and unchanged, (name, message)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["GPipe", "Interleaved1F1B"])
def test_pp2_schedules(schedule: str) -> None:
    config = dict(num_hidden_layers=4)
    assert_pp_parity(
        run_ranks(pp_parity, 2, "llama", 1, 2, dict(pp_schedule=schedule, pp_microbatches=4, config=config))
    )


@pytest.mark.slow
def test_pp2_interleaved_with_three_stages_per_rank() -> None:
    options = dict(pp_schedule="Interleaved1F1B", pp_stages_per_rank=3, pp_microbatches=4)
    results = run_ranks(pp_parity, 2, "llama", 1, 2, dict(options, config=dict(num_hidden_layers=6)))
    layers = [{name.split(".")[2] for name in r["errors"] if name.startswith("model.layers.")} for r in results]
    assert layers == [{"0", "2", "4"}, {"1", "3", "5"}]  # looped: rank r runs stages r, r + 2, r + 4
    assert_pp_parity(results, reference_names=2 + 6 * 9 + 1)


@pytest.mark.slow
def test_pp2_user_split_points() -> None:
    options = dict(pp_microbatches=4, pp_split_points=(1,), config=dict(num_hidden_layers=4))
    results = run_ranks(pp_parity, 2, "llama", 1, 2, options)
    layers = [{name.split(".")[2] for name in r["errors"] if name.startswith("model.layers.")} for r in results]
    assert layers == [{"0"}, {"1", "2", "3"}]
    assert_pp_parity(results, reference_names=2 + 4 * 9 + 1)


@pytest.mark.slow
def test_pp2_tied_embeddings_stay_equal_and_match_one_process() -> None:
    """qwen2 with tied embeddings: the first stage's embedding and the last stage's head are one weight on each, and
    their gradients are summed between them, so both equal one process's weight after every step."""
    tied = dict(tie_word_embeddings=True)
    results = run_ranks(pp_parity, 2, "qwen2", 1, 2, dict(pp_microbatches=4, clip=0.5, config=tied))
    assert all(r["tied"] for r in results)
    assert_pp_parity(results)
    assert "model.embed_tokens.weight" in results[0]["errors"] and "model.embed_tokens.weight" in results[1]["errors"]


@pytest.mark.slow
def test_pp2_tp2_llama_matches_one_process() -> None:
    results = run_ranks(pp_parity, 4, "llama", 2, 2, dict(pp_microbatches=2))
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert_pp_parity(results, reference_names=21)


@pytest.mark.slow
def test_pp2_with_activation_checkpointing() -> None:
    assert_pp_parity(run_ranks(pp_parity, 2, "llama", 1, 2, dict(pp_microbatches=2, checkpointing=True)))


@pytest.mark.slow
def test_pp2_gemma_scales_its_embeddings_inside_the_embedding_and_ties_them() -> None:
    results = run_ranks(pp_parity, 2, "gemma", 1, 2, dict(pp_microbatches=4))
    assert all(r["tied"] for r in results)
    assert_pp_parity(results, reference_names=1 + 2 * 9 + 1)


@pytest.mark.slow
@pytest.mark.parametrize("pp", [2, 4])
def test_gpt2_learned_positions_and_conv1d(pp: int) -> None:
    """GPT-2 adds its learned position embedding in the decoder model's forward: every stage computes it, the first
    trains it; its embeddings are tied."""
    results = run_ranks(pp_parity, pp, "gpt2", 1, pp, dict(pp_microbatches=4, clip=0.5, config=dict(n_layer=4)))
    assert all(r["tied"] for r in results)
    assert_pp_parity(results, reference_names=2 + 4 * 12 + 2)  # wte and wpe, 12 per block, ln_f


@pytest.mark.slow
def test_pp4_tied_embeddings_across_four_stages() -> None:
    """pp 4: the tied embedding's group is the first and the last rank only; the middle stages hold no part of it."""
    config = dict(tie_word_embeddings=True, num_hidden_layers=6, layer_types=["full_attention"] * 6)
    results = run_ranks(pp_parity, 4, "qwen2", 1, 4, dict(pp_microbatches=4, clip=0.5, config=config))
    assert [r["stage"] for r in results] == [0, 1, 2, 3]
    assert_pp_parity(results, reference_names=1 + 6 * 12 + 1)  # one tied weight, 12 per layer, the norm


@pytest.mark.slow
def test_pp2_dp2_llama_matches_one_process() -> None:
    """Each replica takes half the rows; the halves hold equal label counts (15 + 9 and 12 + 12), so the replicas'
    average is one process's mean, while the micro-batches inside each replica still differ."""
    results = run_ranks(pp_parity, 4, "llama", 1, 2, dict(pp_microbatches=2, clip=0.5, pads=(0, 6, 3, 3)))
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert_pp_parity(results, reference_names=21)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_parameter_has_one_owning_stage(family: str) -> None:
    """The embeddings belong to the first stage, a layer to its stage, the final norm and the head to the last."""
    model = tiny_model(family)
    cut = find_cut(model, 2, None)
    stage = owner(model, cut)
    owners = {name: stage(name) for name in model.state_dict()}
    embedding = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
    assert owners[f"{embedding}.weight"] == 0 and owners["lm_head.weight"] == 1, owners
    root = f"{cut.base}.{cut.layers}"
    assert {owners[n] for n in owners if n.startswith(f"{root}.0.")} == {0}, owners
    assert {owners[n] for n in owners if n.startswith(f"{root}.1.")} == {1}, owners
    final = [n for n in owners if n.startswith(cut.base) and not n.startswith((root, embedding))]
    assert final and all(owners[n] == (0 if ".wpe." in n else 1) for n in final), owners
