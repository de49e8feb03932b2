"""TRL's DPOTrainer and RLOOTrainer at tp=2 with `vocab_parallel=True` train as one process does: TRL's fused LM head
becomes autotp's (per-token log-probabilities from the vocabulary shards), and no rank ever holds a tensor as wide as
the whole vocabulary while scoring and training. The runs are in trl_runs.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trl_runs import STEPS, TP, dpo_run, rloo_refusals, rloo_run

VOCAB = 256  # examples/train_trainer.py's tiny Llama
AUTOTP_HEAD = "_fused_forward.<locals>.forward"  # autotp.integrations.fused_head's forward, in place of TRL's


def assert_no_whole_vocabulary(ranks: list[dict], one: dict) -> None:
    """Every rank created tensors with its 128 vocabulary rows and none with all 256; one process, with TRL's own
    fused head, does create some (so the probe sees logits where they exist)."""
    for rank in ranks:
        assert VOCAB // TP in rank["dims"] and VOCAB not in rank["dims"], sorted(rank["dims"])
    assert VOCAB in one["dims"]


def assert_logs_close(got: list[dict], expected: list[dict], skip: set[str], relative: float) -> dict[str, float]:
    """TRL's per-step logs equal within `relative` (of the value, at least 1); returns the largest gap per name."""
    assert len(got) == len(expected) == STEPS
    gaps: dict[str, float] = {}
    for mine, theirs in zip(got, expected):
        assert mine.keys() == theirs.keys()
        for name in mine.keys() - skip:
            gap = abs(mine[name] - theirs[name]) / max(1.0, abs(theirs[name]))
            gaps[name] = max(gaps.get(name, 0.0), gap)
    assert max(gaps.values()) <= relative, (gaps, got, expected)
    return gaps


def weight_gap(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert got.keys() == expected.keys()
    return max((got[k] - expected[k]).abs().max().item() for k in expected)


@pytest.mark.timeout(240)
def test_dpo_with_vocab_parallel_head_at_tp2_trains_as_one_process(tmp_path: Path) -> None:
    from autotp.testing.spawn import run_ranks

    ranks = run_ranks(dpo_run, TP, str(tmp_path / "tp"))
    one = dpo_run(0, 1, str(tmp_path / "one"))  # plain DPOTrainer, TRL's own fused head, full-vocabulary logits
    for rank in ranks:  # policy and reference both score through autotp's fused head
        assert rank["forwards"] == [AUTOTP_HEAD, AUTOTP_HEAD]
    assert_no_whole_vocabulary(ranks, one)
    assert ranks[0]["losses"] == ranks[1]["losses"]
    # fp32 throughout; tp=2 changes only the order of the vocabulary sums (one all-reduce of two halves) and of the
    # sharded matmuls' reductions: observed gaps ~1e-7 in losses and rewards, ~1e-6 of the summed log-probs (~-30)
    loss_gap = max(abs(a - b) for a, b in zip(ranks[0]["losses"], one["losses"]))
    assert loss_gap <= 1e-6, (ranks[0]["losses"], one["losses"])
    assert abs(ranks[0]["losses"][0] - ranks[0]["losses"][-1]) > 1e-2  # it trained: not a flat curve
    # every metric DPO logs (rewards/*, logps/*, logits/* from mean_logits, mean_token_accuracy from is_top1,
    # entropy, grad_norm, and num_tokens, which TRL divides by autotp's TP size)
    gaps = assert_logs_close(ranks[0]["logs"], one["logs"], set(), 1e-5)
    assert {"rewards/margins", "logps/chosen", "logits/rejected", "mean_token_accuracy", "entropy"} <= gaps.keys()
    # the full weights save_model wrote: Adam at lr=1e-3 moves a weight ~1e-3 a step; 1e-5 is 1% of that (observed 2e-7)
    gap = weight_gap(ranks[0]["weights"], one["weights"])
    print(
        f"DPO at tp=2, vocab-parallel: loss gap {loss_gap:.1e}, largest log gap {max(gaps.values()):.1e}, "
        f"weight gap {gap:.1e}"
    )
    assert gap <= 1e-5


@pytest.mark.timeout(120)
def test_rloo_refuses_normalize_advantages_at_tp2(tmp_path: Path) -> None:
    """RLOO's normalize_advantages takes a std over the rewards of every process, where each TP rank repeats its
    replica's: Bessel's correction over tp copies changes every advantage. Refused by name at construction."""
    from autotp.testing.spawn import run_ranks

    for message in run_ranks(rloo_refusals, TP, str(tmp_path)):
        assert "normalize_advantages=True" in message and "normalize_advantages=False" in message, message


@pytest.mark.slow  # generation on 2 ranks and one process: 5 s idle, 30 s on the loaded 2-core machine
@pytest.mark.timeout(300)
def test_rloo_with_vocab_parallel_head_at_tp2_samples_and_trains_as_one_process(tmp_path: Path) -> None:
    from autotp.testing.spawn import run_ranks

    ranks = run_ranks(rloo_run, TP, str(tmp_path / "tp"))
    one = rloo_run(0, 1, str(tmp_path / "one"))
    assert ranks[0]["forwards"] == ranks[1]["forwards"] == [AUTOTP_HEAD]
    # generation (paused in the probe) samples from whole-vocabulary logits of the last position, as any engine does;
    # scoring the completions (old, reference and trained log-probs) and the backward never widen to the vocabulary
    assert_no_whole_vocabulary(ranks, one)

    # The TP ranks share the sampling stream, so they sample alike; one process samples the same completions unless
    # fp32 reduction-order noise flips a draw (as in test_grpo.py); steps compare where they agree
    assert ranks[0]["completions"] == ranks[1]["completions"] and len(one["completions"]) == STEPS
    agree = [s for s in range(STEPS) if ranks[0]["completions"][s] == one["completions"][s]]
    assert len(agree) >= STEPS - 1, (ranks[0]["completions"], one["completions"])
    # RLOO's loss is ~0 at every step (leave-one-out advantages sum to zero in each group and the ratio is 1 with one
    # update per batch); its gradient is not, so grad_norm, the KL to the reference and the entropy carry the parity.
    # Left out: num_tokens (Trainer counts each TP rank's tokens) and the reward stds (Bessel's correction over the
    # rewards of every process, tp copies each): logged only, they do not enter the loss
    skip = {"step_time", "num_tokens", "reward_std", "rewards/low_tokens/std"}
    got, expected = [ranks[0]["logs"][s] for s in agree], [one["logs"][s] for s in agree]
    assert len(got) == len(expected) and all(a.keys() == b.keys() for a, b in zip(got, expected))
    gaps = {
        name: max(abs(a[name] - b[name]) / max(1.0, abs(b[name])) for a, b in zip(got, expected))
        for name in got[0].keys() - skip
    }
    print(f"RLOO at tp=2, vocab-parallel: {len(agree)} of {STEPS} steps sampled alike; largest log gaps {gaps}")
    assert max(gaps.values()) <= 1e-5, gaps  # fp32, reduction order only: observed ~1e-6 (grad_norm ~10)
    assert max(abs(log["kl"]) for log in got) > 1e-2 and min(log["grad_norm"] for log in got) > 1e-1

    if len(agree) == STEPS:  # the same data throughout: PEFT's full-size adapters equal one process's
        # Adam normalises each gradient, so reduction-order noise in small ones moves a weight by up to ~1e-5 over
        # the run; 1e-4 is 1% of one step (lr=1e-2), as in test_grpo.py (observed 2e-5)
        gap = weight_gap(ranks[0]["weights"], one["weights"])
        print(f"largest adapter difference from one process: {gap:.1e}")
        assert gap <= 1e-4
