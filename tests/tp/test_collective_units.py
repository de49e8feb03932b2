"""Unit tests of the autograd collectives and gradient hooks (`autotp.runtime.collectives`, `.seq_collectives`,
`.grad_hooks`), forward and backward, on 2 forked CPU ranks (gloo).

Every rank's inputs and upstream gradients are float64 integers built from its rank number (`value`,
`upstream`), so each test recomputes the expected sums by hand for every rank; the upstream gradient
differs between ranks, so a missing or doubled reduction changes the result. All comparisons are exact
(`torch.equal`). All 2-rank collectives run in one `run_ranks` call (a module fixture); group=None is
checked in process.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autotp.mesh import Mesh
from autotp.planning.sharding import HeadLayout, Partition, layout_partition
from autotp.runtime.collectives import all_gather_full, copy_to_tp, gather_from_tp, gather_full_to, reduce_from_tp
from autotp.runtime.grad_hooks import grad_allreduce_hook, replica_grad_hook
from autotp.runtime.seq_collectives import (
    SavedChunk,
    all_gather_dim0,
    all_gather_seq_to_tp,
    gather_from_seq,
    reduce_scatter_dim0,
    reduce_scatter_seq_from_tp,
    scatter_to_seq,
    seq_parallel_column_linear,
)
from autotp.state import TPState
from autotp.testing import run_ranks

WORLD = 2
RANKS = range(WORLD)
Make = Callable[[int, tuple[int, ...]], torch.Tensor]  # `value` or `upstream`
UNEVEN = Partition.even(1, 5, WORLD)  # columns 0-2 on rank 0, 3-4 on rank 1
FULL = (2, 5)
SEQ_FULL, SEQ_CHUNK = (2, 4, 3), (2, 2, 3)  # (batch, sequence, hidden); the tokens split over 2 ranks
ROWS_OWN, ROWS_ALL = (3, 2), (6, 2)  # dim-0 rows of one rank, of both


def qkv_replicated() -> Partition:
    """q | k | v with 2 q heads, 1 kv head, head_dim 1 on 2 ranks: rank r holds rows [r, 2, 3] (k, v shared)."""
    plan = HeadLayout.plan(2, 1, WORLD)
    return layout_partition(
        "q | k | v", 0, {"q": plan.q, "k": plan.kv, "v": plan.kv}, {"q": 1, "k": 1, "v": 1}, group=2
    )


def value(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Forward input of `rank`: 1, 2, 3, ... times (rank + 1)."""
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float64) + 1).reshape(shape) * (rank + 1)


def upstream(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Upstream gradient of `rank`: n, ..., 2, 1 times 10**rank (differs from `value` and between ranks)."""
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float64).flip(0) + 1).reshape(shape) * 10**rank


def chunk(t: torch.Tensor, rank: int) -> torch.Tensor:
    """`rank`'s equal share of the tokens in memory order (batch 0's first), shaped with the sequence dim 1 halved:
    with batch 2 and 2 ranks, rank r holds sample r."""
    return t.reshape(WORLD, -1)[rank].reshape(SEQ_CHUNK)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.clone().requires_grad_()


def through(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rank: int) -> dict[str, torch.Tensor]:
    """`fn(x)` and the gradient of `x` under this rank's upstream gradient."""
    out = fn(x)
    out.backward(upstream(rank, tuple(out.shape)))
    return {"out": out.detach(), "grad": x.grad}


def all_collectives(rank: int, world: int) -> dict:
    """Every collective's outputs and input gradients on this rank, keyed by collective."""
    group = dist.new_group(list(range(world)))
    full = value(0, FULL)
    results = {
        "copy_to_tp": through(lambda x: copy_to_tp(x, group), leaf(value(rank, FULL)), rank),
        # reduce_from_tp reduces in place, so it takes a non-leaf (as a row linear's output is)
        "reduce_from_tp": through(lambda x: reduce_from_tp(x.clone(), group), leaf(value(rank, FULL)), rank),
        "gather_from_tp": through(lambda x: gather_from_tp(x, UNEVEN, group), leaf(UNEVEN.shard(full, rank)), rank),
        "scatter_to_seq": through(lambda x: scatter_to_seq(x, group), leaf(value(rank, SEQ_FULL)), rank),
        "gather_from_seq": through(lambda x: gather_from_seq(x, group), leaf(value(rank, SEQ_CHUNK)), rank),
        "all_gather_seq_to_tp": through(lambda x: all_gather_seq_to_tp(x, group), leaf(value(rank, SEQ_CHUNK)), rank),
        "reduce_scatter_seq_from_tp": through(
            lambda y: reduce_scatter_seq_from_tp(y, group), leaf(value(rank, SEQ_FULL)), rank
        ),
        "all_gather_dim0": through(lambda x: all_gather_dim0(x, group), leaf(value(rank, ROWS_OWN)), rank),
        "reduce_scatter_dim0": through(lambda y: reduce_scatter_dim0(y, group), leaf(value(rank, ROWS_ALL)), rank),
        "all_gather_full": all_gather_full(UNEVEN.shard(full, rank), UNEVEN, group),
        "gather_full_to": gather_full_to(UNEVEN.shard(full, rank), UNEVEN, group, dst=0),
    }
    qkv = qkv_replicated()
    results["all_gather_full replicated"] = all_gather_full(qkv.shard(value(0, (4, 2)), rank), qkv, group)

    x = leaf(gathered(value, SEQ_CHUNK))  # the sequence-gathered input
    weight, bias = leaf(value(rank, (2, 3))), leaf(value(rank, (2,)))
    out = seq_parallel_column_linear(x, weight, bias, SavedChunk(x, group, dim=1))
    out.backward(upstream(rank, tuple(out.shape)))
    results["seq_parallel_column_linear"] = {
        "out": out.detach(),
        "grad": x.grad,
        "weight": weight.grad,
        "bias": bias.grad,
    }

    grad = upstream(rank, (3, 2))
    gathered_state = TPState(None, Mesh(None, {("tp",): group}), rank, gathered=True)  # hooks registered
    results["grad_allreduce_hook"] = grad_allreduce_hook(group)(grad)  # through sharded_only
    results["grad_allreduce_hook off"] = gathered_state.sharded_only(grad_allreduce_hook(group))(grad) is None
    results["replica_grad_hook"] = replica_grad_hook(qkv, rank, {(0, 1): group})(grad)
    results["replica_grad_hook off"] = (
        gathered_state.sharded_only(replica_grad_hook(qkv, rank, {(0, 1): group}))(grad) is None
    )
    results["hook input untouched"] = torch.equal(grad, upstream(rank, (3, 2)))
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(all_collectives, WORLD)


def total(fn: Make, shape: tuple[int, ...]) -> torch.Tensor:
    """The sum over ranks of `fn(rank, shape)`."""
    return sum(fn(r, shape) for r in RANKS)


def gathered(fn: Make, shape: tuple[int, ...]) -> torch.Tensor:
    """Every rank's chunk `fn(rank, shape)` joined in rank order: the whole tensor, the sequence dim 1 doubled."""
    return torch.cat([fn(r, shape).reshape(-1) for r in RANKS]).reshape(SEQ_FULL)


def check(ranks: list[dict], name: str, expected: dict[str, list[torch.Tensor]]) -> None:
    for rank, result in enumerate(ranks):
        for key, want in expected.items():
            got = result[name][key]
            assert torch.equal(got, want[rank]), f"{name} {key} on rank {rank}:\n{got}\nexpected\n{want[rank]}"


def test_copy_to_tp(ranks: list[dict]) -> None:  # identity forward, all-reduce backward
    check(ranks, "copy_to_tp", {"out": [value(r, FULL) for r in RANKS], "grad": [total(upstream, FULL)] * WORLD})


def test_reduce_from_tp(ranks: list[dict]) -> None:  # all-reduce forward, identity backward
    check(ranks, "reduce_from_tp", {"out": [total(value, FULL)] * WORLD, "grad": [upstream(r, FULL) for r in RANKS]})


def test_gather_from_tp(ranks: list[dict]) -> None:  # all-gather forward (3/2 columns), own slice backward
    check(
        ranks,
        "gather_from_tp",
        {"out": [value(0, FULL)] * WORLD, "grad": [upstream(r, FULL)[:, [[0, 1, 2], [3, 4]][r]] for r in RANKS]},
    )


def test_scatter_to_seq(ranks: list[dict]) -> None:  # own chunk forward, all-gather backward
    check(
        ranks,
        "scatter_to_seq",
        {"out": [chunk(value(r, SEQ_FULL), r) for r in RANKS], "grad": [gathered(upstream, SEQ_CHUNK)] * WORLD},
    )


def test_gather_from_seq(ranks: list[dict]) -> None:  # all-gather forward, own chunk backward
    check(
        ranks,
        "gather_from_seq",
        {"out": [gathered(value, SEQ_CHUNK)] * WORLD, "grad": [chunk(upstream(r, SEQ_FULL), r) for r in RANKS]},
    )


def test_all_gather_seq_to_tp(ranks: list[dict]) -> None:  # all-gather forward, reduce-scatter backward
    check(
        ranks,
        "all_gather_seq_to_tp",
        {"out": [gathered(value, SEQ_CHUNK)] * WORLD, "grad": [chunk(total(upstream, SEQ_FULL), r) for r in RANKS]},
    )


def test_reduce_scatter_seq_from_tp(ranks: list[dict]) -> None:  # reduce-scatter forward, all-gather backward
    check(
        ranks,
        "reduce_scatter_seq_from_tp",
        {"out": [chunk(total(value, SEQ_FULL), r) for r in RANKS], "grad": [gathered(upstream, SEQ_CHUNK)] * WORLD},
    )


def test_all_gather_dim0(ranks: list[dict]) -> None:  # all-gather along dim 0 forward, reduce-scatter backward
    check(
        ranks,
        "all_gather_dim0",
        {
            "out": [torch.cat([value(0, ROWS_OWN), value(1, ROWS_OWN)])] * WORLD,
            "grad": [total(upstream, ROWS_ALL)[3 * r : 3 * r + 3] for r in RANKS],
        },
    )


def test_reduce_scatter_dim0(ranks: list[dict]) -> None:  # reduce-scatter along dim 0 forward, all-gather backward
    check(
        ranks,
        "reduce_scatter_dim0",
        {
            "out": [total(value, ROWS_ALL)[3 * r : 3 * r + 3] for r in RANKS],
            "grad": [torch.cat([upstream(0, ROWS_OWN), upstream(1, ROWS_OWN)])] * WORLD,
        },
    )


def test_seq_parallel_column_linear(ranks: list[dict]) -> None:
    """Saving only the own sequence chunk and re-gathering it must give F.linear's gradients on the full input."""
    x = gathered(value, SEQ_CHUNK)
    expected: dict[str, list[torch.Tensor]] = {"out": [], "grad": [], "weight": [], "bias": []}
    for r in RANKS:
        weight, bias, grad = value(r, (2, 3)), value(r, (2,)), upstream(r, (2, 4, 2))
        expected["out"].append(F.linear(x, weight, bias))
        expected["grad"].append(grad @ weight)
        expected["weight"].append(grad.reshape(-1, 2).t() @ x.reshape(-1, 3))
        expected["bias"].append(grad.sum((0, 1)))
    check(ranks, "seq_parallel_column_linear", expected)


def test_gather_full(ranks: list[dict]) -> None:
    full = value(0, FULL)
    for rank, result in enumerate(ranks):
        assert torch.equal(result["all_gather_full"], full), f"all_gather_full on rank {rank}"
        assert torch.equal(result["all_gather_full replicated"], value(0, (4, 2))), f"all_gather_full (replicas) {rank}"
    assert torch.equal(ranks[0]["gather_full_to"], full), "gather_full_to on dst rank 0"
    assert ranks[1]["gather_full_to"] is None, "gather_full_to off dst must return None"


def test_grad_allreduce_hook(ranks: list[dict]) -> None:
    for rank, result in enumerate(ranks):
        assert torch.equal(result["grad_allreduce_hook"], total(upstream, (3, 2))), (
            f"grad_allreduce_hook on rank {rank}"
        )
        assert result["grad_allreduce_hook off"], (
            f"gathered, grad_allreduce_hook must leave the gradient as it is (None) on rank {rank}"
        )


def test_replica_grad_hook(ranks: list[dict]) -> None:
    summed = total(upstream, (3, 2))
    for rank, result in enumerate(ranks):
        # shard row 0 is this rank's own q head; shard rows 1, 2 are the shared k and v heads
        own = upstream(rank, (3, 2))
        assert torch.equal(result["replica_grad_hook"], torch.cat([own[:1], summed[1:]])), (
            f"replica_grad_hook on rank {rank}"
        )
        assert result["replica_grad_hook off"], (
            f"gathered, replica_grad_hook must leave the gradient as it is (None) on rank {rank}"
        )
        assert result["hook input untouched"], f"a grad hook changed its input in place on rank {rank}"


def test_group_of_one_is_identity() -> None:
    x = value(0, SEQ_FULL)
    one = Partition.even(1, 4, 1)
    for name, fn in {
        "copy_to_tp": copy_to_tp,
        "reduce_from_tp": reduce_from_tp,
        "scatter_to_seq": scatter_to_seq,
        "gather_from_seq": gather_from_seq,
        "all_gather_seq_to_tp": all_gather_seq_to_tp,
        "reduce_scatter_seq_from_tp": reduce_scatter_seq_from_tp,
        "all_gather_dim0": all_gather_dim0,
        "reduce_scatter_dim0": reduce_scatter_dim0,
        "gather_from_tp": lambda t, g: gather_from_tp(t, one, g),
        "all_gather_full": lambda t, g: all_gather_full(t, one, g),
        "gather_full_to": lambda t, g: gather_full_to(t, one, g),
    }.items():
        assert fn(x, None) is x, name
    weight, bias = value(1, (2, 3)), value(1, (2,))
    assert torch.equal(seq_parallel_column_linear(x, weight, bias, None), F.linear(x, weight, bias))
    assert grad_allreduce_hook(None)(x) is x
    assert torch.equal(replica_grad_hook(Partition.even(0, 2, 1), 0, {})(x), x)
