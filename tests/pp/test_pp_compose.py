"""Pipeline parallelism composed with FSDP2 (`autotp.fully_shard` within each stage), sequence and context
parallelism, PEFT LoRA and `AutoTPTrainer`: parity with one process.

Parity as tests/pp/test_pipeline.py's (`pp_parity`): fp32, so only the order of reductions differs: the loss within
1e-5 at every step and every parameter a stage trains within 3e-5 of one process's after 3 AdamW steps, one seed and
the same calls (`autotp.forward_backward`, `allreduce_gradients`, `clip_grad_norm_`, the step). Micro-batches hold
different label counts and the sequence length changes between steps. One spawn per layout; the 4- and 8-rank runs
are slow.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from compose_workers import counted_pp_parity, pp_cases, trainer_run
from pp_workers import LORA, assert_pp_parity, pp_parity

DP_PADS = (0, 6, 3, 3)  # each DP replica's half of the batch holds 15 + 9 = 12 + 12 labels: its mean is one process's


@pytest.mark.slow
def test_pp2_tp2_dp2_fully_shard_matches_one_process_and_reduces_once_per_step() -> None:
    """FSDP2 within each stage: its decoder layers and the root (embedding, final norm, head) sharded over the
    stage's DP group. The micro-batches' gradients are reduce-scattered once per step, on the last micro-batch's
    backward: one reduce-scatter per FSDP unit (the stage's one layer and the root) and step."""
    options = dict(pp_microbatches=2, clip=0.5, pads=DP_PADS, fully_shard=True)
    results = run_ranks(counted_pp_parity, 8, "llama", 2, 2, options)
    assert [r["stage"] for r in results] == [0] * 4 + [1] * 4
    assert_pp_parity(results, reference_names=21)
    assert all(r["reduce_scatters"] == 2 * 3 for r in results), [r["reduce_scatters"] for r in results]


FOUR_RANKS = {  # one spawn of 4 ranks for the layouts below: (family, tp, pp, options)
    "fsdp interleaved tied": (
        "qwen2",
        1,
        2,
        dict(
            pp_schedule="Interleaved1F1B",
            pp_microbatches=2,
            clip=0.5,
            pads=DP_PADS,
            fully_shard=True,
            config=dict(tie_word_embeddings=True, num_hidden_layers=4, layer_types=["full_attention"] * 4),
        ),
    ),
    "sp": ("llama", 2, 2, dict(pp_microbatches=2, sequence_parallel=True, clip=0.5)),
    "cp": ("llama", 1, 2, dict(pp_microbatches=2, cp_size=2, clip=0.5)),
    "lora tp2": ("llama", 2, 2, dict(pp_microbatches=2, clip=0.5, lora=LORA)),
}


@pytest.fixture(scope="module")
def four_ranks() -> dict[str, list[dict]]:
    results = run_ranks(pp_cases, 4, list(FOUR_RANKS.values()))
    return {name: [rank[i] for rank in results] for i, name in enumerate(FOUR_RANKS)}


@pytest.mark.slow
def test_pp2_dp2_fully_shard_interleaved_with_tied_embeddings(four_ranks: dict) -> None:
    """A looped schedule (two stages per rank share the model's root) and a tied embedding held by the first and the
    last stage, both sharded by FSDP: the tied weight's gradient shards are summed between them."""
    results = four_ranks["fsdp interleaved tied"]
    assert all(r["tied"] for r in results)
    assert_pp_parity(results, reference_names=1 + 4 * 12 + 1)


@pytest.mark.slow
def test_pp2_tp2_sequence_parallel_matches_one_process(four_ranks: dict) -> None:
    """The stages send TP's sequence chunks (the receive buffers are seq / tp long): the first stage's first layer
    splits the sequence, the last stage's last layer gathers it."""
    results = four_ranks["sp"]
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert_pp_parity(results, reference_names=21)


@pytest.mark.slow
def test_pp2_cp2_matches_one_process_and_refuses_evaluation_by_name(four_ranks: dict) -> None:
    """Each stage's forward is the model's, so context parallelism splits every micro-batch's sequence on every stage
    alike (zigzag chunks, padded: 14 tokens become 2 chunks of 4 per rank) and the stages send those chunks; the loss
    is summed over CP and divided by the whole batch's label count. Evaluation (`model(...)` under no_grad) is refused:
    CP would split the batch before the pipeline splits its rows."""
    results = four_ranks["cp"]
    assert [r["stage"] for r in results] == [0, 0, 1, 1]
    assert all("cp_size > 1" in r["eval"] for r in results), [r["eval"] for r in results]
    assert_pp_parity(results, reference_names=21, evaluated=False)


def test_pp2_lora_put_on_before_wrap_matches_one_process_peft() -> None:
    """`get_peft_model` then `autotp.wrap(peft_model.base_model.model, 1, pp_size=2)`, as at pp 1: the adapters are
    drawn for the whole model, as one process draws them; each stage trains its own layers' (the base frozen)."""
    results = run_ranks(pp_parity, 2, "llama", 1, 2, dict(pp_microbatches=4, clip=0.5, lora=LORA))
    assert [r["stage"] for r in results] == [0, 1]
    assert all(name.split(".")[4] == str(r["stage"]) for r in results for name in r["errors"]), results
    assert_pp_parity(results, reference_names=2 * 2 * 2)  # q and v of 2 layers, A and B each


@pytest.mark.slow
def test_pp2_tp2_lora_matches_one_process_peft(four_ranks: dict) -> None:
    """The stage's LoRA layers around its sharded q and v (lora_B split by rows as the base), the other stage's
    adapters left out of this rank's model."""
    assert_pp_parity(four_ranks["lora tp2"], reference_names=2 * 2 * 2)


@pytest.mark.slow
def test_trainer_at_pp2_matches_one_process_trainer(tmp_path: Path) -> None:
    """AutoTPTrainer's step drives `autotp.forward_backward`: 2 gradient accumulation steps per optimizer step, each
    one schedule over 2 micro-batches, every loss divided by the accumulation window's label tokens as Trainer
    divides one process's: each accumulation step's loss and the trained parameters of one rank's run."""
    (one,) = run_ranks(trainer_run, 1, str(tmp_path / "one"), 1)
    results = run_ranks(trainer_run, 2, str(tmp_path / "pp"), 2)
    assert len(one["losses"]) == 4, one["losses"]
    for result in results:
        assert max(abs(a - b) for a, b in zip(result["losses"], one["losses"], strict=True)) < parity.LOSS_ATOL
        errors = {n: (p - one["params"][n]).abs().max().item() for n, p in result["params"].items()}
        assert max(errors.values()) < parity.PARAM_ATOL, errors
    assert set().union(*(r["params"] for r in results)) == set(one["params"])  # every parameter, on its stage
    assert one["own loss"] is None  # at pp 1 a subclass's compute_loss runs as Trainer runs it
    for result in results:  # under a pipeline it would not: refused by name when the trainer is made
        assert "OwnLoss.compute_loss computes the loss itself" in result["own loss"], result["own loss"]
