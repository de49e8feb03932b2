"""Training checkpoints resume at any layout: 3 AdamW steps at one tp x dp, save, 3 more at another, equal 6 straight
steps in one process.

The global batch is the same 4 rows at every layout (each DP replica takes its rows), so every layout computes one
process's steps. Tolerances as in test_parity (fp32, only the order of sums differs): loss 1e-5, parameters after
the AdamW steps 3e-5. The one-process reference is built as a user would (same seed, same calls), not copied; a
StepLR scheduler halves the learning rate every 2 steps, so a lost scheduler shows too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import autotp
from autotp.testing.parity import LOSS_ATOL, PARAM_ATOL
from autotp.testing.spawn import run_ranks
from resume_workers import (
    check_resume,
    first_half,
    full_params,
    resume_model,
    resume_steps,
    resume_training,
    second_half,
    straight_run,
)

LAYOUTS = {  # label -> (world, tp, fully_shard)
    "tp=4": (4, 4, False),
    "tp=1 x dp=2": (2, 1, False),
    "tp=2 x dp=1": (2, 2, False),
    "tp=2 x dp=2, fully_shard": (4, 2, True),
}


def test_saved_at_tp2_resumes_in_one_process_and_at_dp2(tmp_path: Path) -> None:
    """The fast tier's case: Llama saved at tp=2, resumed at tp=1 x dp=2 and in one process without
    torch.distributed; loading without the optimizer state is far off (this test sees a dropped state)."""
    path = str(tmp_path / "ckpt")
    expected = straight_run("llama")
    halves = run_ranks(first_half, 2, "llama", 2, False, path)
    assert max(abs(a - b) for a, b in zip(halves[0], expected["losses"][:3])) <= LOSS_ATOL
    check_resume(second_half(0, 1, "llama", 0, False, path), expected, "one process")
    for report in run_ranks(second_half, 2, "llama", 1, False, path):
        check_resume(report, expected, "tp=1 x dp=2")


def without_optimizer_state(path: str) -> dict[str, torch.Tensor]:
    model = resume_model("llama", seed=7)
    optimizer, scheduler = resume_training(model)
    autotp.load_checkpoint(path, model, None, scheduler)  # Adam's moments and step left out
    resume_steps(model, optimizer, scheduler, 3)
    return full_params(model)


def test_a_resume_without_the_optimizer_state_is_far_off(tmp_path: Path) -> None:
    """What the parity tests would see if the optimizer state were dropped: far beyond their tolerance."""
    path = str(tmp_path / "ckpt")
    expected = straight_run("llama")
    run_ranks(first_half, 2, "llama", 2, False, path)
    params = without_optimizer_state(path)
    worst = max((params[n] - p).abs().max().item() for n, p in expected["params"].items())
    assert worst > 10 * PARAM_ATOL, f"a resume without Adam's moments came within {worst:.3g}: the test cannot see it"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "gemma", "qwen3_moe", "lora"])
def test_saved_at_tp2_dp2_resumes_at_every_layout(tmp_path: Path, kind: str) -> None:
    path = str(tmp_path / "ckpt")
    expected = straight_run(kind)
    halves = run_ranks(first_half, 4, kind, 2, False, path)
    assert max(abs(a - b) for a, b in zip(halves[0], expected["losses"][:3])) <= LOSS_ATOL
    check_resume(second_half(0, 1, kind, 0, False, path), expected, "one process")
    for label, (world, tp, fsdp) in LAYOUTS.items():
        if fsdp and kind == "lora":
            continue  # PEFT adapters under autotp.fully_shard are refused (tests/dp/test_fsdp.py)
        for report in run_ranks(second_half, world, kind, tp, fsdp, path):
            check_resume(report, expected, label)


@pytest.mark.slow
def test_saved_under_fully_shard_resumes_without_it_and_at_tp4(tmp_path: Path) -> None:
    """The other direction: saved at tp=2 x dp=2 under fully_shard (each rank its DP rows of its TP shard)."""
    path = str(tmp_path / "ckpt")
    expected = straight_run("llama")
    run_ranks(first_half, 4, "llama", 2, True, path)
    check_resume(second_half(0, 1, "llama", 0, False, path), expected, "one process")
    for report in run_ranks(second_half, 4, "llama", 4, False, path):
        check_resume(report, expected, "tp=4")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "phi3"])
def test_fused_projections_save_and_resume_under_fully_shard(tmp_path: Path, kind: str) -> None:
    """Fused projections at tp=2 x dp=2 under fully_shard: a rank's runs of full rows (q, k, v; gate, up) lie partly
    past its FSDP rows, so some of them it holds none of. Saved and loaded at that layout, and loaded in one process."""
    path = str(tmp_path / "ckpt")
    expected = straight_run(kind)
    halves = run_ranks(first_half, 4, kind, 2, True, path)
    assert max(abs(a - b) for a, b in zip(halves[0], expected["losses"][:3])) <= LOSS_ATOL
    check_resume(second_half(0, 1, kind, 0, False, path), expected, "one process")
    for report in run_ranks(second_half, 4, kind, 2, True, path):
        check_resume(report, expected, "tp=2 x dp=2, fully_shard")


def rng_after_resume(rank: int, world: int, path: str, save: bool) -> torch.Tensor:
    """Saved at tp=1 x dp=2 (each replica its own generators), loaded at tp=1 x cp=2 (one replica)."""
    model = autotp.wrap(resume_model("llama", seed=0), 1, cp_size=1 if save else 2)
    torch.manual_seed(
        rank
    )  # the ranks draw apart, as data-parallel replicas may (CP ranks must not: the load fixes it)
    optimizer, scheduler = resume_training(model)
    if save:
        autotp.save_checkpoint(path, model, optimizer, scheduler)
    else:
        autotp.load_checkpoint(path, model, optimizer, scheduler)
    return torch.get_rng_state()


def test_a_resume_at_another_cp_size_gives_a_replicas_ranks_one_generator(tmp_path: Path) -> None:
    """The world size and tp are the same, the layout is not: the generators are re-seeded per replica, so the two CP
    ranks of the one replica draw alike (their dropout masks must be one process's), never each its saved rank's."""
    path = str(tmp_path / "ckpt")
    saved = run_ranks(rng_after_resume, 2, path, True)
    assert not torch.equal(saved[0], saved[1])
    first, second = run_ranks(rng_after_resume, 2, path, False)
    assert torch.equal(first, second)
