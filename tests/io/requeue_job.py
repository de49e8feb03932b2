"""A training job that saves an async checkpoint every 2 steps and, launched again as a scheduler requeues it,
resumes from `autotp.latest_checkpoint` (tests/io/test_latest_checkpoint.py launches it; a helper module, also run
as a script by each rank, with the variables torchrun sets: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

`REQUEUE_KILL=start:N` makes rank 1 SIGKILL itself at the start of step N (N steps done); `REQUEUE_KILL=saving:N`
right after the async save of step N began.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import tiny_config

STEPS, EVERY = 8, 2


def build() -> nn.Module:
    """The same tiny Llama on every rank and in the one-process reference."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)  # eps: see autotp.testing.parity


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """Step `step`'s batch depends on the step alone, so a resumed run reads what an uninterrupted one reads."""
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(step))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def killed_here(point: str) -> None:
    if os.environ.get("REQUEUE_KILL") == point and os.environ["RANK"] == "1":
        os.kill(os.getpid(), signal.SIGKILL)


def main(root: str) -> None:
    model = autotp.wrap(build(), tp_size=2)
    optimizer = make_optimizer(model)
    start = 0
    if (last := autotp.latest_checkpoint(root)) is not None:  # the resume: three lines
        start = autotp.load_checkpoint(last, model, optimizer)["step"]
    print(f"from step {start}: {last}", flush=True)
    for step in range(start, STEPS):
        killed_here(f"start:{step}")
        train_step(model, optimizer, step)
        if (step + 1) % EVERY == 0:
            autotp.save_checkpoint(f"{root}/step-{step + 1}", model, optimizer, step=step + 1, async_save=True)
            killed_here(f"saving:{step + 1}")
    autotp.finish()


if __name__ == "__main__":
    main(sys.argv[1])
