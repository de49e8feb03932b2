"""AutoTPTrainer's optimizer files before `optimizer/` (one per TP rank, per TP and DP rank under FSDP): still read
at the layout they were saved at; at another one the error says how they were laid out."""

from __future__ import annotations

import re

OPTIMIZER_FILE = re.compile(r"optimizer\.tp\d+-of-(\d+)(?:\.dp\d+-of-(\d+))?\.pt")
OLD_FORMAT = (
    "These per-rank files are autotp's format before `optimizer/`, and fit only the layout they were saved "
    "at: resume there once, and the checkpoints that run writes resume at any tp, dp and fully_shard"
)


def layout_difference(found: list[str], tp: int, dp: int | None) -> str:
    """How the older per-rank optimizer files `found` in a checkpoint were laid out, against this run's `tp` size and,
    under FSDP, `dp` size (None: DDP, whole TP shards)."""
    layouts = {(int(m[1]), None if m[2] is None else int(m[2])) for m in map(OPTIMIZER_FILE.fullmatch, found) if m}
    if len(layouts) != 1:
        return f"the checkpoint holds {found or 'no optimizer state'}"
    ((saved_tp, saved_dp),) = layouts
    saved = f"tp={saved_tp}" + (f", fully_shard at dp={saved_dp}" if saved_dp is not None else " without fully_shard")
    now = f"tp={tp}" + (f", fully_shard at dp={dp}" if dp is not None else " without fully_shard")
    if (saved_tp, saved_dp) == (tp, dp):
        return (
            f"the checkpoint holds {', '.join(found)} of this same layout but not this rank's file (a save that "
            f"did not finish, or a file removed since): resume from another checkpoint"
        )
    return f"the checkpoint was saved at {saved} ({', '.join(found)}), this run has {now}. {OLD_FORMAT}"
