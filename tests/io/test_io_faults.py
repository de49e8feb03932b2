"""Checkpoint I/O under faults: every rank fails together, nothing half-written loads, corrupt files are named.

- Collective saves and loads raise on every rank when one rank fails, instead of leaving the others
  blocked in a collective or believing the save or load happened.
- Training checkpoints' faults are in test_checkpoint_faults.py.
- Staging directories of killed saves are cleaned up, and a save killed during the final swap
  leaves the old or the new checkpoint at the target.
- Safetensors headers and indexes are validated at least as strictly as the `safetensors` library.
- A full tensor streamed to the writer in pieces (`stream_full_to`) is the unsharded tensor, for every kind of
  partition; a stream the writer leaves unread is drained; files are fsynced only before a swap deletes a checkpoint.
"""

from __future__ import annotations

import errno
import json
import logging
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import autotp
import autotp.io.staging as staging
import autotp.io.streaming as streaming
from autotp.io.hf.load import checkpoint_files
from autotp.io.hf.safetensors import SafetensorsWriter, read_header
from autotp.planning.sharding import Partition
from autotp.testing import run_ranks
from models import tiny_model

pytestmark = pytest.mark.timeout(60)


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# --- a failure on one rank is raised on every rank ----------------------------------------------------------


def save_and_catch(rank: int, world: int, target: str) -> tuple[int | None, str]:
    model = autotp.wrap(tiny_model("llama"), world)
    with pytest.raises(OSError) as err:
        autotp.save_pretrained(model, target)
    return err.value.errno, str(err.value)


@pytest.mark.parametrize("case", ["parent-is-a-file", "name-too-long"])
def test_os_error_while_staging_raises_on_every_rank(tmp_path: Path, case: str) -> None:
    if case == "parent-is-a-file":
        (tmp_path / "file").write_text("not a directory")
        target, code = tmp_path / "file" / "out", errno.EEXIST
    else:
        target, code = tmp_path / ("x" * 300), errno.ENAMETOOLONG
    for got, message in run_ranks(save_and_catch, 2, str(target)):
        assert got == code, message
        assert str(target) in message and os.strerror(code) in message
    assert hidden(tmp_path) == []


def full_disk_on_rank0(rank: int, world: int, target: str) -> tuple[int | None, str]:
    if rank == 0:  # the third tensor written finds the disk full
        write, calls = autotp.io.hf.safetensors.SafetensorsWriter.write, []

        def failing(self, name, tensor):
            calls.append(name)
            if len(calls) == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
            write(self, name, tensor)

        autotp.io.hf.safetensors.SafetensorsWriter.write = failing
    model = autotp.wrap(tiny_model("llama"), world)
    with pytest.raises(OSError) as err:
        autotp.save_pretrained(model, target, max_shard_size="60KB")
    return err.value.errno, str(err.value)


def test_write_error_on_the_writer_raises_on_every_rank(tmp_path: Path) -> None:
    """The other TP rank is still gathering tensors for rank 0 when rank 0's write fails."""
    (_, first), (code, second) = run_ranks(full_disk_on_rank0, 2, str(tmp_path / "out"))
    assert os.strerror(errno.ENOSPC) in first
    assert code == errno.ENOSPC and "failed on rank 0" in second and os.strerror(errno.ENOSPC) in second
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []


def save_on_one_rank(rank: int, world: int, caller: int, target: str, flag: str) -> tuple[float, str] | None:
    model = autotp.wrap(tiny_model("llama"), world)
    if rank != caller:  # busy elsewhere until the caller has its error, so that it cannot come from our exit
        deadline = time.monotonic() + 30
        while not Path(flag).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return None
    staging.ENTRY_TIMEOUT = timedelta(seconds=1)
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        autotp.save_pretrained(model, target)
    Path(flag).touch()
    return time.monotonic() - start, str(err.value)


@pytest.mark.parametrize("caller", [0, 1])
def test_save_called_on_some_ranks_only_fails_within_the_bound(tmp_path: Path, caller: int) -> None:
    results = run_ranks(save_on_one_rank, 2, caller, str(tmp_path / "out"), str(tmp_path / "flag"))
    elapsed, message = results[caller]
    assert "autotp.save_pretrained is collective: call it on every rank" in message
    assert elapsed < 10, f"took {elapsed:.1f} s with a 1 s bound"
    assert not (tmp_path / "out").exists()


def unreadable_on_rank1(rank: int, world: int, path: str) -> tuple[str, int | None, str]:
    if rank == 1:

        def failing(f, *args):
            raise OSError(errno.EIO, os.strerror(errno.EIO), f.name)

        autotp.io.hf.load.read_rows = failing
    try:
        autotp.from_pretrained(path, world)
    except Exception as err:
        return type(err).__name__, getattr(err, "errno", None), str(err)
    return "no error", None, ""


def test_read_error_on_one_rank_of_from_pretrained_raises_on_every_rank(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path / "ck")
    (kind0, _, first), (kind1, code, second) = run_ranks(unreadable_on_rank1, 2, str(tmp_path / "ck"))
    assert kind1 == "OSError" and code == errno.EIO, second
    assert kind0 == "CheckpointError" and "rank 1" in first and os.strerror(errno.EIO) in first, first


# --- staging directories ----------------------------------------------------------------------------------


def save_tiny(target: Path, seed: int = 0, **kwargs) -> None:
    autotp.save_pretrained(autotp.wrap(tiny_model("llama", seed=seed), 1), target, **kwargs)


def test_next_save_removes_stale_staging_directories_only(tmp_path: Path) -> None:
    dead, live = dead_pid(), os.getpid()
    stale = [
        ".out.autotp-abcd_123",
        ".out.autotp-incoming",
        "..out.autotp-incoming.autotp-x1y2z3w4",
        f".out.autotp-old-{dead}",
        f".out.autotp-{dead}-k9j8h7g6",
    ]
    kept = [
        f".out.autotp-{live}-a1b2c3d4",  # a save in progress in a live process
        f".other.autotp-{dead}-a1b2c3d4",
        f".out.autotp-1.autotp-{dead}-a1b2c3d4",  # other targets
        ".out.notes",
    ]
    save_tiny(tmp_path / "out")
    for name in stale + kept:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    save_tiny(tmp_path / "out", overwrite=True)
    staging.wait_for_removals()  # the replaced checkpoint goes in the background
    assert hidden(tmp_path) == sorted(kept)


def save_then_die(target: str, step: int, when: str, exchange: bool) -> None:
    """In a forked child: save, and SIGKILL this process before or after the `step`-th filesystem step of the swap."""
    calls, swapping = [], []

    def counted(operation):
        def run(*args, **kwargs):
            if swapping:
                calls.append(operation)
                if len(calls) == step and when == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
            out = operation(*args, **kwargs)
            if swapping and len(calls) == step and when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        return run

    os.rename, os.replace, shutil.rmtree = counted(os.rename), counted(os.replace), counted(shutil.rmtree)
    staging._exchange = (
        counted(staging._exchange) if exchange and hasattr(staging, "_exchange") else (lambda a, b: False)
    )
    move = staging._move_into_place

    def swap(*args) -> None:
        swapping.append(True)
        move(*args)

    staging._move_into_place = swap
    save_tiny(Path(target), seed=1, overwrite=True)


def killed_save(target: Path, step: int, when: str, exchange: bool = True) -> int:
    child = multiprocessing.get_context("fork").Process(target=save_then_die, args=(str(target), step, when, exchange))
    child.start()
    child.join(60)
    return child.exitcode


def first_weight(target: Path) -> torch.Tensor:
    return AutoModelForCausalLM.from_pretrained(target).state_dict()["model.layers.0.self_attn.q_proj.weight"]


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_a_save_killed_during_the_swap_leaves_the_old_or_the_new_checkpoint(
    tmp_path: Path, step: int, when: str
) -> None:
    target = tmp_path / "out"
    old, new = (tiny_model("llama", seed=s) for s in (0, 1))
    old.save_pretrained(target)
    exitcode = killed_save(target, step, when)
    assert exitcode in (0, -signal.SIGKILL)
    weight = first_weight(target)  # the target must load, as one checkpoint or the other
    assert any(torch.equal(weight, m.state_dict()["model.layers.0.self_attn.q_proj.weight"]) for m in (old, new))
    save_tiny(target, overwrite=True)  # cleans up after the killed save
    staging.wait_for_removals()
    assert hidden(tmp_path) == []


def test_swap_killed_between_renames_without_exchange_is_undone_by_the_next_save(tmp_path: Path) -> None:
    """Where renameat2 is unavailable the target is missing between the two renames; the old one comes back."""
    target = tmp_path / "out"
    old = tiny_model("llama", seed=0)
    old.save_pretrained(target)
    assert killed_save(target, 1, "after", exchange=False) == -signal.SIGKILL
    assert not target.exists()
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        save_tiny(target, seed=1)  # the restored old checkpoint is not overwritten without overwrite=True
    assert torch.equal(first_weight(target), old.state_dict()["model.layers.0.self_attn.q_proj.weight"])
    assert hidden(tmp_path) == []


# --- malformed safetensors files and indexes --------------------------------------------------------------


def write_safetensors(file: Path, header: object, data: bytes = b"") -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    file.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def f32(shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": "F32", "shape": shape, "data_offsets": [begin, end]}


MALFORMED = {  # header, data, what the message must name besides the file
    "not-an-object": (b"[1, 2]", b"", ["not an object"]),
    "no-data-offsets": ({"t.w": {"dtype": "F32", "shape": [2]}}, bytes(8), ["t.w", "data_offsets"]),
    "unknown-dtype": ({"t.w": {"dtype": "F9", "shape": [2], "data_offsets": [0, 8]}}, bytes(8), ["t.w", "'F9'"]),
    "negative-dim": ({"t.w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8), ["t.w", "[-2]"]),
    "size-disagrees-with-shape": ({"t.w": f32([2, 2], 0, 12)}, bytes(12), ["t.w", "16 bytes", "hold 12"]),
    "past-the-end": ({"t.w": f32([2, 2], 0, 16)}, bytes(8), ["truncated", "t.w"]),
    "overlap": ({"t.a": f32([4], 0, 16), "t.b": f32([4], 8, 24)}, bytes(24), ["t.b", "inside tensor t.a"]),
    "gap": ({"t.a": f32([2], 0, 8), "t.b": f32([2], 16, 24)}, bytes(24), ["t.b", "8 bytes after"]),
    "bytes-left-over": ({"t.w": f32([4], 0, 16)}, bytes(24), ["8 bytes after the last tensor"]),
    "metadata-not-strings": ({"__metadata__": {"step": 1}, "t.w": f32([4], 0, 16)}, bytes(16), ["__metadata__"]),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_safetensors_header_names_the_file_and_tensor(tmp_path: Path, case: str) -> None:
    header, data, names = MALFORMED[case]
    file = tmp_path / "model.safetensors"
    write_safetensors(file, header, data)
    with pytest.raises(autotp.CheckpointError) as err:
        read_header(file)
    assert all(text in str(err.value) for text in [str(file), *names]), str(err.value)
    with pytest.raises(autotp.CheckpointError, match="model.safetensors"):
        checkpoint_files(tmp_path)


def test_valid_headers_still_read(tmp_path: Path) -> None:
    file = tmp_path / "model.safetensors"
    write_safetensors(file, {"b": f32([2], 8, 16), "e": f32([0], 16, 16), "a": f32([2], 0, 8)}, bytes(16))
    assert sorted(read_header(file)[0]) == ["a", "b", "e"]


def test_from_pretrained_refuses_offsets_pointing_into_another_tensor(tmp_path: Path) -> None:
    """Two same-sized tensors sharing bytes loaded silently before: one of them got the other's weights."""
    tiny_model("llama").save_pretrained(tmp_path)
    file = tmp_path / "model.safetensors"
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    a, b = "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]
    write_safetensors(file, header, raw[8 + length :])
    with pytest.raises(autotp.CheckpointError) as err:
        autotp.from_pretrained(tmp_path, 1)
    assert str(file) in str(err.value) and any(f"tensor {name} " in str(err.value) for name in header), str(err.value)


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    tiny_model("llama").save_pretrained(tmp_path / "ck", max_shard_size="60KB")
    return tmp_path / "ck"


def edit_index(directory: Path, edit) -> Path:
    index = directory / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    index.write_text(json.dumps(edit(content)))
    return index


def wrong_shard(content: dict) -> dict:
    weight_map = content["weight_map"]
    name = "model.layers.0.mlp.up_proj.weight"
    weight_map[name] = next(f for f in sorted(set(weight_map.values())) if f != weight_map[name])
    return content


@pytest.mark.parametrize(
    "case,edit,names",
    [
        ("not-an-object", lambda c: [c], ["no weight_map"]),
        ("weight-map-a-list", lambda c: {**c, "weight_map": list(c["weight_map"])}, ["weight_map is a JSON list"]),
        (
            "file-not-a-string",
            lambda c: {**c, "weight_map": {**c["weight_map"], "model.norm.weight": 5}},
            ["model.norm.weight", "5"],
        ),
        ("tensor-in-the-wrong-shard", wrong_shard, ["model.layers.0.mlp.up_proj.weight", "does not contain it"]),
    ],
)
def test_malformed_index_names_the_file_and_tensor(sharded: Path, case: str, edit, names: list[str]) -> None:
    index = edit_index(sharded, edit)
    with pytest.raises(autotp.CheckpointError) as err:
        autotp.from_pretrained(sharded, 1)
    assert all(text in str(err.value) for text in [str(index), *names]), str(err.value)


def test_unused_checkpoint_tensors_are_listed_in_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    caplog.set_level(logging.WARNING, logger="autotp")
    autotp.from_pretrained(tmp_path, 1)
    assert not [r for r in caplog.records if "not used" in r.getMessage()], "a clean checkpoint was warned about"
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    extras = [f"extra.{i}.weight" for i in range(7)]
    save_file({**tensors, **{name: torch.zeros(2) for name in extras}}, file, metadata={"format": "pt"})
    caplog.clear()
    autotp.from_pretrained(tmp_path, 1)
    (message,) = [
        r.getMessage()
        for r in caplog.records
        if r.name == "autotp" and r.levelno == logging.WARNING and "not used" in r.getMessage()
    ]
    assert message.startswith("7 tensors of the checkpoint are not used by LlamaForCausalLM: extra.0.weight, ")
    assert "and 2 more" in message


# --- full tensors streamed to the writer -----------------------------------------------------------------


def partitions(world: int) -> list[tuple[Partition, tuple[int, ...]]]:
    """(partition, full shape): uneven, along inner dims, fused runs, replicated runs, a rank holding nothing."""
    return [
        (Partition.even(0, 2 * world + 1, world), (2 * world + 1, 3)),
        (Partition.even(1, 2 * world + 1, world), (4, 2 * world + 1)),
        (Partition.even(0, 3 * world, world), (3 * world,)),  # a bias
        (Partition.even(2, world + 2, world), (2, 3, world + 2)),
        (
            Partition(0, 3 * world, tuple(((r, 1), (world + r, 1), (2 * world + r, 1)) for r in range(world))),
            (3 * world, 2),
        ),  # fused q | k | v
        (Partition(0, world + 1, tuple(((r, 1), (world, 1)) for r in range(world))), (world + 1, 2)),  # a shared row
        (Partition(1, world + 1, tuple(((world, 1), (r, 1)) for r in range(world))), (3, world + 1, 2)),
        (Partition(0, 4, (((0, 4),),) + ((),) * (world - 1)), (4, 3)),  # everything on the writer
        (Partition(0, 4, ((),) + (((0, 4),),) * (world - 1)), (4, 3)),  # nothing on the writer
    ]


def shard_of(full: torch.Tensor, partition: Partition, rank: int) -> torch.Tensor:
    if not partition.runs[rank]:
        return full.narrow(partition.dim, 0, 0).clone()
    return partition.shard(full, rank)


def stream_every_partition(rank: int, world: int, chunk: int) -> list[str]:
    """On the writer, what differs from the full tensor (read by pieces, by tensor(), and left unread)."""
    streaming.STREAM_CHUNK_BYTES = chunk
    group, wrong = torch.distributed.group.WORLD, []
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        for index, (partition, shape) in enumerate(partitions(world)):
            full = (torch.arange(torch.Size(shape).numel()) % 7 + 1).reshape(shape).to(dtype)
            shard = shard_of(full, partition, rank)
            stream = streaming.stream_full_to(shard, partition, group)
            streaming.stream_full_to(shard, partition, group)  # the first one is drained, unread
            streamed = streaming.stream_full_to(shard, partition, group)
            out, seen = torch.zeros(full.numel() * full.element_size(), dtype=torch.uint8), 0
            for offset, piece in [] if streamed is None else streamed.pieces():  # read before the next call
                data = bytearray(b"".join(piece) if isinstance(piece, list) else piece)  # a list: written in a row
                out[offset : offset + len(data)] = torch.frombuffer(data, dtype=torch.uint8) if data else out[:0]
                seen += len(data)
            streaming.stream_full_to(shard, partition, group)  # left unread: the gather below drains it first
            whole = streaming.gather_after_streams(shard, partition, group)
            if rank != 0:
                assert stream is None and streamed is None and whole is None
                continue
            expected = full.reshape(-1).view(torch.uint8)
            if seen != out.numel() or not torch.equal(out, expected) or stream.shape != full.shape:
                wrong.append(f"{dtype} partition {index}: pieces")
            if not torch.equal(whole, full):
                wrong.append(f"{dtype} partition {index}: tensor()")
    streaming.finish_streams()
    return wrong


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("chunk", [24, 8 << 20])  # pieces of a few rows (or part of one), and whole runs
def test_a_streamed_full_tensor_is_the_unsharded_tensor(world: int, chunk: int) -> None:
    assert run_ranks(stream_every_partition, world, chunk) == [[]] * world


def test_the_writer_refuses_a_tensor_whose_bytes_did_not_all_come(tmp_path: Path) -> None:
    writer = SafetensorsWriter(tmp_path / "x.safetensors", [("a", torch.float32, (4,))], {})

    class Short:
        dtype, shape, written_elsewhere = torch.float32, torch.Size([4]), 4

        def write_into(self, path: str, fd: int, position: int) -> None:
            pass

        def pieces(self):
            yield 0, memoryview(bytes(4))

    with pytest.raises(RuntimeError, match="8 of its 16 bytes came"):
        writer.write("a", Short())  # type: ignore[arg-type]
    writer.close()


def test_files_are_synced_only_before_a_swap_that_deletes_a_checkpoint(tmp_path: Path, monkeypatch) -> None:
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    save_tiny(tmp_path / "out")
    assert synced == [], "a save to a new directory deletes nothing: transformers does not sync either"
    save_tiny(tmp_path / "out", seed=1, overwrite=True)
    files = [p for p in synced if p.endswith(".safetensors")]
    assert files and all(Path(p).parent.name.startswith(".out.autotp-") for p in files), synced
    assert str(tmp_path) in synced, "the exchange itself is synced before the old checkpoint is deleted"


def test_a_replaced_checkpoint_is_deleted_after_the_save_returns(tmp_path: Path, monkeypatch) -> None:
    import threading

    release, removed = threading.Event(), []
    remove = staging._remove

    def slow(path: Path) -> None:
        release.wait(30)
        removed.append(path.name)
        remove(path)

    save_tiny(tmp_path / "out")
    monkeypatch.setattr(staging, "_remove", slow)
    save_tiny(tmp_path / "out", seed=1, overwrite=True)  # returns with the old checkpoint not yet deleted
    assert len(hidden(tmp_path)) == 1 and removed == []
    release.set()
    staging.wait_for_removals()
    assert hidden(tmp_path) == [] and len(removed) == 1


def save_with_senders(rank: int, world: int, target: str, mode: str) -> tuple[int, list[int], str]:
    """Save at tp=`world`; `mode` says how the senders' rows reach the file. Returns (the senders' own writes, the
    writer's file offsets in order, the error)."""
    import autotp.io.hf.safetensors as files
    import autotp.io.hf.save as save

    if hasattr(save, "gather_full_to"):  # save_pretrained's fetch, streaming as `stream_full_to` lets it
        save.gather_full_to = lambda shard, partition, group, dst=0: streaming.stream_full_to(shard, partition, group)
    wrote, offsets = [], []
    write_rows = files.write_rows
    if mode == "cannot":  # the file is not one the senders can open (another machine or container)
        save.write_rows = lambda path, identity, rows: streaming.CANNOT
    elif mode == "full-disk" and rank == 1:
        save.write_rows = lambda path, identity, rows: (
            -errno.ENOSPC if wrote.append(1) or len(wrote) == 2 else write_rows(path, identity, rows)
        )
    else:
        save.write_rows = lambda path, identity, rows: wrote.append(1) or write_rows(path, identity, rows)
    if mode == "sequential":  # a network or FUSE filesystem: the writer writes every byte, in order
        files.local_filesystem = lambda path: False
    pwrite = files.pwrite_all
    files.pwrite_all = lambda fd, data, position: offsets.append(position) or pwrite(fd, data, position)
    try:
        autotp.save_pretrained(autotp.wrap(tiny_model("llama"), world), target, max_shard_size="60KB")
    except OSError as err:
        return len(wrote), offsets, str(err)
    return len(wrote), offsets, ""


@pytest.mark.parametrize("mode", ["delegated", "cannot", "sequential"])
def test_the_senders_rows_reach_the_file_written_or_sent(tmp_path: Path, mode: str) -> None:
    """On a local filesystem the other ranks write their rows into the writer's file; else they send them."""
    results = run_ranks(save_with_senders, 2, str(tmp_path / "out"), mode)
    tiny_model("llama").save_pretrained(tmp_path / "plain", max_shard_size="60KB")
    for file in sorted((tmp_path / "plain").glob("*.safetensors")):
        ours, theirs = load_file(tmp_path / "out" / file.name), load_file(file)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), file.name
    (sent, _, _), (wrote, _, _) = results
    assert sent == 0 and (wrote > 0) == (mode == "delegated")
    if mode == "sequential":  # each file front to back (some filesystems take nothing else): its header, then on
        offsets = results[0][1]
        assert all(b > a for a, b in zip(offsets, offsets[1:]) if b != 0), offsets


def test_a_senders_failed_write_raises_on_every_rank(tmp_path: Path) -> None:
    (_, _, first), (_, _, second) = run_ranks(save_with_senders, 2, str(tmp_path / "out"), "full-disk")
    assert os.strerror(errno.ENOSPC) in first and "writing on rank 1" in first, first
    assert "failed on rank 0" in second and os.strerror(errno.ENOSPC) in second, second
    assert not (tmp_path / "out").exists() and hidden(tmp_path) == []
