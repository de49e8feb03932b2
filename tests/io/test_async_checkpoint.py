"""`save_checkpoint(..., async_save=True)`: the call returns once this rank's tensors are copied, training goes on, the
checkpoint is put in place once every rank's write completed, and the next save, load or `autotp.finish()` waits for
the write; a failure reaches every rank there, and the previous checkpoint stays in place until the new one is
complete."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import autotp
from autotp.testing.spawn import _START, COLLECTIVE_TIMEOUT, free_port, run_ranks
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


def job(rank: int, world: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    """One rank of a job whose `fn` ends the process itself (a crash: no result, no `autotp.finish`)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    fn(rank, world, *args)


def run_killed_job(fn: Callable[..., None], world: int, *args: Any) -> None:
    """`fn(rank, world, *args)` on `world` forked ranks (spawned where a GPU is: `run_ranks`' start method)."""
    ctx = mp.start_processes(job, args=(world, free_port(), fn, args), nprocs=world, join=False, start_method=_START)
    try:
        while not ctx.join(timeout=1):
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()


def crash_after_async_saves(rank: int, world: int, root: str) -> None:
    """Save step-2 asynchronously and let it complete, then step-3 with rank 1's write stalled; the whole job dies
    while step-3 is being written, without calling any autotp function after the saves."""
    model, optimizer = trained_llama(2)
    at_call = gathered(model)
    autotp.save_checkpoint(f"{root}/step-2", model, optimizer, async_save=True, step=2)
    deadline = time.monotonic() + 30  # the write of a tiny model: well under a second on idle cores
    while not os.path.isdir(f"{root}/step-2") and time.monotonic() < deadline:
        time.sleep(0.01)
    if not os.path.isdir(f"{root}/step-2"):
        raise AssertionError("step-2's async save was not put in place 30 s after the call (nothing else called)")
    if rank == 0:
        torch.save(at_call, f"{root}/../expected.pt")
    if rank == 1:  # a write that never ends: the job dies during it

        def stalled(self, plan, planner):
            time.sleep(3600)

        dcp.FileSystemWriter.write_data = stalled
    with torch.no_grad():  # training goes on
        for p in model.parameters():
            p.add_(1.0)
    autotp.save_checkpoint(f"{root}/step-3", model, optimizer, async_save=True, step=3)
    deadline = time.monotonic() + 30  # rank 0's data written: the save is under way, its index never comes
    while not list(Path(root).glob(".step-3.autotp-*/__0_0.distcp")) and time.monotonic() < deadline:
        time.sleep(0.01)
    dist.barrier()
    os._exit(0)


def resume_after_the_crash(rank: int, world: int, root: str) -> dict:
    model = autotp.wrap(tiny_model("llama", seed=3), 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    latest = autotp.latest_checkpoint(root)
    state = autotp.load_checkpoint(latest, model, optimizer)
    return {"latest": latest, "state": state, "weights": gathered(model), "moments": len(optimizer.state)}


def test_a_completed_async_save_survives_a_crash_and_one_cut_off_is_never_in_place(tmp_path: Path) -> None:
    """A completed async save used to be put in place only by the next save, load, `latest_checkpoint` or
    `autotp.finish()`: a job killed before any of them lost it (the next save to the target even deleted its staging
    directory, its process being gone). It is in place once written; a save the crash cut off stays hidden."""
    root = tmp_path / "ckpt"
    run_killed_job(crash_after_async_saves, 2, str(root))
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["step-2"], os.listdir(root)
    cut_off = [p for p in root.iterdir() if p.name.startswith(".step-3.autotp-")]
    assert cut_off and not (cut_off[0] / ".metadata").exists(), os.listdir(root)  # its data half written, no index
    expected = torch.load(tmp_path / "expected.pt")
    for report in run_ranks(resume_after_the_crash, 2, str(root)):
        assert report["latest"] == root / "step-2" and report["state"] == {"step": 2}, report["latest"]
        assert report["weights"].keys() == expected.keys() and report["moments"] == len(expected)
        for name, tensor in expected.items():
            assert torch.equal(report["weights"][name], tensor), name
