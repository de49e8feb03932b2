"""Process groups: TP groups of consecutive ranks, DP groups strided across them, and subgroups of TP ranks.

`new_group` is collective over the world, so every function here that creates groups must be
called by every rank, in the same order. A TP group of `None` means no tensor parallelism (size 1); a DP group is
a real group at every size (one rank when there is one replica), so a collective over it never reaches the world.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from .compat.torch import backend_timeout

Group = dist.ProcessGroup | None

# How long a collective may wait for a peer before failing, when neither the user's
# init_process_group nor wrap(..., timeout=) says otherwise (torch's own default is 30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=5)

_AT_FINISH: list[Callable[[], None]] = []  # work in the background that `finish` must wait for (async saves)


def group_size(group: Group) -> int:
    """Size of a group; `None` (no tensor parallelism, or no torch.distributed) is size 1, never the world group."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside a TP group (0 without one)."""
    return 0 if group is None else dist.get_rank(group)


def device_of(group: Group) -> torch.device:
    """The device a collective over `group` needs: this process's current GPU under NCCL, else the CPU (no group,
    gloo). The one place that decides it, so a model, a mesh and a message buffer all land on the same device."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank() -> int:
    """This process's rank in the world (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_global_rank0() -> bool:
    """Whether this process writes files and prints progress for the job (rank 0, or not distributed)."""
    return global_rank() == 0


def world_timeout() -> timedelta:
    """The timeout the default process group was created with, or `DEFAULT_TIMEOUT` without one (torch has no
    public getter: `autotp.compat.torch.backend_timeout` reads it)."""
    return backend_timeout() or DEFAULT_TIMEOUT


def new_group(ranks: list[int], timeout: timedelta, what: str, backend: str | None = None) -> dist.ProcessGroup:
    return dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=f"autotp {what} {ranks}")


@contextmanager
def named_failure(group: dist.ProcessGroup, what: str,
                  fix: str = "Every rank must run the same training step.") -> Iterator[None]:
    """Re-raise a failed or timed-out collective with the group's ranks and `fix` (what to do) in the message."""
    try:
        yield
    except RuntimeError as err:
        raise RuntimeError(f"autotp: {what} over ranks {dist.get_process_group_ranks(group)} failed ({err}); a rank "
                           f"of that group failed, hung or never called it. {fix}") from err


def build_subgroups(rank_sets: Iterable[tuple[int, ...]], tp_group: Group,
                    timeout: timedelta = DEFAULT_TIMEOUT) -> dict[tuple[int, ...], Group]:
    """Process groups for sets of TP-group ranks (replica holders), in this rank's TP group.

    `new_group` is collective over the world, so every rank creates every TP group's subgroups,
    in the same order; TP groups are learnt from all ranks so a user-supplied one works too.
    """
    rank_sets = sorted(set(rank_sets))
    if not rank_sets or group_size(tp_group) == 1:
        return {}
    mine, tp_groups = _all_tp_groups(tp_group)
    out = {}
    for subset in rank_sets:
        for tp_ranks in tp_groups:
            group = new_group([tp_ranks[i] for i in subset], timeout, "replica group")
            if tp_ranks == mine:
                out[subset] = group
    return out


def launched_by_torchrun() -> bool:
    """True when torchrun / accelerate set the variables `init_process_group` reads."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialise torch.distributed from launcher variables: NCCL on GPUs (device from LOCAL_RANK), else gloo."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def at_finish(wait: Callable[[], None]) -> None:
    """Have `finish` call `wait` first (a higher tier's background work, such as an async checkpoint save)."""
    _AT_FINISH.append(wait)


def finish() -> None:
    """End a distributed script: wait for background saves, a barrier over the world, then `destroy_process_group`.
    Call it on every rank.

    A gloo worker thread drops its reference to a collective's tensors just after the caller's wait
    returns. If that rank's interpreter is already shutting down, the thread cannot take the GIL and the
    process aborts with "terminate called without an active exception" (a torch/CPython race, seen in
    about 1 of 6 four-rank runs that exit straight after a collective). The barrier holds no tensors
    and leaves the workers time to let go before anyone exits.
    """
    for wait in _AT_FINISH:
        wait()
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def build_groups(tp_size: int, timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[Group, Group]:
    """TP groups of consecutive ranks and DP groups strided across them; returns this rank's pair.

    Every rank must call this, in the same order, because `new_group` is collective. The DP group exists at
    dp size 1 too (this rank alone), so `dist.all_reduce(x, group=dp_group)` never falls back to the world.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    tp_group = dp_group = None
    for start in range(0, world, tp_size):
        ranks = list(range(start, start + tp_size))
        group = new_group(ranks, timeout, "TP group") if tp_size > 1 else None
        if rank in ranks:
            tp_group = group
    for offset in range(tp_size):
        ranks = list(range(offset, world, tp_size))
        group = new_group(ranks, timeout, "DP group")
        if rank in ranks:
            dp_group = group
    return tp_group, dp_group


def _all_tp_groups(tp_group: dist.ProcessGroup) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """This rank's TP group and every TP group of the world, as global ranks (collective)."""
    mine = tuple(dist.get_process_group_ranks(tp_group))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return mine, sorted(set(everyone))


def dp_group_for(tp_group: dist.ProcessGroup, timeout: timedelta = DEFAULT_TIMEOUT) -> Group:
    """The DP group matching a user-supplied TP group: the ranks at the same position of every TP group (this rank
    alone when there is one TP group)."""
    mine, tp_groups = _all_tp_groups(tp_group)
    position = mine.index(dist.get_rank())
    out = None
    for index in range(len(mine)):
        group = new_group([g[index] for g in tp_groups], timeout, "DP group")
        if index == position:
            out = group
    return out


def build_cp_groups(tp_size: int, cp_size: int, timeout: timedelta = DEFAULT_TIMEOUT) -> tuple[Group, Group, Group,
                                                                                                Group]:
    """(TP, CP, DP x CP, DP) groups of this rank for a world of dp x cp x tp: TP innermost, CP next.

    Rank `(d * cp + c) * tp + t` is TP rank t, CP rank c of replica d. The DP x CP group (every rank holding the
    same TP shard, strided by tp) is what `build_groups` calls the DP group: gradients are averaged over it and FSDP
    shards over it. The DP group (the same CP and TP rank in every replica) is what reads different batches.
    Collective over the world, like `build_groups`."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % (tp_size * cp_size):
        raise ValueError(f"tp_size={tp_size} x cp_size={cp_size} must divide the world size {world} "
                         f"(world = data parallel x context parallel x tensor parallel)")
    tp_group, dp_cp_group = build_groups(tp_size, timeout)
    if cp_size == 1:
        return tp_group, None, dp_cp_group, dp_cp_group
    dp = world // (tp_size * cp_size)
    cp_group = dp_group = None
    for d in range(dp):
        for t in range(tp_size):
            ranks = [(d * cp_size + c) * tp_size + t for c in range(cp_size)]
            group = new_group(ranks, timeout, "CP group")
            if rank in ranks:
                cp_group = group
    for c in range(cp_size):
        for t in range(tp_size):
            ranks = [(d * cp_size + c) * tp_size + t for d in range(dp)]
            group = new_group(ranks, timeout, "DP group")
            if rank in ranks:
                dp_group = group
    return tp_group, cp_group, dp_cp_group, dp_group
