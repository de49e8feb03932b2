"""TRL's SFTTrainer (padded and packed), DPOTrainer and GRPOTrainer through `tp_trainer(...)` under a pipeline train
as one process does: the last stage runs the trainer's own `compute_loss` per micro-batch, the metrics TRL logs come
from the whole batch's outputs. A trainer or option whose loss does not add up over micro-batches is refused by name.
The runs are in trl_pp_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from trl_pp_runs import STEPS, one_process, pipeline_runs

# GRPO's wall time. Its generation metrics, which TRL gathers over every process while each rank of a replica (its TP
# and PP ranks) repeats the replica's completions, are one process's: autotp counts each replica once
# (`integrations.replica_metrics`): the token count, the rewards' standard deviations.
GENERATION_METRICS = {"step_time"}


def _compare(ranks: list[dict], one: dict) -> dict[str, tuple[float, float, float]]:
    """Every run's losses, logs and saved weights against one process's; returns the largest gaps per run."""
    gaps = {}
    for run in ("sft", "packed", "dpo", "grpo"):
        got, expected = ranks[0][run], one[run]
        for rank in ranks[1:]:
            assert rank[run]["losses"] == got["losses"], run  # every rank returns the pipeline's broadcast loss
        steps = STEPS * (2 if run == "dpo" else 1)  # a loss per accumulation step: DPO's 2 an optimizer step
        assert len(got["losses"]) == steps and abs(got["losses"][0] - got["losses"][-1]) > 1e-3, (run, got["losses"])
        loss = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"]))
        logs = 0.0
        assert len(got["logs"]) == len(expected["logs"]) == STEPS
        for mine, theirs in zip(got["logs"], expected["logs"]):
            assert mine.keys() == theirs.keys(), run
            for name in mine.keys() - (GENERATION_METRICS if run == "grpo" else set()):
                logs = max(logs, abs(mine[name] - theirs[name]) / max(1.0, abs(theirs[name])))
        assert got["weights"].keys() == expected["weights"].keys()
        weight = max((got["weights"][k] - expected["weights"][k]).abs().max().item() for k in expected["weights"])
        gaps[run] = (loss, logs, weight)
    return gaps


def _check(ranks: list[dict], one: dict) -> None:
    gaps = _compare(ranks, one)
    print({run: tuple(f"{g:.1e}" for g in gap) for run, gap in gaps.items()})
    # fp32 throughout; the pipeline changes only where the micro-batches' token sums are added (and at tp 2 the order
    # of the sharded matmuls' reductions): loss and logged gaps are ~1e-7 of the value (observed <= 1.1e-6), weights
    # after 3 AdamW steps (lr 1e-3, GRPO's 1e-2, each step moving a weight about that) within 1e-5, at most 1% of a
    # step (observed <= 1.7e-6)
    for run, (loss, logs, weight) in gaps.items():
        assert loss <= 1e-5 and logs <= 1e-5 and weight <= 1e-5, (run, gaps)
    for key in ("mean_token_accuracy", "entropy", "num_tokens"):  # SFT's logged metrics, the whole batch's
        assert key in ranks[0]["sft"]["logs"][0]
    assert "rewards/margins" in ranks[0]["dpo"]["logs"][0]
    assert {"entropy", "reward", "clip_ratio/region_mean"} <= ranks[0]["grpo"]["logs"][0].keys()
    for rank in ranks:  # every rank of the pipeline sampled one process's completions
        assert rank["grpo"]["completions"] == one["grpo"]["completions"]


def _check_refusals(refused: dict[str, str]) -> None:
    assert "loss_type='aot'" in refused["aot"] and "does not add up over micro-batches" in refused["aot"]
    assert "loss_type='sft'" in refused["sft loss"]
    assert "top_entropy_quantile=0.5" in refused["grpo quantile"], refused["grpo quantile"]
    assert "Doubled.compute_loss computes the loss itself" in refused["subclass"], refused["subclass"]
    assert "padding_free" in refused["bfd"], refused["bfd"]
    assert "fused LM head outside a training step" in refused["evaluate"], refused["evaluate"]


@pytest.fixture(scope="module")
def one(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """TRL's own trainers in this process, once for both layouts."""
    return one_process(str(tmp_path_factory.mktemp("one")))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_sft_dpo_grpo_at_pp2_train_as_one_process(tmp_path: Path, one: dict) -> None:
    from autotp.testing.spawn import run_ranks

    ranks = run_ranks(pipeline_runs, 2, str(tmp_path / "pp"), 2, True)
    _check(ranks, one)
    _check_refusals(ranks[0]["refused"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_sft_dpo_grpo_at_pp2_tp2_train_as_one_process(tmp_path: Path, one: dict) -> None:
    from autotp.testing.spawn import run_ranks

    ranks = run_ranks(pipeline_runs, 4, str(tmp_path / "pp"), 2, False)
    _check(ranks, one)
