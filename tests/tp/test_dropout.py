"""Dropout under TP: replicated activations are bit-identical across TP ranks; seeded runs repeat exactly."""

from __future__ import annotations

import torch

import autotp
from autotp.testing.spawn import run_ranks
from models import GPT2_DROPOUT, batch, replicated_streams, tiny_model


def test_replicated_activations_are_bit_identical_across_tp_ranks() -> None:
    for same in run_ranks(replicated_streams, 2):
        assert same and all(same), same


def seeded_run(rank: int, world: int) -> dict:
    torch.manual_seed(7)
    model = autotp.wrap(tiny_model("gpt2", **GPT2_DROPOUT), world)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(3):
        ids = batch()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def test_seeded_run_with_dropout_repeats_exactly() -> None:
    first, second = run_ranks(seeded_run, 2), run_ranks(seeded_run, 2)
    for a, b in zip(first, second):
        assert a["losses"] == b["losses"]
        assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])
