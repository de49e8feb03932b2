"""`latest_checkpoint`: the newest training checkpoint in a directory that `save_checkpoint` finished, to resume from.

A save is finished when its directory is in place under its own name. `save_checkpoint` writes into a
hidden sibling (`autotp.io.staging`): every rank writes and fsyncs its data files (DCP's writer,
`sync_files`), rank 0 writes DCP's `.metadata` last (a temporary file, fsynced, then renamed), and only
once every rank reported success is the directory renamed into place (an async save's by rank 0 as soon as its
write completes: `autotp.io.checkpoint.save._Pending`). A save cut off at any point, sync or async, leaves at most a
hidden directory, which is never a candidate. A visible directory is
also checked as `load_checkpoint` checks it before reading anything (its `autotp_checkpoint.json`,
DCP's index, every data file at the length the index gives it); one that fails (damaged, partly
copied) is skipped with a warning naming what is wrong, so the older complete one is taken.

Newest is the largest `step` in the checkpoints' own state (`save_checkpoint(..., step=N)`), not a
name or a modification time: `step-10` sorts before `step-9`, and copying resets mtimes. When some
checkpoint has no integer `step`, the time each save began, recorded in it, orders them.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch.distributed as dist

from ...mesh import is_global_rank0, named_failure
from ..errors import CheckpointError, world
from . import legacy
from .save import FORMAT, META, read_index, read_meta, wait_for_pending


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint directly in `root` that `save_checkpoint` finished, or None (no such checkpoint, or
    no `root` yet). Under torch.distributed call it on every rank: rank 0 looks, and every rank gets its answer.
    An `async_save` of this process still being written is waited for first, and counts."""
    wait_for_pending()
    group = world()
    box: list = [(None, None)]  # (the newest, rank 0's error)
    error = None
    if group is None or is_global_rank0():
        try:
            box[0] = (_newest(Path(root)), None)
        except Exception as err:  # every rank must still receive rank 0's outcome
            error, box[0] = err, (None, f"{type(err).__name__}: {err}")
    if group is not None:
        with named_failure(
            group,
            "autotp.latest_checkpoint's broadcast of rank 0's choice",
            "autotp.latest_checkpoint is collective: call it on every rank.",
        ):
            dist.broadcast_object_list(box, src=0)
    newest, failed = box[0]
    if error is not None:
        raise error
    if failed is not None:
        raise RuntimeError(f"autotp.latest_checkpoint failed on rank 0: {failed}")
    return newest


def _newest(root: Path) -> Path | None:
    if (root / META).is_file():
        raise ValueError(
            f"autotp.latest_checkpoint: {root} is itself a training checkpoint; pass the directory that "
            f"holds your checkpoints ({root.parent})"
        )
    if not root.exists():
        return None
    if not root.is_dir():
        raise NotADirectoryError(f"autotp.latest_checkpoint: {root} is not a directory")
    found = []
    for entry in sorted(root.iterdir()):
        markers = (entry / META, entry / ".metadata")
        if entry.name.startswith(".") or not entry.is_dir() or not any(f.exists() for f in markers):
            continue  # a save in progress or cut off (hidden), or not a training checkpoint
        try:
            found.append((entry, read_meta(entry)))
        except CheckpointError as err:
            _skip(entry, err)
    by_step = all(_step(meta) is not None for _, meta in found)

    def order(candidate: tuple[Path, dict]) -> tuple:
        entry, meta = candidate
        began = meta.get("saved_at", (entry / META).stat().st_mtime)  # checkpoints of older autotp lack it
        return (_step(meta) if by_step else 0, began, entry.name)

    for entry, meta in sorted(found, key=order, reverse=True):  # newest first: usually one index is read
        try:
            if meta["format"] == FORMAT:
                read_index(entry)
            else:
                legacy.check_files(entry, meta)
            return entry
        except CheckpointError as err:
            _skip(entry, err)
    return None


def _step(meta: dict) -> int | None:
    """The integer `step` of the checkpoint's user state, if it has one."""
    step = meta["state"].get("step") if isinstance(meta["state"], dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def _skip(entry: Path, err: CheckpointError) -> None:
    warnings.warn(f"autotp.latest_checkpoint: skipping {entry}, not a complete checkpoint: {err}", stacklevel=4)
