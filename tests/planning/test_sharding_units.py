"""Unit tests of `autotp.planning.sharding` and `autotp.planning.placement`, single process, no process group.

Checked: `Partition.shard` / `unshard` round trips (even, uneven, dims 0-2, replicated KV runs, fused
layouts), the exact rows each rank holds for hand-worked fused layouts, replica bookkeeping, which rank each run is
read from (`Partition.holders`), the JSON round trip, the errors of `Partition` and `HeadLayout.plan`, and the boxes of
the full tensor a rank holding FSDP's rows of its shard holds (`Placement.boxes`, what checkpoints write), checked
against hand-worked answers and by rebuilding full tensors. Tensors hold distinct float64 values and every comparison
is exact (`torch.equal`).
"""

from __future__ import annotations

import json

import pytest
import torch

from autotp.planning.placement import Box, Placement, window
from autotp.planning.sharding import HeadLayout, Holding, Partition, layout_partition, split_ranges, split_sizes


def attention(layout: str, heads: int, kv_heads: int, head_dim: int, tp: int, dim: int = 0) -> Partition:
    """The partition of an attention weight laid out as `layout`, built as autotp/planner.py builds it."""
    plan = HeadLayout.plan(heads, kv_heads, tp)
    owned = {"q": plan.q, "k": plan.kv, "v": plan.kv}
    units = {"q": head_dim, "k": head_dim, "v": head_dim}
    return layout_partition(layout, dim, owned, units, group=heads // kv_heads)


def mlp(layout: str, width: int, tp: int) -> Partition:
    """The partition of an MLP weight of `width` rows per part, as autotp/planner.py builds it."""
    return layout_partition(layout, 0, {"w": split_ranges(width, tp)}, {"w": 1})


def distinct(*shape: int) -> torch.Tensor:
    """A float64 tensor whose every element differs, so a misplaced row cannot go unnoticed."""
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float64).reshape(shape)


def test_uneven_split_sizes() -> None:
    part = Partition.even(0, 14, 4)
    assert split_sizes(14, 4) == (4, 4, 3, 3)
    assert part.runs == (((0, 4),), ((4, 4),), ((8, 3),), ((11, 3),))
    assert [part.local_size(r) for r in range(4)] == [4, 4, 3, 3]
    assert Partition.even(0, 10, 2, unit=2).runs == (((0, 6),), ((6, 4),))  # 5 heads of 2 rows: 3/2 heads


ROUND_TRIPS = {
    "even dim 0": (Partition.even(0, 12, 4), (12, 3)),
    "uneven dim 0": (Partition.even(0, 14, 4), (14, 3)),
    "uneven dim 1": (Partition.even(1, 14, 4), (3, 14)),
    "uneven dim 2 of 3-D": (Partition.even(2, 14, 4), (2, 3, 14)),
    "uneven head units": (Partition.even(0, 10, 2, unit=2), (10, 3)),
    "replicated k": (attention("k", 8, 2, 3, 4), (6, 5)),
    "replicated k dim 1": (attention("k", 8, 2, 3, 4, dim=1), (5, 6)),
    "fused q | k | v": (attention("q | k | v", 4, 2, 2, 2), (16, 3)),
    "fused q | k | v replicated": (attention("q | k | v", 8, 2, 3, 4), (36, 2)),
    "fused (q* k v)": (attention("(q* k v)", 4, 2, 1, 2), (8, 3)),
    "fused (q* k v) replicated": (attention("(q* k v)", 4, 2, 1, 4), (8, 3)),
    "fused w | w uneven": (mlp("w | w", 5, 2), (10, 3)),
    "tp 1": (Partition.even(0, 7, 1), (7, 2)),
}


@pytest.mark.parametrize("part,shape", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_round_trip(part: Partition, shape: tuple[int, ...]) -> None:
    full = distinct(*shape)
    shards = [part.shard(full, r) for r in range(part.tp_size)]
    for r, shard in enumerate(shards):
        assert shard.shape[part.dim] == part.local_size(r)
    assert torch.equal(part.unshard(shards), full)


# Hand-worked: which rows of the fused tensor each rank holds.
FUSED_ROWS = {
    # 4 q heads, 2 kv heads, head_dim 1: q0 q1 q2 q3 | k0 k1 | v0 v1
    "q | k | v, tp 2": (attention("q | k | v", 4, 2, 1, 2), [[0, 1, 4, 6], [2, 3, 5, 7]]),
    # kv heads replicated over 2 ranks each; each rank has one q head
    "q | k | v, tp 4": (attention("q | k | v", 4, 2, 1, 4), [[0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]]),
    # head_dim 2: q rows 0-7, k rows 8-11, v rows 12-15
    "q | k | v, head_dim 2": (
        attention("q | k | v", 4, 2, 2, 2),
        [[0, 1, 2, 3, 8, 9, 12, 13], [4, 5, 6, 7, 10, 11, 14, 15]],
    ),
    # per kv group: q0 q1 k0 v0 | q2 q3 k1 v1
    "(q* k v), tp 2": (attention("(q* k v)", 4, 2, 1, 2), [[0, 1, 2, 3], [4, 5, 6, 7]]),
    "(q* k v), tp 4": (attention("(q* k v)", 4, 2, 1, 4), [[0, 2, 3], [1, 2, 3], [4, 6, 7], [5, 6, 7]]),
    # gate rows 0-4 | up rows 5-9, width 5 split 3/2
    "w | w, tp 2": (mlp("w | w", 5, 2), [[0, 1, 2, 5, 6, 7], [3, 4, 8, 9]]),
}


@pytest.mark.parametrize("part,rows", FUSED_ROWS.values(), ids=FUSED_ROWS.keys())
def test_fused_rows(part: Partition, rows: list[list[int]]) -> None:
    full = distinct(part.full_size, 2)
    assert part.tp_size == len(rows)
    for r, expected in enumerate(rows):
        assert torch.equal(part.shard(full, r), full[expected]), f"rank {r}"


def test_replicated_kv() -> None:
    plan = HeadLayout.plan(heads=8, kv_heads=2, tp_size=4)
    assert plan.kv == (range(0, 1), range(0, 1), range(1, 2), range(1, 2))
    assert plan.q == (range(0, 2), range(2, 4), range(4, 6), range(6, 8))

    k = attention("k", 8, 2, 3, 4)  # head 0 = rows 0-2 on ranks 0, 1; head 1 = rows 3-5 on ranks 2, 3
    assert k.runs == (((0, 3),), ((0, 3),), ((3, 3),), ((3, 3),))
    assert [k.replicas(r) for r in range(4)] == [[(0, 3, (0, 1))], [(0, 3, (0, 1))], [(0, 3, (2, 3))], [(0, 3, (2, 3))]]
    assert k.replica_groups() == {(0, 1), (2, 3)}

    q = attention("q", 8, 2, 3, 4)
    assert q.replica_groups() == set() and q.replicas(0) == []

    # fused: 2 q heads (6 rows) own, then the shared k head and v head at shard offsets 6 and 9
    qkv = attention("q | k | v", 8, 2, 3, 4)
    assert qkv.replicas(0) == [(6, 3, (0, 1)), (9, 3, (0, 1))]
    assert qkv.replicas(3) == [(6, 3, (2, 3)), (9, 3, (2, 3))]
    assert qkv.replica_groups() == {(0, 1), (2, 3)}


@pytest.mark.parametrize("part", [p for p, _ in ROUND_TRIPS.values()], ids=ROUND_TRIPS.keys())
def test_json_round_trip(part: Partition) -> None:
    assert Partition.from_json(json.loads(json.dumps(part.to_json()))) == part


@pytest.mark.parametrize(
    "runs",
    [
        (((0, 3),), ((2, 2),)),  # row 2 held by two different runs
        (((0, 2),), ((3, 1),)),  # row 2 held by nobody
        (((0, 2),), ((2, 3),)),  # run past the last row
        (((0, 4),), ((0, 2), (2, 2))),  # replica that splits a run instead of repeating it
    ],
    ids=["partial overlap", "uncovered row", "out of range", "split replica"],
)
def test_invalid_runs(runs: tuple) -> None:
    with pytest.raises(ValueError):
        Partition(0, 4, runs)


def test_shard_wrong_row_count() -> None:
    with pytest.raises(ValueError, match=r"\(5, 3\) has 5 rows on dim 0, the partition expects 6"):
        Partition.even(0, 6, 2).shard(distinct(5, 3), 0)


def test_even_not_whole_units() -> None:
    with pytest.raises(ValueError, match="7 rows are not a whole number of 2-row units"):
        Partition.even(0, 7, 2, unit=2)


@pytest.mark.parametrize(
    "heads,kv_heads,tp,match",
    [
        (6, 4, 2, "6 query heads are not a multiple of 4 key/value heads"),
        (6, 2, 3, "2 key/value heads cannot be replicated evenly over tp_size=3"),
        (4, 2, 8, "4 query heads over tp_size=8 leave ranks without a query head"),
    ],
    ids=["heads % kv", "kv does not divide tp", "more ranks than heads"],
)
def test_head_layout_errors(heads: int, kv_heads: int, tp: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        HeadLayout.plan(heads, kv_heads, tp)


@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("part,shape", ROUND_TRIPS.values(), ids=ROUND_TRIPS.keys())
def test_fsdp_rows_of_a_shard_are_boxes_of_the_full_tensor(part: Partition, shape: tuple[int, ...], dp: int) -> None:
    """Under fully_shard each DP rank holds a dim-0 chunk of its TP shard; the runs of a fused shard (q | k | v, gate
    | up) may lie wholly past it. The boxes every (TP, DP) rank gives `save_checkpoint` rebuild the full tensor."""
    full = distinct(*shape)
    rebuilt = torch.full_like(full, float("nan"))
    for rank in range(part.tp_size):
        shard = part.shard(full, rank)
        for index in range(dp):
            placement = Placement.fsdp(shape, part, rank, dp, index)
            first, rows = placement.rows
            local = shard.narrow(0, first, rows)
            assert tuple(local.shape) == placement.local_shape
            for box in placement.boxes():
                assert torch.equal(box.in_full(full), box.view(local))
                box.in_full(rebuilt).copy_(box.view(local))
    assert torch.equal(rebuilt, full)


# 12 rows: rank 0 holds rows 0-2 and 9-11, rank 1 rows 3-6 and 9-11 (replicated with rank 0, at another shard offset),
# rank 2 rows 7-8; shards of 6, 7 and 2 rows.
UNEVEN = Partition(0, 12, (((0, 3), (9, 3)), ((3, 4), (9, 3)), ((7, 2),)))


def test_holders() -> None:
    assert UNEVEN.holders() == [
        Holding(0, 3, 0, 0, (0,)),
        Holding(3, 4, 1, 0, (1,)),
        Holding(7, 2, 2, 0, (2,)),
        Holding(9, 3, 0, 3, (0, 1)),
    ]
    # the replicated run read from rank 1's own copy, at its offset 4; rank 2 does not hold it: the lowest holder
    assert UNEVEN.holders(prefer=1)[3] == Holding(9, 3, 1, 4, (0, 1))
    assert UNEVEN.holders(prefer=2) == UNEVEN.holders()
    assert UNEVEN.replicas(1) == [(4, 3, (0, 1))] and UNEVEN.replica_groups() == {(0, 1)}
    k = attention("k", 8, 2, 3, 4)  # head 0 on ranks 0, 1; head 1 on ranks 2, 3
    assert k.holders(prefer=3) == [Holding(0, 3, 0, 0, (0, 1)), Holding(3, 3, 3, 0, (2, 3))]


PLACEMENTS = {
    # shard of 7 rows over DP 2 (torch.chunk: 4 + 3): DP rank 0 keeps run (3, 4), DP rank 1 the replicated run
    "uneven, rows hold one run each": (Placement.fsdp((12, 5), UNEVEN, 1, 2, 0), (4, 5), [Box((3, 0), (4, 5), (0, 0))]),
    "replicated run": (Placement.fsdp((12, 5), UNEVEN, 1, 2, 1), (3, 5), [Box((9, 0), (3, 5), (0, 0))]),
    # shard of 6 rows over DP 3 (2 + 2 + 2): DP rank 1 keeps shard rows 2-3, the end of one run and the start of next
    "rows cut two runs": (
        Placement.fsdp((12, 5), UNEVEN, 0, 3, 1),
        (2, 5),
        [Box((2, 0), (1, 5), (0, 0)), Box((9, 0), (1, 5), (1, 0))],
    ),
    # shard of 2 rows over DP 3 (1 + 1 + 0): DP rank 2's rows lie past the runs
    "rows past the runs": (Placement.fsdp((12, 5), UNEVEN, 2, 3, 2), (0, 5), []),
    "one row": (Placement.fsdp((12, 5), UNEVEN, 2, 3, 1), (1, 5), [Box((8, 0), (1, 5), (0, 0))]),
    # split on dim 1 (rows 4-5 replicated): FSDP keeps dim-0 rows 3-4 of the (5, 4) shard, all of its columns
    "dim 1": (
        Placement.fsdp((5, 6), Partition(1, 6, (((0, 2), (4, 2)), ((2, 2), (4, 2)))), 1, 2, 1),
        (2, 4),
        [Box((3, 2), (2, 2), (0, 0)), Box((3, 4), (2, 2), (0, 2))],
    ),
    "no FSDP": (Placement((12, 5), UNEVEN, 0), (6, 5), [Box((0, 0), (3, 5), (0, 0)), Box((9, 0), (3, 5), (3, 0))]),
    "not split over TP": (Placement.fsdp((4, 3), None, 0, 2, 1), (2, 3), [Box((2, 0), (2, 3), (0, 0))]),
    "scalar": (Placement(()), (), [Box((), (), ())]),
}


@pytest.mark.parametrize("placement,local_shape,boxes", PLACEMENTS.values(), ids=PLACEMENTS.keys())
def test_placement_boxes(placement: Placement, local_shape: tuple[int, ...], boxes: list[Box]) -> None:
    assert placement.local_shape == local_shape
    assert placement.boxes() == boxes


def test_window() -> None:
    """Rows 2-9 of `UNEVEN` (one part of a fused tensor): the replicated run, cut, stays replicated."""
    assert window(UNEVEN, 2, 8) == Partition(0, 8, (((0, 1), (7, 1)), ((1, 4), (7, 1)), ((5, 2),)))
    assert Placement((12, 5), UNEVEN, 1).within(0, 2, 8) == [Box((1, 0), (4, 5), (0, 0)), Box((7, 0), (1, 5), (4, 0))]
    assert window(UNEVEN.with_dim(1), 7, 2).runs == ((), (), ((0, 2),))
