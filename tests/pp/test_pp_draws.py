"""Random draws under a pipeline: dropout (GPT-2's, LoRA's) and mixtral's router jitter train at pp 2, seeded per
stage and micro-batch (`autotp.pp.draws`).

One process draws one mask over the whole batch, which a pipeline's micro-batches cannot reproduce, so these runs
are not compared with one process's numbers. What is checked instead, each run 3 AdamW steps on one batch, seeded
alike after wrap: a run repeats itself bit for bit (losses and parameters), and so does the same run under
activation checkpointing (its recomputation draws the masks its forward drew); the masks are applied (the losses and
parameters differ from the same run without dropout or jitter) and training goes on (finite losses, falling on the
repeated batch), LoRA with lora_dropout=0.05 included; with dropout configured but the models in eval mode, parity
with one process holds as at every pp 2 layout (loss within 1e-5, parameters within 3e-5, `pp_parity`); a step's
counting pass for the load-balancing loss routes as its training pass does (every router's logits bit for bit: the
same jitter); a run that draws nothing leaves the random stream as one process leaves it. At pp 2 x tp 2 (slow),
the TP ranks of a stage draw the same masks: their replicated tensors stay bit-identical (`autotp.check_replicas`),
for GPT-2's dropout, mixtral's jitter and LoRA's dropout; runs repeat, and under GPipe as under 1F1B (the draws do
not depend on the schedule's order).
"""

from __future__ import annotations

import math

import pytest
import torch

from autotp.testing.spawn import run_ranks
from pp_draws_workers import four_ranks, quick
from pp_workers import assert_pp_parity


def same(a: dict, b: dict) -> bool:
    """Two runs' losses and parameters, bit for bit."""
    return (
        a["losses"] == b["losses"]
        and a["params"].keys() == b["params"].keys()
        and all(torch.equal(t, b["params"][n]) for n, t in a["params"].items())
    )


def applied(run: dict, without: dict) -> bool:
    """The draws changed the run (losses and parameters), and it trains: finite losses, falling on its batch."""
    losses = run["losses"]
    differs = any(not torch.equal(t, without["params"][n]) for n, t in run["params"].items())
    return differs and losses != without["losses"] and all(map(math.isfinite, losses)) and losses[-1] < losses[0]


def test_pp2_dropout_and_router_jitter_train_seeded_per_stage_and_micro_batch() -> None:
    results = run_ranks(quick, 2)
    for rank in results:
        assert same(rank["gpt2"], rank["gpt2 again"]) and same(rank["gpt2"], rank["gpt2 checkpointed"])
        assert applied(rank["gpt2"], rank["gpt2 p=0"]), (rank["gpt2"]["losses"], rank["gpt2 p=0"]["losses"])
        moved = [rank[label]["stream moved"] for label in ("gpt2", "gpt2 p=0", "mixtral", "mixtral no jitter")]
        assert moved == [True, False, True, False], moved  # without draws, the stream is left as one process leaves it
        assert (
            all(map(math.isfinite, rank["lora"]["losses"])) and rank["lora"]["losses"][-1] < rank["lora"]["losses"][0]
        )
        assert same(rank["mixtral"], rank["mixtral again"])
        assert applied(rank["mixtral"], rank["mixtral no jitter"])
        counted, trained = rank["routed"]["counted"], rank["routed"]["trained"]
        assert len(counted) == len(trained) == 2 and all(torch.equal(a, b) for a, b in zip(counted, trained))
    assert_pp_parity([rank["gpt2 eval"] for rank in results])


@pytest.mark.slow
def test_pp2_tp2_dropout_and_router_jitter_draw_alike_on_a_stages_tp_ranks() -> None:
    for rank in run_ranks(four_ranks, 4):
        for label in ("gpt2", "mixtral", "lora"):
            assert rank[label]["replicas"] == "equal", (label, rank[label]["replicas"])
            assert same(rank[label], rank[f"{label} again"]), label
        assert same(rank["gpt2"], rank["gpt2 GPipe"])
