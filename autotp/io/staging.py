"""Writing a directory atomically across ranks: stage it in a hidden sibling, rename it into place at the end.

A crash never leaves a directory that loads as a valid but incomplete checkpoint, and a refused
target (a non-empty directory without `overwrite=True`) is refused on every rank before anything
is written.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from ..groups import is_global_rank0


@contextmanager
def staged_directory(target: str | os.PathLike, overwrite: bool) -> Iterator[Path | None]:
    """A hidden sibling directory to write into, renamed onto `target` only when every rank succeeded.

    Collective under torch.distributed: rank 0 checks the target and creates the directory, every
    rank gets its path (a shared filesystem is assumed), and the rename waits for all of them.
    Rank 0 sees a refused target first and tells the others, so no rank is left waiting.
    """
    target = Path(target)
    distributed = dist.is_available() and dist.is_initialized()
    is_first = is_global_rank0()
    box: list = [None, None]
    if is_first:
        box[0] = _target_problem(target, overwrite)
        if box[0] is None:
            target.parent.mkdir(parents=True, exist_ok=True)
            box[1] = tempfile.mkdtemp(prefix=f".{target.name}.autotp-", dir=target.parent)
    if distributed:
        dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise FileExistsError(box[0])
    tmp = Path(box[1])
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        if distributed:  # everyone learns whether everyone finished
            flags = torch.tensor([0 if ok else 1])
            dist.all_reduce(flags)
            ok = flags.item() == 0
        if is_first:
            if ok:
                _move_into_place(tmp, target)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        if distributed:
            dist.barrier()


def _target_problem(target: Path, overwrite: bool) -> str | None:
    if target.is_file():
        return f"{target} is a file; save_pretrained needs a directory"
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        return f"{target} exists and is not empty; pass overwrite=True to replace it"
    return None


def _move_into_place(tmp: Path, target: Path) -> None:
    """Swap the finished directory in; an old one is removed only after the new one is in place."""
    old = None
    if target.exists():
        if any(target.iterdir()):
            old = target.with_name(f".{target.name}.autotp-old-{os.getpid()}")
            target.rename(old)
        else:
            target.rmdir()
    tmp.rename(target)
    if old is not None:
        shutil.rmtree(old)


def move_files_in(incoming: Path, target: Path) -> None:
    """Replace `target`'s model files by those of the complete checkpoint in `incoming`."""
    target.mkdir(parents=True, exist_ok=True)
    for stale in [*target.glob("model*.safetensors"), target / "model.safetensors.index.json"]:
        if stale.exists() and not (incoming / stale.name).exists():
            stale.unlink()
    for file in incoming.iterdir():
        os.replace(file, target / file.name)
    incoming.rmdir()
