"""A wrapped model's plain `state_dict` holds this TP rank's rows and says so: another rank's dict, or one that lost
its record, is refused with the fix named; a one-process model's full dict loads as it would in one process (logits
within 1e-5: fp32, only the order of sums differs)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

import autotp
from autotp.testing import run_ranks
from models import batch, tiny_model


def state_dicts(rank: int, world: int, directory: str) -> dict:
    model = autotp.wrap(tiny_model("llama"), world)
    ids = batch()
    own = Path(directory) / f"rank{rank}.pt"
    torch.save(model.state_dict(), own)
    dist.barrier()
    out: dict = {}
    saved = torch.load(Path(directory) / "rank0.pt", weights_only=True)  # rank 0's dict, on every rank
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        model.load_state_dict(saved)
        out["rank0_dict"] = None
    except RuntimeError as err:
        out["rank0_dict"] = str(err)
    out["unchanged"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a training step, say
    model.load_state_dict(torch.load(own, weights_only=True))  # this rank's own dict
    out["own_restored"] = all(torch.equal(p, before[n]) for n, p in model.named_parameters())

    other = tiny_model("llama", seed=7)  # a one-process model's full state dict
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        out["full_logits"] = (model(ids).logits - other(ids).logits).abs().max().item()

    third = tiny_model("llama", seed=8)
    with autotp.GatherReplacedLayerParams(model):
        model.load_state_dict(third.state_dict())  # full weights inside: loads as it would in one process
    with torch.no_grad():
        out["gathered_logits"] = (model(ids).logits - third(ids).logits).abs().max().item()

    plain = Path(directory) / f"rank{rank}.safetensors"  # a shard-shaped dict that lost its metadata
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, plain)
    try:
        model.load_state_dict(load_file(plain))
        out["safetensors"] = None
    except RuntimeError as err:
        out["safetensors"] = str(err)
    return out


def test_a_plain_state_dict_says_whose_rows_it_holds(tmp_path: Path) -> None:
    reports = run_ranks(state_dicts, 2, str(tmp_path))
    assert reports[0]["rank0_dict"] is None  # rank 0's own
    assert (
        "state dict tensor model.embed_tokens.weight (128, 64) was saved by TP rank 0 of 2, but this is TP rank 1 "
        "of 2" in reports[1]["rank0_dict"]
    ), reports[1]["rank0_dict"]
    assert "autotp.save_checkpoint" in reports[1]["rank0_dict"]
    for report in reports:
        assert report["unchanged"] and report["own_restored"]
        assert report["full_logits"] < 1e-5  # fp32, only the order of sums differs
        assert report["gathered_logits"] < 1e-5
        assert "no record of the rank that saved it" in report["safetensors"], report["safetensors"]
        assert "autotp.save_checkpoint" in report["safetensors"]
