"""AutoTPTrainer under context parallelism trains as one rank does."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotp.testing.spawn import run_ranks
from trainer_runs import recording_trainer


def cp_trainer_losses(rank: int, world: int, path: str, cp: int) -> list[float]:
    """AutoTPTrainer at tp=1 x cp=`cp` (one replica): 3 steps of the same batches as on one rank."""
    trainer = recording_trainer(path, 1, False, steps=3, cp=cp)
    trainer.train()
    return trainer.losses


@pytest.mark.slow  # a Trainer run (about 1.5 s); cp2 parity and a Trainer resume stay quick
@pytest.mark.timeout(120)
def test_trainer_under_context_parallelism_trains_as_one_rank(tmp_path: Path) -> None:
    """cp=2: each CP rank computes its half of every sequence, the gradients are summed over CP (DDP over DP x CP),
    and the token count covers the whole sequence: the losses of one rank's run, to fp32 rounding."""
    (one,) = run_ranks(cp_trainer_losses, 1, str(tmp_path / "one"), 1)
    for losses in run_ranks(cp_trainer_losses, 2, str(tmp_path / "cp"), 2):
        assert len(losses) == 3 and max(abs(a - b) for a, b in zip(losses, one)) <= 1e-5, (losses, one)
