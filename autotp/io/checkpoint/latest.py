"""`latest_checkpoint`: the newest training checkpoint in a directory that `save_checkpoint` finished, to resume from.

A save is finished when its directory is in place under its own name. `save_checkpoint` writes into a
hidden sibling (`autotp.io.staging`): every rank writes and fsyncs its data files (DCP's writer,
`sync_files`), rank 0 writes DCP's `.metadata` last (a temporary file, fsynced, then renamed), and only
once every rank reported success is the directory renamed into place. A save cut off at any point,
sync or async, leaves at most a hidden directory, which is never a candidate. A visible directory is
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
from . import legacy
from .save import FORMAT, META, read_index, read_meta, wait_for_pending
from ..errors import CheckpointError, world


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The newest checkpoint directly in `root` that `save_checkpoint` finished, or None (no such checkpoint, or
    no `root` yet). Under torch.distributed call it on every rank: rank 0 looks, and every rank gets its answer.
    An `async_save` of this process still being written is waited for first, and counts."""
    wait_for_pending()
    group = world()
    box: list = [None]
    if group is None or is_global_rank0():
        try:
            box[0] = ("ok", _newest(Path(root)))
        except (OSError, ValueError) as err:  # every rank must still receive rank 0's outcome
            box[0] = ("failed", type(err), str(err))
    if group is not None:
        with named_failure(group, "autotp.latest_checkpoint's broadcast of rank 0's choice",
                           "autotp.latest_checkpoint is collective: call it on every rank."):
            dist.broadcast_object_list(box, src=0)
    if box[0][0] == "failed":
        raise box[0][1](box[0][2])
    return box[0][1]


def _newest(root: Path) -> Path | None:
    if (root / META).is_file():
        raise ValueError(f"autotp.latest_checkpoint: {root} is itself a training checkpoint; pass the directory that "
                         f"holds your checkpoints ({root.parent})")
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
            found.append((entry, *_complete(entry)))
        except CheckpointError as err:
            warnings.warn(f"autotp.latest_checkpoint: skipping {entry}, not a complete checkpoint: {err}", stacklevel=3)
    if not found:
        return None
    by_step = all(isinstance(step, int) and not isinstance(step, bool) for _, step, _ in found)
    return max(found, key=lambda c: (c[1], c[2], c[0].name) if by_step else (c[2], c[0].name))[0]


def _complete(directory: Path) -> tuple[object, float]:
    """(the step its state records, when its save began) of a complete checkpoint; a `CheckpointError` otherwise."""
    meta = read_meta(directory)
    if meta["format"] == FORMAT:
        read_index(directory)
    else:
        legacy.check_files(directory, meta)
    state = meta["state"] if isinstance(meta["state"], dict) else {}
    return state.get("step"), meta.get("saved_at", (directory / META).stat().st_mtime)
