"""The edges ring over issue 49's pipeline features (random draws under a pipeline, a block shared by stages):
GPT-2's dropout at pp 2 in bf16 (a run seeded alike repeats itself bit for bit, and trains), two `forward_backward`
calls accumulated into one step (each draws its own masks, as one process's two forwards do), Zamba's shared block
frozen, and LoRA on Zamba at pp 2 (against one process, gradients clipped to 0.5: `autotp.testing.parity`'s fp32
tolerances, only the order of sums differs); at pp 2 x dp 2 (slow), DP replicas seeded apart draw different masks
(they are not forced equal) and replicas seeded alike repeat each other.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

import autotp
import pp_shared_workers  # noqa: F401  (registers the zamba_shared config)
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import GPT2_DROPOUT, tiny_model
from pp_workers import pp_batch


def dropout_run(dtype: torch.dtype = torch.float32, accumulate: int = 1, seed: int = 7) -> dict:
    """GPT-2 with dropout at pp 2, seeded `seed` after wrap, two AdamW steps of `accumulate` forward_backward calls
    each on one batch: the losses and this rank's parameters."""
    model = tiny_model("gpt2", **GPT2_DROPOUT).to(dtype)
    autotp.wrap(model, 1, pp_size=2, pp_microbatches=2)
    model.train()
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs, losses = pp_batch(), []
    for _ in range(2):
        for _ in range(accumulate):
            losses.append(autotp.forward_backward(model, **inputs).loss.item())
        autotp.allreduce_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}
    return {"losses": losses, "params": params}


def zamba(mode: str) -> tuple[float, float]:
    """Zamba's shared block frozen, or LoRA on q/v, at pp 2 against one process: two clipped AdamW steps, worst loss
    and parameter differences."""
    reference = tiny_model("zamba_shared")
    if mode == "frozen":
        for name, p in reference.named_parameters():
            p.requires_grad_("shared_transf" not in name)
    else:
        reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    model = copy.deepcopy(reference)
    autotp.wrap(model if mode == "frozen" else model.base_model.model, 1, pp_size=2, pp_microbatches=2)
    optimizers = [
        torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (reference, model)
    ]
    inputs, losses = pp_batch(), []
    for _ in range(2):
        expected = reference(**inputs).loss
        expected.backward()
        torch.nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], 0.5)
        losses.append(abs(autotp.forward_backward(model, **inputs).loss.item() - expected.item()))
        autotp.allreduce_gradients(model)
        autotp.clip_grad_norm_(model, 0.5)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    want = dict(reference.named_parameters())
    errors = [
        (p - want[n]).abs().max().item() for n, p in model.named_parameters() if n in want and p.device.type != "meta"
    ]
    return max(losses), max(errors)


def two_ranks(rank: int, world: int) -> dict:
    return {
        "bf16": dropout_run(torch.bfloat16),
        "bf16 again": dropout_run(torch.bfloat16),
        "accumulated": dropout_run(accumulate=2)["losses"],
        "zamba frozen": zamba("frozen"),
        "zamba lora": zamba("lora"),
    }


@pytest.mark.slow  # about 2 s; bf16 at pp2 stays quick (test_pp_edges.py, test_pp_ring.py)
def test_pp2_draws_in_bf16_and_accumulated_and_zambas_shared_block_frozen_or_with_lora() -> None:
    for report in run_ranks(two_ranks, 2):
        first, again = report["bf16"], report["bf16 again"]
        assert first["losses"] == again["losses"], (first["losses"], again["losses"])
        assert all(torch.equal(t, again["params"][n]) for n, t in first["params"].items())
        assert all(map(math.isfinite, first["losses"])) and first["losses"][-1] < first["losses"][0], first["losses"]
        accumulated = report["accumulated"]
        assert accumulated[0] != accumulated[1] and accumulated[2] != accumulated[3], accumulated  # masks apart
        for label in ("zamba frozen", "zamba lora"):
            loss, param = report[label]
            assert loss <= parity.LOSS_ATOL and param <= parity.PARAM_ATOL, (label, report[label])


def replicas(rank: int, world: int) -> dict:
    """pp 2 x dp 2, one step on the same batch on both replicas: seeded apart per DP replica (7 + dp rank) and alike
    (7): each rank's loss (the last stage's, on every rank)."""
    out = {}
    for label in ("apart", "alike"):
        model = tiny_model("gpt2", **GPT2_DROPOUT)
        autotp.wrap(model, 1, pp_size=2, pp_microbatches=2)
        model.train()
        torch.manual_seed(7 + (autotp.dp_rank(model) if label == "apart" else 0))
        out[label] = (autotp.dp_rank(model), autotp.forward_backward(model, **pp_batch()).loss.item())
    return out


@pytest.mark.slow
def test_pp2_dp2_replicas_seeded_apart_draw_apart() -> None:
    reports = run_ranks(replicas, 4)
    for label, differ in (("apart", True), ("alike", False)):
        losses = {}
        for report in reports:
            dp, loss = report[label]
            losses.setdefault(dp, set()).add(loss)
        assert all(len(v) == 1 for v in losses.values()), losses  # a replica's stages agree on its loss
        assert (losses[0] != losses[1]) == differ, (label, losses)
