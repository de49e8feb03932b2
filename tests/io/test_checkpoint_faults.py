"""Training checkpoints under faults: a failed write reaches every rank, a damaged checkpoint is named before anything
changes, the older per-rank format still loads at its own layout, and async saves keep the previous checkpoint until
theirs is complete."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.filesystem import FileSystem

import autotp
from autotp.testing.spawn import run_ranks
from models import tiny_model, trained_llama

pytestmark = pytest.mark.timeout(120)


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def full_disk_on_rank1(rank: int, world: int, target: str) -> tuple[int | None, str]:
    if rank == 1:

        def failing(self, plan, planner):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "__1_0.distcp")

        dcp.FileSystemWriter.write_data = failing
    model, optimizer = trained_llama(world)
    with pytest.raises(OSError) as err:
        autotp.save_checkpoint(target, model, optimizer, step=1)
    return err.value.errno, str(err.value)


def test_write_error_on_one_rank_raises_on_every_rank_and_writes_nothing(tmp_path: Path) -> None:
    for code, message in run_ranks(full_disk_on_rank1, 2, str(tmp_path / "ckpt")):
        assert code == errno.ENOSPC and "failed on rank 1" in message and "__1_0.distcp" in message, message
    assert not (tmp_path / "ckpt").exists() and hidden(tmp_path) == []


def disk_fills_on_rank1(rank: int, world: int, target: str) -> tuple[int | None, str]:
    """Rank 1's data file stops taking bytes after 20000 of them, as on a full disk: the write raises ENOSPC inside
    torch.save, whose zip writer reports only "unexpected pos"."""
    if rank == 1:
        opened = FileSystem.create_stream

        @contextmanager
        def filling(self, path, mode):
            with opened(self, path, mode) as stream:
                yield _Filling(stream, 20000)

        FileSystem.create_stream = filling
    model, optimizer = trained_llama(world)
    with pytest.raises(OSError) as err:
        autotp.save_checkpoint(target, model, optimizer, step=1)
    return err.value.errno, str(err.value)


class _Filling(io.RawIOBase):
    """A file that takes `room` bytes, then raises ENOSPC."""

    def __init__(self, stream: io.IOBase, room: int):
        self.stream, self.room = stream, room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.stream.write(data)

    def tell(self) -> int:
        return self.stream.tell()

    def fileno(self) -> int:
        return self.stream.fileno()


def test_a_full_disk_says_so_and_where(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    for code, message in run_ranks(disk_fills_on_rank1, 2, str(target)):
        assert code == errno.ENOSPC and "failed on rank 1" in message, message
        assert f"the disk holding {target} is full" in message and "inline_container" not in message, message
        assert "a previous checkpoint stays" in message, message
    assert not target.exists() and hidden(tmp_path) == []


def unsaveable_on_rank1(rank: int, world: int, target: str) -> str:
    """Rank 1 cannot describe its boxes (as fused shards under fully_shard once could not); the entry check is given
    a few seconds, so a rank left waiting for a peer that gave up shows within the test's time."""
    import autotp.io.checkpoint.chunks as chunks
    import autotp.io.staging as staging

    staging.ENTRY_TIMEOUT = timedelta(seconds=10)
    model, optimizer = trained_llama(world)
    if rank == 1:

        def failing(*args):
            raise IndexError("start out of range")

        assert callable(chunks.placement)  # the seam the failure goes in: each tensor's boxes are described there
        chunks.placement = failing
    with pytest.raises(Exception) as err:
        autotp.save_checkpoint(target, model, optimizer, step=1)
    return f"{type(err.value).__name__}: {err.value}"


def test_a_rank_that_cannot_describe_its_tensors_fails_every_rank(tmp_path: Path) -> None:
    """The others learn rank 1's own error at once, not that "rank 0 did not confirm that every rank called it"."""
    first, second = run_ranks(unsaveable_on_rank1, 2, str(tmp_path / "ckpt"))
    assert first.startswith("RuntimeError") and "failed on rank 1: IndexError: start out of range" in first, first
    assert second == "IndexError: start out of range"
    assert not (tmp_path / "ckpt").exists() and hidden(tmp_path) == []


# --- a damaged checkpoint changes nothing, on any rank ---------------------------------------------------------


def save_tp2(rank: int, world: int, directory: str) -> None:
    model, optimizer = trained_llama(2)
    autotp.save_checkpoint(directory, model, optimizer, step=1)


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("saved") / "ckpt"
    run_ranks(save_tp2, 2, str(directory))
    return directory


@pytest.fixture
def checkpoint(saved_tp2: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_tp2, tmp_path / "ckpt"))


def damage(file: Path, how: str) -> None:
    if how == "delete":
        file.unlink()
    elif how == "truncate":
        file.write_bytes(file.read_bytes()[:-100])
    else:
        file.write_bytes(b"{not a pickle" + file.read_bytes()[13:])


def load_and_compare(rank: int, world: int, directory: str, tp: int, seed: int = 42) -> tuple[str, bool, bool, bool]:
    model = autotp.wrap(tiny_model("llama", seed=seed), tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    with pytest.raises(autotp.CheckpointError) as err:
        autotp.load_checkpoint(directory, model, optimizer)
    same = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    return str(err.value), same, not optimizer.state, torch.equal(rng, torch.get_rng_state())


@pytest.mark.parametrize(
    "file,how,named",
    [
        ("__1_0.distcp", "delete", "missing"),
        ("__1_0.distcp", "truncate", "a truncated file"),
        (".metadata", "corrupt", "cannot be read"),
        ("autotp_checkpoint.json", "corrupt", "cannot be read as JSON"),
    ],
)
def test_a_damaged_checkpoint_is_named_and_changes_no_rank(checkpoint: Path, file: str, how: str, named: str) -> None:
    damage(checkpoint / file, how)
    for message, *unchanged in run_ranks(load_and_compare, 2, str(checkpoint), 1):  # at another layout, too
        assert str(checkpoint / file) in message and named in message, message
        assert unchanged == [True, True, True], "a rank changed its model, optimizer or RNG"


def other_model(rank: int, world: int, directory: str) -> dict[str, str]:
    messages = {}
    wider = autotp.wrap(tiny_model("llama", intermediate_size=128), 2)
    with pytest.raises(autotp.CheckpointError) as err:
        autotp.load_checkpoint(directory, wider)
    messages["shape"] = str(err.value)
    model = autotp.wrap(tiny_model("llama"), 2)
    fewer = torch.optim.AdamW([p for n, p in model.named_parameters() if "mlp" not in n])
    with pytest.raises(autotp.CheckpointError) as err:
        autotp.load_checkpoint(directory, model, fewer)
    messages["optimizer"] = str(err.value)
    return messages


def test_a_checkpoint_of_another_model_or_optimizer_is_named(checkpoint: Path) -> None:
    for report in run_ranks(other_model, 2, str(checkpoint)):
        assert (
            "tensor model.layers.0.mlp.gate_proj.weight has shape (96, 64) in the checkpoint, the model's full "
            "tensor has shape (128, 64)" in report["shape"]
        ), report["shape"]
        assert "parameter groups of [21] parameters, this one has [15]" in report["optimizer"], report["optimizer"]


@pytest.mark.parametrize("file,how", [("__0_0.distcp", "delete"), ("__1_0.distcp", "truncate")])
def test_consolidate_refuses_a_damaged_checkpoint(checkpoint: Path, tmp_path: Path, file: str, how: str) -> None:
    damage(checkpoint / file, how)
    with pytest.raises(autotp.CheckpointError, match=str(checkpoint / file)):
        autotp.consolidate(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


def test_consolidate_command_exits_2_on_a_damaged_checkpoint(autotp_cli, checkpoint: Path, tmp_path: Path) -> None:
    damage(checkpoint / "__1_0.distcp", "truncate")
    done = autotp_cli("consolidate", str(checkpoint), str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "__1_0.distcp" in done.stderr and "truncated" in done.stderr
    assert not (tmp_path / "out").exists()


# --- the older per-rank format ---------------------------------------------------------------------------------


def write_per_rank(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    """What autotp.save_checkpoint wrote before DCP checkpoints (`autotp-checkpoint/1`), on this rank."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = directory / f"rank-{rank:05d}"
    mine.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, mine / "model.safetensors")
    state = optimizer.state_dict()
    tensors = {f"{i}.{k}": v for i, entry in state["state"].items() for k, v in entry.items()}
    save_file(tensors, mine / "optimizer.safetensors")
    save_file({"torch": torch.get_rng_state()}, mine / "rng.safetensors")
    version, internal, gauss = __import__("random").getstate()
    (mine / "state.json").write_text(
        json.dumps(
            {
                "optimizer": {"state": {str(i): {} for i in state["state"]}, "param_groups": state["param_groups"]},
                "rng": {"python": [version, list(internal), gauss]},
                "scheduler": None,
            }
        )
    )
    if rank == 0:
        kept = model.state_dict(keep_vars=True)
        partitions = {n: p.autotp_shard.partition.to_json() for n, p in kept.items() if hasattr(p, "autotp_shard")}
        (directory / "autotp_checkpoint.json").write_text(
            json.dumps(
                {
                    "format": "autotp-checkpoint/1",
                    "tp_size": autotp.tp_size(model),
                    "world_size": world,
                    "fsdp": False,
                    "model_class": type(model).__name__,
                    "state": {"step": step},
                    "partitions": partitions,
                    "dp_rows": [],
                }
            )
        )
        model.config.save_pretrained(directory)
    dist.barrier()


def per_rank_round_trip(rank: int, world: int, directory: str) -> dict:
    model, optimizer = trained_llama(2)
    write_per_rank(Path(directory), model, optimizer, step=5)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    again, opt = autotp.wrap(tiny_model("llama", seed=3), 2), None
    opt = torch.optim.AdamW(again.parameters(), lr=1e-2)
    state = autotp.load_checkpoint(directory, again, opt)
    refused = ""
    try:
        autotp.load_checkpoint(directory, autotp.wrap(tiny_model("llama"), 1))
    except autotp.CheckpointError as err:
        refused = str(err)
    return {
        "state": state,
        "same": all(torch.equal(v, again.state_dict()[k]) for k, v in expected.items()),
        "moments": len(opt.state),
        "refused": refused,
    }


def test_per_rank_checkpoints_load_at_their_layout_and_name_the_conversion(tmp_path: Path) -> None:
    for report in run_ranks(per_rank_round_trip, 2, str(tmp_path / "old")):
        assert report["state"] == {"step": 5} and report["same"] and report["moments"] == 21, report
        assert "saved at tp=2 on 2 ranks" in report["refused"] and "tp=1 on 2 ranks" in report["refused"]
        assert f"python -m autotp consolidate {tmp_path / 'old'} FULL_DIR" in report["refused"]
    autotp.consolidate(tmp_path / "old", tmp_path / "full")
    assert (tmp_path / "full" / "model.safetensors").is_file()
