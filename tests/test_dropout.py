"""Dropout under TP: replicated activations are bit-identical across TP ranks; seeded runs repeat exactly."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autotp
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

DROPOUT = dict(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def replicated_streams(rank: int, world: int, device: str = "cpu") -> list[bool]:
    """Whether each block's output (the residual stream) is bit-identical on every TP rank, with dropout on
    `device` (tests/test_gpu.py runs it on CUDA)."""
    torch.manual_seed(1000 + rank)  # ranks seeded differently on purpose: wrap must align the shared stream
    model = autotp.wrap(tiny_model("gpt2", **DROPOUT).to(device), world)
    model.train()
    captured = []
    for block in model.transformer.h:  # each block's output is the residual stream: replicated
        block.register_forward_hook(lambda m, a, out: captured.append(out[0] if isinstance(out, tuple) else out))
    ids = batch().to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    same = []
    for tensor in captured:
        everyone = [torch.empty_like(tensor) for _ in range(world)]
        dist.all_gather(everyone, tensor.detach().contiguous())
        same.append(all(torch.equal(everyone[0], t) for t in everyone))
    return same


def test_replicated_activations_are_bit_identical_across_tp_ranks() -> None:
    for same in run_ranks(replicated_streams, 2):
        assert same and all(same), same


def seeded_run(rank: int, world: int) -> dict:
    torch.manual_seed(7)
    model = autotp.wrap(tiny_model("gpt2", **DROPOUT), world)
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
