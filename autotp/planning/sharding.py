"""Partition arithmetic: which rows of a full tensor each TP rank holds.

A `Partition` is pure data, free of process groups, so plans can be built and printed anywhere.
Along one dim, rank r holds the runs `runs[r]` of full-tensor rows, concatenated in order. Runs
of different ranks are either disjoint (sharded) or identical (replicated, as a KV head shared by
several ranks); replicated runs get their gradients summed over exactly the ranks that share them.

Fused tensors are described by a layout string over heads (or MLP width):
    "q"             all query heads                 (q_proj, o_proj input)
    "k", "v"        all key / value heads           (k_proj, v_proj)
    "q | k | v"     concatenated parts              (Phi-3 qkv_proj, GPT-2 c_attn, MQA c_attn)
    "(q* k v)"      per KV group: its query heads, then its k and v head (GPT-NeoX, Bloom, Falcon)
    "w", "w | w"    MLP width, plain or concatenated gate|up (Phi-3 gate_up_proj, MoE experts)
    "(w w)"         MLP width, gate and up interleaved column by column (gpt-oss's experts: gate_up[..., ::2])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

import torch

Run = tuple[int, int]  # (start, length) in full-tensor rows


def split_sizes(total: int, parts: int) -> tuple[int, ...]:
    """Split `total` items into `parts` runs, earlier parts taking the remainder (14 over 4: 4/4/3/3)."""
    base, extra = divmod(total, parts)
    return tuple(base + (r < extra) for r in range(parts))


def split_ranges(total: int, parts: int) -> list[range]:
    """`split_sizes` as consecutive ranges of item indices (14 over 4: 0-3, 4-7, 8-10, 11-13)."""
    return _ranges(split_sizes(total, parts))


def _ranges(sizes: Sequence[int]) -> list[range]:
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    return out


class Holding(NamedTuple):
    """One run of full rows, the rank to read it from, where it lies in that rank's shard, and every rank holding it."""

    start: int
    length: int
    rank: int
    offset: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Partition:
    """Rows of a full tensor held by each TP rank along `dim`: `runs[r]` = ((start, length), ...)."""

    dim: int
    full_size: int
    runs: tuple[tuple[Run, ...], ...]

    def __post_init__(self) -> None:
        covered = [0] * self.full_size
        seen: dict[Run, int] = {}
        for rank_runs in self.runs:
            for start, length in rank_runs:
                if start < 0 or length < 0 or start + length > self.full_size:
                    raise ValueError(f"run {(start, length)} lies outside {self.full_size} rows")
                if (start, length) in seen:
                    continue
                seen[(start, length)] = 1
                for row in range(start, start + length):
                    covered[row] += 1
        if any(c != 1 for c in covered):
            raise ValueError("partition runs must cover every row once, and replicas must repeat whole runs")

    @classmethod
    def even(cls, dim: int, total: int, tp_size: int, unit: int = 1) -> Partition:
        """A contiguous split on `unit` boundaries (units of one head, or one row)."""
        if total % unit:
            raise ValueError(f"{total} rows are not a whole number of {unit}-row units")
        sizes = split_sizes(total // unit, tp_size)
        return cls(dim, total, tuple(((r.start * unit, len(r) * unit),) for r in _ranges(sizes)))

    @property
    def tp_size(self) -> int:
        return len(self.runs)

    def local_size(self, rank: int) -> int:
        return sum(length for _, length in self.runs[rank])

    def is_whole(self, rank: int) -> bool:
        """Whether `rank` holds every row in order (tp 1): its shard is the full tensor as it is."""
        at = 0
        for start, length in self.runs[rank]:
            if start != at:
                return False
            at += length
        return at == self.full_size

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's rows of `full`, as a new contiguous tensor that does not keep `full` alive."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(
                f"tensor of shape {tuple(full.shape)} has {full.shape[self.dim]} rows on dim {self.dim}, "
                f"the partition expects {self.full_size}"
            )
        pieces = [full.narrow(self.dim, start, length) for start, length in self.runs[rank]]
        return torch.cat(pieces, dim=self.dim) if len(pieces) != 1 else pieces[0].clone()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in rank order (replicas are read from the first holder)."""
        if len(shards) != self.tp_size:
            raise ValueError(f"expected {self.tp_size} shards, got {len(shards)}")
        if self.tp_size == 1:
            return shards[0]
        shape = list(shards[0].shape)
        shape[self.dim] = self.full_size
        full = shards[0].new_empty(shape)
        for held in self.holders():
            source = shards[held.rank].narrow(self.dim, held.offset, held.length)
            full.narrow(self.dim, held.start, held.length).copy_(source)
        return full

    def holders(self, prefer: int | None = None) -> list[Holding]:
        """Each distinct run in row order, read from rank `prefer` where it holds the run, else from the lowest rank
        holding it (a replicated run is held by several: the gathering rank reads its own copy)."""
        where: dict[Run, dict[int, int]] = {}  # run -> {rank: offset in its shard}
        for rank, rank_runs in enumerate(self.runs):
            offset = 0
            for run in rank_runs:
                where.setdefault(run, {})[rank] = offset
                offset += run[1]
        out = []
        for (start, length), offsets in sorted(where.items()):
            rank = prefer if prefer in offsets else min(offsets)
            out.append(Holding(start, length, rank, offsets[rank], tuple(offsets)))
        return out

    def replicas(self, rank: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(offset in shard, length, ranks holding it) for each of this rank's runs held by several ranks."""
        ranks = {(held.start, held.length): held.ranks for held in self.holders()}
        out, offset = [], 0
        for run in self.runs[rank]:
            if len(ranks[run]) > 1:
                out.append((offset, run[1], ranks[run]))
            offset += run[1]
        return out

    def replica_groups(self) -> set[tuple[int, ...]]:
        """Every set of ranks that share a run: each needs a process group for its gradient sum."""
        return {holders for rank in range(self.tp_size) for _, _, holders in self.replicas(rank)}

    def with_dim(self, dim: int) -> Partition:
        return Partition(dim, self.full_size, self.runs)

    def to_json(self) -> dict:
        """A JSON-ready dict (the form checkpoints store); `from_json` reads it back."""
        return {"dim": self.dim, "full_size": self.full_size, "runs": [[list(run) for run in rr] for rr in self.runs]}

    @classmethod
    def from_json(cls, data: Mapping) -> Partition:
        return cls(
            int(data["dim"]),
            int(data["full_size"]),
            tuple(tuple((int(start), int(length)) for start, length in rr) for rr in data["runs"]),
        )

    def describe(self) -> str:
        sizes = [self.local_size(r) for r in range(self.tp_size)]
        split = "/".join(map(str, sizes)) if len(set(sizes)) > 1 else f"{sizes[0]} each"
        shared = " (some rows replicated)" if self.replica_groups() else ""
        return f"dim {self.dim}: {self.full_size} -> {split}{shared}"


@dataclass(frozen=True)
class HeadLayout:
    """Which query and key/value heads each rank computes (KV heads may be replicated)."""

    heads: int
    kv_heads: int
    q: tuple[range, ...]
    kv: tuple[range, ...]

    @classmethod
    def plan(cls, heads: int, kv_heads: int, tp_size: int) -> HeadLayout:
        """Split on head boundaries, keeping each query head on a rank that holds its KV head.

        kv >= tp: KV heads are split (unevenly if need be) and each rank takes their query heads.
        kv < tp: each KV head is replicated on tp/kv ranks, which split its query heads.
        """
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
        group = heads // kv_heads
        if kv_heads >= tp_size:
            kv = split_ranges(kv_heads, tp_size)
            q = [range(r.start * group, r.stop * group) for r in kv]
        else:
            if tp_size % kv_heads:
                raise ValueError(
                    f"{kv_heads} key/value heads cannot be replicated evenly over tp_size={tp_size}; "
                    f"choose a tp_size that divides or is a multiple of {kv_heads}"
                )
            copies = tp_size // kv_heads
            if group < copies:
                raise ValueError(
                    f"{heads} query heads over tp_size={tp_size} leave ranks without a query head "
                    f"({group} per key/value head shared by {copies} ranks)"
                )
            kv, q = [], []
            for head in range(kv_heads):
                for sub in split_ranges(group, copies):
                    kv.append(range(head, head + 1))
                    q.append(range(head * group + sub.start, head * group + sub.stop))
        if any(len(r) == 0 for r in q):
            raise ValueError(f"{heads} query heads cannot give every one of {tp_size} ranks a head")
        return cls(heads, kv_heads, tuple(q), tuple(kv))


def layout_partition(
    layout: str, dim: int, owned: Mapping[str, Sequence[range]], units: Mapping[str, int], group: int = 1
) -> Partition:
    """The partition of a (possibly fused) tensor whose rows follow `layout` (see module docstring).

    `owned[role][rank]` is the range of role items (heads, or MLP rows) a rank holds; `units[role]` is
    the rows per item; `group` is the query heads per KV group, for "q*" inside "( ... )".
    """
    tp_size = len(next(iter(owned.values())))
    runs: list[list[Run]] = [[] for _ in range(tp_size)]
    cursor = 0
    for block in (b.strip() for b in layout.split("|")):
        grouped = block.startswith("(") and block.endswith(")")
        tokens = block.strip("()").split()
        repeats = _count(owned, "k" if "k" in tokens else tokens[0].rstrip("*")) if grouped else 1
        index = {role: 0 for role in owned}
        for _ in range(repeats):
            start = dict(index)  # a role named twice in a group ("(w w)") interleaves: both tokens are item `first`
            for token in tokens:
                role = token.rstrip("*")
                if role not in owned:
                    raise ValueError(f"layout {layout!r}: unknown part {token!r}")
                count = (group if token.endswith("*") else 1) if grouped else _count(owned, role)
                first, unit = start[role], units[role]
                for rank in range(tp_size):
                    mine = owned[role][rank]
                    lo, hi = max(first, mine.start), min(first + count, mine.stop)
                    if lo < hi:
                        runs[rank].append((cursor + (lo - first) * unit, (hi - lo) * unit))
                index[role] = first + count
                cursor += count * unit
    return Partition(dim, cursor, _merge_unshared(runs))


def _count(owned: Mapping[str, Sequence[range]], role: str) -> int:
    """How many items of `role` exist in total (the largest end of any rank's range)."""
    return max(r.stop for r in owned[role])


def _merge_unshared(runs: list[list[Run]]) -> tuple[tuple[Run, ...], ...]:
    """Join adjacent runs of a rank that no other rank holds; replicated runs stay whole."""
    holders: dict[Run, int] = {}
    for rank_runs in runs:
        for run in rank_runs:
            holders[run] = holders.get(run, 0) + 1
    merged = []
    for rank_runs in runs:
        out: list[Run] = []
        for run in rank_runs:
            if out and holders[run] == 1 and holders.get(out[-1], 1) == 1 and sum(out[-1]) == run[0]:
                out[-1] = (out[-1][0], out[-1][1] + run[1])
            else:
                out.append(run)
        merged.append(tuple(out))
    return tuple(merged)


@dataclass(frozen=True)
class Shard:
    """Partition metadata carried by a sharded parameter, so gather and save need no guessing."""

    partition: Partition
    rank: int

    def full_shape(self, local_shape: Sequence[int]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.partition.dim] = self.partition.full_size
        return tuple(shape)
