"""TRL's SFTTrainer and GRPOTrainer through `tp_trainer` on a MoE model at ep 2 train as one process does. The runs are
in trl_ep_runs.py (tiny qwen3_moe: hidden 64, 4 experts, top-2).

Tolerances (fp32) as in tests/ep/ep_workers.py: EP moves whole tokens and runs whole experts, so only the order of
sums changes (the experts' matmuls on other row counts, the slot sums in another association; at tp 2 the sharded
matmuls' reductions too): losses 1e-5 absolute, parameters after 3 AdamW steps 3e-5 absolute, TRL's logged metrics
1e-5 of the value (at least 1). GRPO's adapters as in test_grpo.py (1e-4, 1% of one step at lr 1e-2).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from autotp.testing import run_ranks
from autotp.testing.parity import LOSS_ATOL, PARAM_ATOL
from trl_ep_runs import STEPS, grpo_run, sft_run

pytestmark = pytest.mark.timeout(300)


def assert_close(got: dict, expected: dict) -> None:
    """Step losses, every metric TRL logged, and the parameters after the steps, within the tolerances above."""
    assert len(got["losses"]) == len(expected["losses"]) == STEPS
    loss = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"]))
    assert loss <= LOSS_ATOL, (got["losses"], expected["losses"])
    assert len(got["logs"]) == len(expected["logs"]) == STEPS
    for mine, theirs in zip(got["logs"], expected["logs"]):
        assert mine.keys() == theirs.keys()
        gaps = {k: abs(mine[k] - theirs[k]) / max(1.0, abs(theirs[k])) for k in mine}
        assert max(gaps.values()) <= 1e-5, (gaps, mine, theirs)
    worst = max(((got["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
    assert worst[0] <= PARAM_ATOL, f"{worst[1]} differs by {worst[0]:.3g} after SFT's steps"


@pytest.mark.parametrize(
    "tp,aux",
    [pytest.param(1, False, marks=pytest.mark.slow), (2, True)],  # ~20 s each
    ids=["dp2-ep2", "tp2-ep2"],
)
def test_sft_at_ep2_trains_as_one_process(tmp_path: Path, tp: int, aux: bool) -> None:
    """SFTTrainer at ep 2 on 2 ranks (dp 2, or tp 2 x dp 1), global batch 4 of ragged sequences, against TRL's own
    SFTTrainer in one process reading the same global batches. TRL turns on the MoE load-balancing loss (the config's
    coefficient, 1e-3). At dp 1 it reads every token's router statistics, as one process does. At dp 2 each replica's
    reads its own tokens' (as under DDP), which moves the router's small gradients, and AdamW's normalised steps then
    move its weights by up to 2e-3 (observed): there `router_aux_loss_coef=0.0`, and the aux loss's weight at dp 2 is
    the next test's."""
    (one,) = run_ranks(sft_run, 1, str(tmp_path / "one"), 1, 0, aux)
    assert ("aux_loss" in one["logs"][0]) == aux
    for report in run_ranks(sft_run, 2, str(tmp_path / "ep"), tp, 2, aux):
        assert_close(report, one)


@pytest.mark.slow  # TRL at dp2 x ep2 (about 3 s); TRL's SFT at ep 2 stays quick
def test_sft_load_balancing_loss_at_dp2_ep2_weighs_as_one_process(tmp_path: Path) -> None:
    """Every sequence alike, so each replica's router statistics are the whole batch's and the mean over replicas of
    their load-balancing losses is one process's. Before: AutoTPTrainer scaled TRL's SFT loss by the DP size for
    DDP's average, the aux loss TRL adds after its token sum included, so the aux loss and its gradient counted twice
    at dp 2 (this test failed with the losses 2.8e-3 apart, the gradient norm 5.07867 against 5.07859 and the router's
    weights 2e-3 apart after 3 steps); now the token count is divided by the DP size instead, and TRL adds the aux
    loss once."""
    (one,) = run_ranks(sft_run, 1, str(tmp_path / "one"), 1, 0, True, True)
    for report in run_ranks(sft_run, 2, str(tmp_path / "ep"), 1, 2, True, True):
        assert_close(report, one)


@pytest.mark.slow  # GRPO generates on 2 ranks and in one process: ~60 s on the loaded 2-core machine
def test_grpo_with_attention_lora_at_tp2_ep2_samples_and_trains_as_one_process(tmp_path: Path) -> None:
    """GRPOTrainer at tp 2 x ep 2 on 2 ranks (dp 1: both ranks sample the same completions from the shared stream;
    LoRA on attention, as adapters on the experts are refused), against plain GRPOTrainer in one process. As in
    test_grpo.py, steps compare where the completions equal one process's (fp32 noise may flip a draw)."""
    (one,) = run_ranks(grpo_run, 1, str(tmp_path / "one"), 1, 0)
    ranks = run_ranks(grpo_run, 2, str(tmp_path / "ep"), 2, 2)
    assert ranks[0]["completions"] == ranks[1]["completions"]
    for rank in ranks:  # TRL calls generate with its own arguments; autotp's default reaches transformers
        assert rank["synced"] == [True] * STEPS, rank["synced"]
    got = ranks[0]
    agree = [s for s in range(STEPS) if got["completions"][s] == one["completions"][s]]
    assert len(agree) >= STEPS - 1, (got["completions"], one["completions"])
    gaps = {"loss": max(abs(got["losses"][s] - one["losses"][s]) for s in agree)}
    for name in ("kl", "entropy", "grad_norm"):
        gaps[name] = max(
            abs(got["logs"][s][name] - one["logs"][s][name]) / max(1.0, abs(one["logs"][s][name])) for s in agree
        )
    print(f"GRPO at tp 2 x ep 2: {len(agree)} of {STEPS} steps sampled alike; largest gaps {gaps}")
    assert max(gaps.values()) <= 1e-5, gaps
    assert max(abs(log["kl"]) for log in got["logs"]) > 1e-2  # it trained away from the reference
    if len(agree) == STEPS:  # observed 1e-6
        gap = max((got["adapters"][n] - p).abs().max().item() for n, p in one["adapters"].items())
        assert got["adapters"].keys() == one["adapters"].keys() and gap <= 1e-4, gap


@pytest.mark.slow  # two GRPO runs on 2 ranks: ~55 s
def test_grpo_at_dp2_ep2_keeps_a_rank_whose_completions_ended_stepping(tmp_path: Path) -> None:
    """At dp 2 x ep 2 each replica generates for its own prompts, so one rank's completions can end first; its EP peer
    still needs it in every step's all-to-all. One greedy step records each rank's completion; then the end-of-text
    token becomes one that rank 0 generates first and rank 1 never: rank 0 stops after one token, rank 1 generates
    all 8, and the step completes (with `synced_gpus=False` forced, rank 0 went on to TRL's gather while rank 1 waited
    in the all-to-all, and the run failed at the 60 s collective timeout: checked by hand)."""
    first = run_ranks(grpo_run, 2, str(tmp_path / "first"), 1, 2, 1)
    ours, theirs = (rank["completions"][0][0] for rank in first)
    eos = ours[0]
    assert eos not in theirs and len(ours) == len(theirs) == 8, (ours, theirs)
    second = run_ranks(grpo_run, 2, str(tmp_path / "second"), 1, 2, eos)
    assert second[0]["completions"][0] == [[eos], [eos]]
    assert second[1]["completions"][0] == first[1]["completions"][0]  # all 8 tokens, as before
    assert all(rank["synced"] == [True] for rank in second)
