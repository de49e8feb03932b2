"""`save_checkpoint(..., async_save=True)`: the call returns once this rank's tensors are copied, training goes on, and
the next save, load or `autotp.finish()` waits for the write; a failure reaches every rank there, and the previous
checkpoint stays in place until the new one is complete."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import autotp
from autotp.testing.spawn import run_ranks
from models import tiny_model, trained_llama

pytestmark = pytest.mark.timeout(120)


def gathered(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with autotp.GatherReplacedLayerParams(model):
        return {k: v.clone() for k, v in model.state_dict().items()}


def save_async_then_train(rank: int, world: int, path: str) -> dict:
    model, optimizer = trained_llama(2)
    at_call = gathered(model)
    autotp.save_checkpoint(path, model, optimizer, async_save=True, step=1)
    pending_target = os.path.isdir(path)  # not in place before the wait
    with torch.no_grad():  # training goes on: the checkpoint must hold the weights of the call
        for p in model.parameters():
            p.add_(1.0)
    autotp.finish()
    return {"at_call": at_call, "pending_target": pending_target}


def load_at_tp1(rank: int, world: int, path: str) -> dict:
    model = autotp.wrap(tiny_model("llama", seed=3), 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = autotp.load_checkpoint(path, model, optimizer)
    return {
        "state": state,
        "weights": {k: v.clone() for k, v in model.state_dict().items()},
        "moments": len(optimizer.state),
    }


def test_async_save_holds_the_weights_of_the_call_and_loads_at_another_layout(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_ranks(save_async_then_train, 2, path)
    assert not any(report["pending_target"] for report in saved), "the checkpoint was in place before the write ended"
    for report in run_ranks(load_at_tp1, 2, path):
        assert report["state"] == {"step": 1} and report["moments"] == len(saved[0]["at_call"]), report["state"]
        for name, tensor in saved[0]["at_call"].items():
            assert torch.equal(report["weights"][name], tensor), name


def failing_async_write(rank: int, world: int, path: str) -> dict:
    model, optimizer = trained_llama(2)
    autotp.save_checkpoint(path, model, optimizer, step=1)  # the previous checkpoint
    if rank == 1:

        def failing(self, plan, planner):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "__1_0.distcp")

        dcp.FileSystemWriter.write_data = failing
    autotp.save_checkpoint(path, model, optimizer, overwrite=True, async_save=True, step=2)  # returns: no error yet
    with pytest.raises(OSError) as err:
        autotp.save_checkpoint(path + "-next", model, optimizer, step=3)  # the next save waits, and raises
    return {
        "errno": err.value.errno,
        "message": str(err.value),
        "next": os.path.exists(path + "-next"),
        "state": autotp.load_checkpoint(path, model),
    }


def test_a_failed_async_write_raises_on_every_rank_at_the_next_save_and_keeps_the_previous(tmp_path: Path) -> None:
    for report in run_ranks(failing_async_write, 2, str(tmp_path / "ckpt")):
        assert report["errno"] == errno.ENOSPC and "failed on rank 1" in report["message"], report
        assert report["state"] == {"step": 1}, "the previous checkpoint must stay in place"
        assert not report["next"], "the save that found the failure must not have written"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
