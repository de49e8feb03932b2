"""Pipeline parallelism's edges, each against one process (plain transformers, same seed, same calls) or refused by
name on every rank before anything changes: bf16 (training, evaluation, generate) at pp 2, pp 2 x tp 2, pp 2 x dp 2,
pp 4 and Interleaved1F1B;
a stage with nothing to train under `clip_grad_norm_`; `return_dict=False`; AutoTPTrainer's `evaluate` and its
batches that do not split into the micro-batches; batches that differ between stages (check_inputs=True);
`resize_token_embeddings`; a compiled model; OPT's final norm on the last stage; Llama-4; ranks that disagree on
pp_size; sequence parallelism's padding.

bf16's tolerance: one process in bf16 against its own fp32 run gives a yardstick d per metric (the loss of every
step, the parameters after 3 AdamW steps, the evaluated loss and logits, generate's logits); the pipeline in bf16 must
be within 3 d of one process in bf16. Both bf16 runs round at the same places; the pipeline's sums differ in order
(gradients accumulated over micro-batches in bf16, the loss summed over them), and each such rounding is of the size
that separates bf16 from fp32: two runs each about d from fp32 are within 2 d of each other by the triangle
inequality, and 3 d leaves room for AdamW's near-sign steps, which turn one-ulp gradient differences into one-ulp
weight differences. A real error (a mean of micro-batch means: 1e-2 on the loss) is far outside it. Greedy tokens are
equal. fp32 cases hold the fp32 tolerances (`autotp.testing.parity`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers as tf

from autotp.pp.chain import check_chain
from autotp.pp.cut import find_cut, owner
from autotp.testing import parity, tiny_config
from autotp.testing.spawn import run_ranks
from edge_workers import BF16_METRICS, one_process_evaluation, pp2_edges, pp4_edges
from models import tiny_model
from pp_workers import assert_pp_parity

BF16_FACTOR = 3  # see the module's docstring


@pytest.fixture(scope="module")
def pp2(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_ranks(pp2_edges, 2, str(tmp_path_factory.mktemp("pp2")))


def assert_bf16_parity(report: dict) -> None:
    for name in BF16_METRICS:
        yardstick, error = report[name]
        assert 0 < yardstick and error <= BF16_FACTOR * yardstick, (name, error, yardstick)
    assert report["tokens"]["wrapped"] == report["tokens"]["bf16"], report["tokens"]
    assert report["trained"], report  # every rank's stage trained something


def test_bf16_at_pp2_trains_evaluates_and_generates_within_bf16_noise(pp2: list[dict]) -> None:
    for report in pp2:
        assert_bf16_parity(report["bf16"])


@pytest.mark.slow  # 4 ranks; pp 2 keeps the quick test above
def test_bf16_at_pp2_tp2_pp2_dp2_pp4_and_interleaved_within_bf16_noise_and_sp_padding_refused_on_every_rank() -> None:
    reports = run_ranks(pp4_edges, 4)
    for report in reports:
        for layout in ("tp", "dp", "pp4", "interleaved dp"):
            assert_bf16_parity(report[layout])
        message, untouched = report["sp"]
        assert "sequence_parallel needs the sequence length (15) to be a multiple of tp_size=2" in message
        assert "pad_to_multiple_of=2" in message and untouched, report["sp"]


@pytest.mark.parametrize("case", ["frozen", "lora"])
def test_a_stage_with_nothing_to_train_clips_as_one_process(pp2: list[dict], case: str) -> None:
    """Before, that stage's rank returned before the norm's all-reduce and the other waited 60 s."""
    for report in pp2:
        result = report["frozen"][case]
        for got, expected in result["norms"]:
            assert expected > 1e-3 and abs(got - expected) < 1e-5 * expected, result["norms"]  # clipped
        assert all(error < parity.PARAM_ATOL for error in result["errors"].values()), result["errors"]
    idle = 0 if case == "frozen" else 1  # the stage with nothing to train: no parameter of its trained
    assert not pp2[idle]["frozen"][case]["errors"] and pp2[1 - idle]["frozen"][case]["errors"]


def test_return_dict_false_gives_one_process_tuple(pp2: list[dict]) -> None:
    for report in pp2:
        kind, length, loss, logits = report["tuple"]
        assert (kind, length) == ("tuple", 2), report["tuple"]
        assert loss < parity.LOSS_ATOL and logits < 1e-4, report["tuple"]


def test_trainer_evaluate_matches_one_process_trainer(pp2: list[dict], tmp_path: Path) -> None:
    """A compute_metrics that reads the logits; 10 rows in batches of 4, 4 and 2 (the evaluation runs any row count)."""
    (expected,) = run_ranks(one_process_evaluation, 1, str(tmp_path))
    for report in pp2:
        got = report["trainer"]["evaluate"]
        for key in ("eval_loss", "eval_log_likelihood"):
            assert abs(got[key] - expected[key]) < parity.LOSS_ATOL, (key, got, expected)


def test_trainer_refuses_a_short_last_batch_before_the_first_step(pp2: list[dict]) -> None:
    """Before, it failed after 2 steps, naming the schedule's micro-batches and not dataloader_drop_last. With a
    sampler of no known length it fails at that batch (after 2 steps), naming it."""
    for report in pp2:
        message, untouched = report["trainer"]["short batch"]
        assert "dataloader_drop_last=True" in message and "pp_microbatches=4" in message, message
        assert "a training batch of 2 rows" in message and "per_device_train_batch_size=4" in message, message
        assert untouched, message
        message, steps = report["trainer"]["unsized short batch"]
        assert "a training batch of 2 rows (this batch" in message and "dataloader_drop_last=True" in message, message
        assert steps == 2, steps


def test_stages_fed_different_batches_are_named_on_every_rank(pp2: list[dict]) -> None:
    for report in pp2:
        for call in ("forward_backward", "evaluate"):
            message, untouched = report["refused"][call]
            assert "pipeline-parallel ranks got different inputs: input_ids=" in message, message
            assert "every rank of a pipeline must read the same whole batch" in message and untouched


def test_resize_token_embeddings_is_refused_before_anything_changes(pp2: list[dict]) -> None:
    for report in pp2:
        message, unchanged = report["refused"]["resize"]
        assert "resize_token_embeddings at pp_size=2" in message and "before autotp.wrap" in message, message
        assert unchanged


def test_forward_backward_of_a_compiled_model_names_the_fix(pp2: list[dict]) -> None:
    for report in pp2:
        message, untouched = report["refused"]["compile"]
        assert "forward_backward(torch.compile(model))" in message and "layer.compile()" in message, message
        assert untouched


def test_opt_trains_at_pp2_with_its_final_norm_on_the_last_stage(pp2: list[dict]) -> None:
    """OPT registers its final_layer_norm before its layers and runs it after: the last stage's."""
    assert_pp_parity([report["opt"] for report in pp2])
    model = tiny_model("opt")
    stage = owner(model, find_cut(model, 2, None))
    assert stage("model.decoder.final_layer_norm.weight") == 1 and stage("model.decoder.embed_positions.weight") == 0


def test_opt_with_a_projection_is_refused_naming_it() -> None:
    model = tiny_model("opt", word_embed_proj_dim=32)
    with pytest.raises(NotImplementedError, match="project_in, word_embed_proj_dim != hidden_size"):
        check_chain(model, find_cut(model, 2, None), 2)


def test_llama4_text_trains_at_pp2_and_its_conditional_generation_class_names_it(pp2: list[dict]) -> None:
    """Llama4ForCausalLM's base_model_prefix names no child: its decoder model is its one child holding the
    embedding. Llama4ForConditionalGeneration (vision and text) is refused naming the text-only class."""
    for report in pp2:
        parity.assert_parity(report["llama4"])
    model = tf.Llama4ForConditionalGeneration(tiny_config("llama4"))
    with pytest.raises(NotImplementedError, match="train the text model alone as Llama4ForCausalLM"):
        find_cut(model, 2, None)


def test_ranks_that_disagree_on_pp_size_name_both_sizes(pp2: list[dict]) -> None:
    """Rank 1 at pp 1 runs no collective and goes on alone; rank 0, at pp 2, names its own sizes and the likely other."""
    waiting, alone = (report["pp_size"] for report in pp2)
    assert alone == "wrapped"
    assert "this rank called wrap with tp_size=1, cp_size=1, ep_size=1, pp_size=2" in waiting, waiting
    assert "a rank at tp_size=1, cp_size=1, ep_size=1 and pp_size=1 without tp_group runs no collective" in waiting
