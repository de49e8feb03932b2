"""`autotp.latest_checkpoint`: the newest checkpoint `save_checkpoint` finished, never one cut off; and a tp 2 job
killed mid-run (SIGKILL of one rank) and launched again resumes from it and ends where one process ends."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import autotp
import requeue_job
from autotp.testing import parity
from autotp.testing.spawn import free_port, run_ranks
from models import tiny_model, trained_llama

pytestmark = pytest.mark.timeout(120)


def save_at_tp1(directory: Path, **state) -> None:
    model = autotp.wrap(tiny_model("llama"), 1)
    autotp.save_checkpoint(directory, model, torch.optim.AdamW(model.parameters()), **state)


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


def test_no_checkpoint_in_a_missing_or_empty_root_or_among_other_files(tmp_path: Path) -> None:
    assert autotp.latest_checkpoint(tmp_path / "ckpt") is None  # the first launch: nothing saved yet
    (tmp_path / "ckpt").mkdir()
    assert autotp.latest_checkpoint(tmp_path / "ckpt") is None
    tiny_model("llama").save_pretrained(tmp_path / "ckpt" / "final")  # a full HF checkpoint is not a training one
    (tmp_path / "ckpt" / "notes.txt").write_text("")
    assert autotp.latest_checkpoint(tmp_path / "ckpt") is None


def test_the_newest_is_the_largest_step_not_the_name_nor_the_mtime(tmp_path: Path) -> None:
    save_at_tp1(tmp_path / "step-10", step=10)
    save_at_tp1(tmp_path / "step-9", step=9)
    later = time.time() + 3600
    os.utime(tmp_path / "step-9", (later, later))  # copied or touched later: still the older one
    assert autotp.latest_checkpoint(tmp_path) == tmp_path / "step-10"


def test_without_a_step_the_save_that_began_last_is_newest_and_an_async_save_counts(tmp_path: Path) -> None:
    save_at_tp1(tmp_path / "b")
    model = autotp.wrap(tiny_model("llama"), 1)
    autotp.save_checkpoint(tmp_path / "a", model, torch.optim.AdamW(model.parameters()), async_save=True)
    assert autotp.latest_checkpoint(tmp_path) == tmp_path / "a"  # waited for, then in place


def save_steps(rank: int, world: int, root: str) -> None:
    model, optimizer = trained_llama(world)
    for step in (4, 6):
        autotp.save_checkpoint(f"{root}/step-{step}", model, optimizer, step=step)


@pytest.fixture(scope="module")
def saved_tp2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """step-4 and step-6, saved at tp 2: the data of each rank in its own file."""
    root = tmp_path_factory.mktemp("saved") / "ckpt"
    run_ranks(save_steps, 2, str(root))
    return root


@pytest.fixture
def root(saved_tp2: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved_tp2, tmp_path / "ckpt"))


def latest_on_each_rank(rank: int, world: int, root: str) -> str:
    return str(autotp.latest_checkpoint(root))


def test_every_rank_gets_the_newest(root: Path) -> None:
    assert run_ranks(latest_on_each_rank, 2, str(root)) == [str(root / "step-6")] * 2


def test_a_save_still_hidden_in_its_staging_directory_is_never_returned(root: Path) -> None:
    """What a save cut off before its rename leaves, with its data written (a save killed while rank 0 renamed)."""
    shutil.copytree(root / "step-6", root / ".step-8.autotp-4242-abcd1234")
    meta = root / ".step-8.autotp-4242-abcd1234" / "autotp_checkpoint.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "state": {"step": 8}}))
    assert autotp.latest_checkpoint(root) == root / "step-6"


@pytest.mark.parametrize(
    "file,how,named",
    [
        (".metadata", "delete", "cannot be read"),  # the commit marker DCP's rank 0 writes last
        ("__1_0.distcp", "delete", "missing"),  # a rank's data
        ("__0_0.distcp", "truncate", "a truncated file"),
        ("autotp_checkpoint.json", "truncate", "cannot be read as JSON"),
    ],
)
def test_an_incomplete_checkpoint_is_skipped_for_the_older_complete_one(
    root: Path, file: str, how: str, named: str
) -> None:
    damaged = root / "step-6" / file
    if how == "delete":
        damaged.unlink()
    else:
        damaged.write_bytes(damaged.read_bytes()[:-100])
    with pytest.warns(UserWarning, match="skipping") as caught:
        assert autotp.latest_checkpoint(root) == root / "step-4"
    message = str(caught[0].message)
    assert str(damaged) in message and named in message, message


def refused_on_each_rank(rank: int, world: int, root: str) -> str:
    with pytest.raises(Exception) as err:
        autotp.latest_checkpoint(root)
    return f"{type(err.value).__name__}: {err.value}"


def test_a_checkpoint_itself_as_root_is_refused_with_its_parent_on_every_rank(root: Path) -> None:
    expected = (
        f"{root / 'step-6'} is itself a training checkpoint; pass the directory that holds your checkpoints ({root})"
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        autotp.latest_checkpoint(root / "step-6")
    first, second = run_ranks(refused_on_each_rank, 2, str(root / "step-6"))
    assert first.startswith("ValueError: ") and expected in first, first
    assert second.startswith("RuntimeError: autotp.latest_checkpoint failed on rank 0: ValueError: "), second
    assert expected in second, second


def test_the_older_per_rank_format_counts_when_every_rank_wrote_its_files(tmp_path: Path) -> None:
    save_at_tp1(tmp_path / "step-4", step=4)
    old = tmp_path / "old-step-6"
    for rank in range(2):
        (old / f"rank-{rank:05d}").mkdir(parents=True)
        for name in ("model.safetensors", "rng.safetensors", "state.json"):
            (old / f"rank-{rank:05d}" / name).write_text("")
    (old / "autotp_checkpoint.json").write_text(
        json.dumps(
            {"format": "autotp-checkpoint/1", "tp_size": 2, "world_size": 2, "state": {"step": 6}, "partitions": {}}
        )
    )
    assert autotp.latest_checkpoint(tmp_path) == old
    (old / "rank-00001" / "state.json").unlink()
    with pytest.warns(UserWarning, match=f"{old / 'rank-00001' / 'state.json'}: missing"):
        assert autotp.latest_checkpoint(tmp_path) == tmp_path / "step-4"


# --- a job killed and requeued ------------------------------------------------------------------------------------


def launch(root: Path, kill: str | None, logs: Path) -> tuple[list[int], str]:
    """Both ranks of `requeue_job.py`, started as torchrun starts them. When one dies the other is killed, as torchrun
    and schedulers stop a job whose rank failed. Returns the exit codes and rank 0's output. A free port taken by
    another process before rank 0 bound it is retried on a new one, as `run_ranks` does."""
    for _ in range(3):
        codes, out = launch_once(root, kill, logs)
        if "address already in use" not in out.lower():
            break
    return codes, out


def launch_once(root: Path, kill: str | None, logs: Path) -> tuple[list[int], str]:
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("REQUEUE_KILL", None)
    if kill is not None:
        env["REQUEUE_KILL"] = kill
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(2):
        with open(logs / f"{rank}.log", "w") as out:
            procs.append(
                subprocess.Popen(
                    [sys.executable, requeue_job.__file__, str(root)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                )
            )
    try:
        deadline = time.monotonic() + 120  # a launch takes 15 s on 2 idle cores, 60 s on busy ones
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        if any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        codes = [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return codes, (logs / "0.log").read_text()


def visible(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if not p.name.startswith("."))


@pytest.mark.slow  # three launches of two fresh processes; the selection itself is tested quickly above
@pytest.mark.timeout(300)
def test_a_tp2_job_killed_twice_and_requeued_ends_as_one_process_does(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    # 1. rank 1 dies at the start of step 4: step-2 is in place, step-4's async write was never put in place.
    codes, out = launch(root, "start:4", tmp_path / "logs1")
    assert codes[1] == -signal.SIGKILL and "from step 0: None" in out, (codes, out)
    assert visible(root) == ["step-2"] and any(h.startswith(".step-4.autotp-") for h in hidden(root)), hidden(root)
    # 2. requeued: resumes from step 2; rank 1 dies just after the async save of step 6 began (step-4 put in place).
    codes, out = launch(root, "saving:6", tmp_path / "logs2")
    assert codes[1] == -signal.SIGKILL and f"from step 2: {root / 'step-2'}" in out, (codes, out)
    assert visible(root) == ["step-2", "step-4"] and any(h.startswith(".step-6.autotp-") for h in hidden(root))
    # 3. requeued again: resumes from step 4 and runs to the end.
    codes, out = launch(root, None, tmp_path / "logs3")
    assert codes == [0, 0] and f"from step 4: {root / 'step-4'}" in out, (codes, out)
    assert visible(root) == ["step-2", "step-4", "step-6", "step-8"] and hidden(root) == [], os.listdir(root)

    model = requeue_job.build()  # the uninterrupted run: one process, the same seed and calls
    optimizer = requeue_job.make_optimizer(model)
    for step in range(requeue_job.STEPS):
        requeue_job.train_step(model, optimizer, step)
    final = requeue_job.build()
    assert autotp.latest_checkpoint(root) == root / "step-8"
    assert autotp.load_checkpoint(root / "step-8", final) == {"step": 8}
    # fp32: tp 2 sums its partial matmuls in another order than one process, nothing else differs.
    worst = max(((p - final.state_dict()[n]).abs().max().item(), n) for n, p in model.state_dict().items())
    assert worst[0] <= parity.PARAM_ATOL, worst
