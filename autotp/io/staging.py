"""Writing a directory atomically across ranks: stage it in a hidden sibling, swap it into place at the end.

Every rank calls `staged_directory`; global rank 0 alone touches the filesystem around the body (and, for a body
that returns before its background write ends, from that write's thread once it completed: `place_now`).
Any failure is raised on every rank, so no rank waits in a collective for a peer that gave up:
- a rank that never calls the save is reported within `ENTRY_TIMEOUT` (gloo);
- a refused target, or an OS error while rank 0 sets up, reaches every rank before anything is written;
- a failure in the body on any rank, or in rank 0's final swap, reaches every rank after it.

The swap must leave a complete checkpoint, old or new, at the target whenever the process dies.
rename(2) cannot replace a non-empty directory, so renaming the target away and the new one in
leaves a moment with no target. On Linux the two directories are exchanged in one step with
renameat2(RENAME_EXCHANGE) instead, and the old one, now at the staging path, is deleted after.
(A target that is a symlink to versioned directories would also be atomic, but it changes what
users see on disk and cannot replace an existing real directory atomically either.) Where the
exchange is unavailable (other systems; filesystems such as NFS answer EINVAL) the two renames
remain, and a save to the same target after a crash between them puts the old checkpoint back.
The old checkpoint is deleted in a background thread once the new one is in place (freeing a file's
cached pages takes about as long as writing them); the next save, `autotp.finish()` and the
interpreter's exit wait for it, and a process killed meanwhile leaves it to the next save's cleanup.

Durability (a machine crash, not a process's): the files are fsynced only before a swap that deletes
an old checkpoint, since that is the one moment a crash could lose both (ext4 and XFS may commit the
rename before the data). A save to a new or empty target is not synced, as transformers' is not: a
machine crash within the kernel's writeback delay can leave it truncated, which then fails to load
rather than loading wrong. Syncing costs about the disk's write time (here, 2x the save).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from ..mesh import at_finish, is_global_rank0, named_failure, world_timeout
from .errors import describe, failures, world
from .streaming import finish_streams

# How long a save waits for every rank to call it before failing (gloo; NCCL waits for the group's
# timeout). None: the world group's timeout, the bound every other collective has. A shorter
# default would fail correct programs in which one rank arrives late (rank 0 evaluating alone).
ENTRY_TIMEOUT: timedelta | None = None

_ENTRY_TAG = 0x41545053  # the entry check's point-to-point tag, apart from a user's (0 by default)
_RANDOM = "[a-z0-9_]{8}"  # the random part of a tempfile.mkdtemp name
_INDEX = "model.safetensors.index.json"


@contextmanager
def staged_directory(
    target: str | os.PathLike, overwrite: bool, *, what: str = "autotp.save_pretrained", into_existing: bool = False
) -> Iterator[Path]:
    """A hidden sibling directory to write into, put in place at `target` only when every rank succeeded.

    Collective under torch.distributed (`what` names the call in errors); every rank gets the same
    path, so a shared filesystem is assumed. `into_existing=True` keeps the target's other files
    and replaces only its model files.
    """
    target = Path(target)
    group = world()
    if group is not None:
        _all_ranks_enter(what)
    box: list = [_prepare(target, overwrite or into_existing, what) if is_global_rank0() else None]
    if group is not None:
        with named_failure(
            group,
            f"{what}'s broadcast of the staging directory from rank 0",
            f"{what} is collective: call it on every rank.",
        ):
            dist.broadcast_object_list(box, src=0)
    kind, *detail = box[0]
    if kind == "refused":
        raise FileExistsError(detail[0])
    if kind == "failed":
        code, message, filename = detail
        raise OSError(code, message, filename) if code is not None else RuntimeError(message)
    tmp = Path(detail[0])
    error = None
    try:
        yield tmp
    except BaseException as err:  # every rank must still learn the outcome below
        error = err
    try:
        finish_streams()  # a gathered tensor the body left unread (a failed writer skips the rest) is drained
    except Exception as err:
        error = error or err
    try:
        failed = failures(error, group)
    except RuntimeError as lost:  # a peer died or hung: nothing is put in place
        if is_global_rank0():
            _remove(tmp)
        if error is not None:
            raise error from lost
        raise
    finish_error = None
    if is_global_rank0():
        try:
            if tmp in _placed:  # put in place already, when the body's background write completed
                placed = _placed.pop(tmp)
                if placed is not None:
                    raise placed
            elif failed:
                _remove(tmp)
            elif into_existing:
                move_files_in(tmp, target)
            else:
                _move_into_place(tmp, target)
        except Exception as err:
            finish_error = err
            _remove(tmp)
    finished = failures(finish_error, group)  # also keeps every rank until rank 0 is done
    if error is not None:
        raise error
    if finish_error is not None:
        raise finish_error
    if failed or finished:
        failed = failed or finished
        message = f"{what} to {target} failed on {describe(failed)}"
        code = failed[min(failed)][0]
        raise OSError(code, message) if code is not None else RuntimeError(message)


_placed: dict[Path, Exception | None] = {}  # staged directories `place_now` handled -> its failure (None: in place)


def place_now(tmp: Path, target: Path) -> None:
    """Global rank 0, before its `staged_directory` ends: put the staged `tmp` in place at `target` now, without a
    collective (from a background thread: an async save's, once every rank's write is known to be complete). The
    context's end then only exchanges the outcome: a failure here is raised there, on every rank."""
    try:
        _move_into_place(tmp, target)
        _placed[tmp] = None
    except Exception as err:
        _remove(tmp)
        _placed[tmp] = err


def _all_ranks_enter(what: str) -> None:
    """Fail within `ENTRY_TIMEOUT`, with an error that says so, when some rank never calls `what`.

    On gloo every rank checks in with rank 0 and waits for its answer, each wait bounded
    (`monitored_barrier` bounds only rank 0's: the others would wait for the group's timeout).
    NCCL has no bounded wait, so there a plain barrier waits for the group's timeout.
    """
    collective = f"{what} is collective: call it on every rank"
    if dist.get_backend() != "gloo":
        with named_failure(dist.group.WORLD, f"{what}'s barrier on entry", f"{collective}."):
            dist.barrier()
        return
    timeout = ENTRY_TIMEOUT or world_timeout()
    deadline = time.monotonic() + timeout.total_seconds()
    if dist.get_rank() == 0:
        others = range(1, dist.get_world_size())
        arrived = {rank: dist.irecv(torch.zeros(1), rank, tag=_ENTRY_TAG) for rank in others}
        missing = [rank for rank, work in arrived.items() if not _completes(work, deadline)]
        if missing:
            raise RuntimeError(f"{collective}: ranks {missing} did not call it within {timeout}")
        for work in [dist.isend(torch.zeros(1), rank, tag=_ENTRY_TAG) for rank in others]:
            work.wait()
    else:
        sent = dist.isend(torch.zeros(1), 0, tag=_ENTRY_TAG)
        if not _completes(dist.irecv(torch.zeros(1), 0, tag=_ENTRY_TAG), deadline):
            raise RuntimeError(f"{collective}: rank 0 did not confirm within {timeout} that every rank called it")
        sent.wait()


def _completes(work: dist.Work, deadline: float) -> bool:
    """Whether a gloo send or receive completes before `deadline` (a peer that exited counts as never)."""
    try:
        work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except RuntimeError:
        return False
    return True


def _prepare(target: Path, keep_existing: bool, what: str) -> tuple:
    """Rank 0: clear stale staging, check the target, create the staging directory.

    Returns the outcome instead of raising it, so that it can be broadcast and raised on every rank.
    """
    try:
        wait_for_removals()
        _remove_stale(target)
        if target.is_file():
            return ("refused", f"{target} is a file; {what} needs a directory")
        if target.is_dir() and any(target.iterdir()) and not keep_existing:
            return ("refused", f"{target} exists and is not empty; pass overwrite=True to replace it")
        target.parent.mkdir(parents=True, exist_ok=True)
        return ("ok", tempfile.mkdtemp(prefix=f".{target.name}.autotp-{os.getpid()}-", dir=target.parent))
    except OSError as err:
        return ("failed", err.errno, f"{err.strerror or err} ({what} could not stage {target})", err.filename)
    except Exception as err:
        return ("failed", None, f"{what} could not stage {target}: {type(err).__name__}: {err}", None)


def _remove_stale(target: Path) -> None:
    """Delete what saves to `target` killed earlier left next to it, never a save still in progress.

    Only names this module makes for this target match. They carry the saving process's PID
    (`.{name}.autotp-{pid}-XXXXXXXX`, `.{name}.autotp-old-{pid}`), and a directory whose process
    still runs is kept. PIDs are checked on this machine: a lock file would survive the kill it is
    meant to detect, and an age threshold would either wait long or take a slow save's directory.
    (Two jobs on different machines saving to one target at once overwrite each other anyway.)
    Names from autotp versions without the PID (`.{name}.autotp-XXXXXXXX`, `.{name}.autotp-incoming`
    and its own `..{name}.autotp-incoming.autotp-XXXXXXXX`) are stale, as no current save makes them.
    A stale `-old-` directory while the target is missing is a swap killed between its two
    renames: that complete old checkpoint is put back.
    """
    if not target.parent.is_dir():
        return
    name = re.escape(target.name)
    ours = re.compile(
        rf"\.{name}\.autotp-(?:(?P<pid>\d+)-{_RANDOM}|old-(?P<old>\d+)|{_RANDOM}|incoming)"
        rf"|\.\.{name}\.autotp-incoming\.autotp-{_RANDOM}"
    )
    for entry in sorted(target.parent.iterdir()):
        match = ours.fullmatch(entry.name)
        if match is None or _running(int(match["pid"] or match["old"] or 0)):
            continue
        if match["old"] is not None and not os.path.lexists(target):
            os.rename(entry, target)
        else:
            _remove(entry)


def _running(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # gone, or no PID at all
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _move_into_place(tmp: Path, target: Path) -> None:
    """Put the finished directory at `target` so that a crash at any point leaves the old or the new one there."""
    if not (target.is_dir() and any(target.iterdir())):
        os.replace(tmp, target)  # onto a missing path or an empty directory: one atomic rename
        return
    _sync(tmp)  # an old checkpoint is about to go: the new one must be on disk first
    if _exchange(tmp, target):
        _sync(target.parent, files=False)
        _remove_later(tmp)  # the old checkpoint, now
        return
    old = target.with_name(f".{target.name}.autotp-old-{os.getpid()}")
    os.rename(target, old)  # until the next rename there is no target; see `_remove_stale`
    try:
        os.rename(tmp, target)
    except OSError:
        os.rename(old, target)
        raise
    _sync(target.parent, files=False)
    _remove_later(old)


_removals: list[threading.Thread] = []


def _remove_later(path: Path) -> None:
    """Delete a replaced checkpoint in the background (see the module's docstring)."""
    thread = threading.Thread(target=_remove, args=(path,), name="autotp-remove-old-checkpoint")
    thread.start()
    _removals.append(thread)


def wait_for_removals() -> None:
    """Block until every replaced checkpoint this process is deleting in the background is gone."""
    while _removals:
        _removals.pop().join()


at_finish(wait_for_removals)


def _sync(directory: Path, files: bool = True) -> None:
    """fsync `directory`, and with `files` every file and folder under it (see the module's docstring for when)."""
    for folder, _, names in os.walk(directory) if files else [(str(directory), [], [])]:
        for path in [*(os.path.join(folder, n) for n in names if files), folder]:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:  # a directory cannot be opened on some systems; there is nothing to sync then
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False where that is unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(a), at_cwd, os.fsencode(b), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):  # the kernel or this filesystem cannot
        return False
    raise OSError(code, os.strerror(code), str(b))


def move_files_in(incoming: Path, target: Path) -> None:
    """Replace `target`'s model files by those of the complete checkpoint in `incoming`, keeping its other files.

    The index moves last and stale shards go after it, so a crash midway leaves the old index with
    its old shards, unless a new shard has the same name as an old one (then the file is replaced).
    """
    target.mkdir(parents=True, exist_ok=True)
    stale = [
        f
        for f in [*target.glob("model*.safetensors"), target / _INDEX]
        if f.exists() and not (incoming / f.name).exists()
    ]
    replaced = stale or any((target / f.name).exists() for f in incoming.iterdir())
    if replaced:
        _sync(incoming)  # old files are about to go: the new ones must be on disk first
    for file in sorted(incoming.iterdir(), key=lambda f: f.name == _INDEX):
        os.replace(file, target / file.name)
    if replaced:
        _sync(target, files=False)
    for file in stale:
        file.unlink()
    incoming.rmdir()
