"""The errors of autotp's file I/O, and how one rank's failure reaches every rank.

Each message names the file or tensor and the numbers. A collective save or load must fail on
every rank or on none: a rank that raises alone leaves its peers blocked in the next collective
until the timeout, or lets them carry on believing the checkpoint was written or loaded.
"""

from __future__ import annotations

import torch.distributed as dist

from ..mesh import global_rank, named_failure


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor and the numbers."""


class FormatError(CheckpointError):
    """A file that is not valid safetensors."""


def world() -> dist.ProcessGroup | None:
    """The world group when torch.distributed is running (None: one process, nothing to agree on)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def outcomes(
    error: BaseException | None, group: dist.ProcessGroup | None, shared: object = None
) -> tuple[dict[int, tuple[int | None, str]], dict[int, object]]:
    """(every failed rank -> (errno, message); every rank -> its `shared`), the same on every rank of `group`
    (collective over it: one all-gather; None: no peers, this rank alone).

    Every rank must call it, whether or not it failed, at the same point.
    """
    mine = None if error is None else (getattr(error, "errno", None), f"{type(error).__name__}: {error}")
    everyone: list = [(global_rank(), mine, shared)]
    if group is not None:
        everyone = [None] * dist.get_world_size(group)
        with named_failure(group, "the exchange of every rank's outcome", "Every rank must reach this call."):
            dist.all_gather_object(everyone, (global_rank(), mine, shared), group=group)
    return (
        {rank: outcome for rank, outcome, _ in everyone if outcome is not None},
        {rank: theirs for rank, _, theirs in everyone},
    )


def failures(error: BaseException | None, group: dist.ProcessGroup | None) -> dict[int, tuple[int | None, str]]:
    """Every failed rank -> (errno, message), the same on every rank of `group` (`outcomes`, collective over it)."""
    return outcomes(error, group)[0]


def describe(failed: dict[int, tuple[int | None, str]]) -> str:
    """'rank 1: OSError: ...; rank 3: ...' for an error message."""
    return "; ".join(f"rank {rank}: {text}" for rank, (_, text) in sorted(failed.items()))


def agree(
    error: BaseException | None,
    group: dist.ProcessGroup | None,
    what: str,
    then: str = "",
    failed: dict[int, tuple[int | None, str]] | None = None,
) -> None:
    """Raise on every rank of `group` if `error` happened on any (collective): a failed rank its own error, the others
    a RuntimeError naming each failed rank's (then `then`, what to do), so that no rank goes on into a collective that
    its peers skip. `failed`: the failures when the caller has exchanged them already (`outcomes`; then no collective).
    """
    failed = failures(error, group) if failed is None else failed
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"{what} failed on {describe(failed)}{then}")
