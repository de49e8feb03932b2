"""Dropout under TP: replicated activations are bit-identical across TP ranks; seeded runs repeat exactly; ranks
reseeded apart after wrap are stopped at the first forward, with the fix."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

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


DROPOUTS = {"gpt2": dict(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3)}


def reseeded_after_wrap(rank: int, world: int) -> dict:
    """Ranks reseeded apart after wrap (`torch.manual_seed(rank)`), then a training forward with dropout: the error, and
    whether the weights are untouched; then seeded alike (the fix the error names), a step keeps replicas equal."""
    model = autotp.wrap(tiny_model("gpt2", **DROPOUTS["gpt2"]), world).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = batch()
    torch.manual_seed(rank)
    with pytest.raises(RuntimeError) as err:
        model(ids, labels=ids).loss.backward()
    untouched = all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    torch.manual_seed(7 + autotp.dp_rank(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    norm = model.transformer.ln_f.weight.detach()  # replicated: equal on every TP rank after the step
    everyone = [torch.empty_like(norm) for _ in range(world)]
    dist.all_gather(everyone, norm)
    return {
        "error": str(err.value),
        "untouched": untouched,
        "replicas": max((t - norm).abs().max().item() for t in everyone),
    }


def test_ranks_reseeded_apart_after_wrap_stop_at_the_first_forward_with_the_fix() -> None:
    for report in run_ranks(reseeded_after_wrap, 2):
        assert "seed before wrap, or seed the same on every TP rank" in report["error"]
        assert report["untouched"] and report["replicas"] == 0.0
