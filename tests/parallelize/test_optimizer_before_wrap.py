"""An optimizer (and its LR scheduler) made before `autotp.wrap`: where wrap keeps every parameter's shape (tp 1) it
keeps the parameter objects, so the optimizer trains the wrapped model as one process trains its own, its state from
steps before wrap included; where wrap puts a shard in a parameter's place (tp 2), the optimizer's first step is
refused, naming the parameter, before any weight changes.

Before: `wrap(model, 1)` replaced every planned linear's weight (and a row layer's bias) with a new object, and the
optimizer silently stepped the old ones, which no forward read. Tolerances: fp32 AdamW steps, where only the order of
sums differs (the chunked loss at tp 1): `autotp.testing.parity`'s loss and parameter ones.
"""

from __future__ import annotations

import copy

import torch

import autotp
from autotp.testing import parity
from models import batch, tiny_model


def made_before_wrap(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler, ids: torch.Tensor) -> float:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return loss.item()


def optimizer_runs(rank: int, world: int) -> dict:
    """GPT-2 (row layers with biases) at tp 1, one step before wrap and two after, against one process taking the same
    three; then an optimizer made before wrap at tp `world`, its first step after wrap."""
    ids = batch()
    reference = tiny_model("gpt2")
    model = copy.deepcopy(reference)
    theirs, ours = made_before_wrap(reference), made_before_wrap(model)
    losses = [(step(reference, *theirs, ids), step(model, *ours, ids))]
    model = autotp.wrap(model, 1)
    losses += [(step(reference, *theirs, ids), step(model, *ours, ids)) for _ in range(2)]
    expected = dict(reference.named_parameters())
    report: dict = {
        "loss": max(abs(a - b) for a, b in losses),
        "param": max((p - expected[name]).abs().max().item() for name, p in model.named_parameters()),
        "lr": (ours[1].get_last_lr(), theirs[1].get_last_lr()),
    }
    model = tiny_model("llama")
    optimizer, scheduler = made_before_wrap(model)
    model = autotp.wrap(model, world)
    held = [p.detach().clone() for p in model.parameters()]
    try:
        step(model, optimizer, scheduler, ids)
        report["refusal"] = "no error"
    except RuntimeError as err:
        report["refusal"] = str(err)
    report["unchanged"] = all(torch.equal(a, b) for a, b in zip(held, model.parameters()))
    return report


def test_an_optimizer_made_before_wrap_trains_at_tp_1_and_is_refused_where_wrap_shards() -> None:
    for report in autotp.testing.run_ranks(optimizer_runs, 2):
        assert report["loss"] <= parity.LOSS_ATOL, report
        assert report["param"] <= parity.PARAM_ATOL, report
        assert report["lr"][0] == report["lr"][1], report
        assert "model.embed_tokens.weight" in report["refusal"], report["refusal"]
        assert "Make the optimizer (and its LR scheduler) after autotp.wrap" in report["refusal"], report
        assert report["unchanged"], "the refused step changed a weight"
