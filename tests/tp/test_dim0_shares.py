"""The uneven dim-0 pair `keep_dim0_share` / `gather_dim0_shares` (SP's sequence stream, EP's tokens over TP) on 2
real gloo ranks, for an even dim 0 (one all-gather straight into the result) and an uneven one (padded shares).

Exact (`torch.equal`): the pair only moves data.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autotp.runtime.seq_collectives import (
    dim0_share,
    gather_dim0_shares,
    keep_dim0_share,
)
from autotp.testing import run_ranks

WORLD = 2
LENGTHS = (4, 5)  # even, and uneven: rank 0 holds rows 0-2, rank 1 rows 3-4


def full(length: int) -> torch.Tensor:
    return torch.arange(length * 3, dtype=torch.float32).view(length, 3)


def upstream(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, 10.0 * (rank + 1)) + torch.arange(shape[0]).unsqueeze(-1)


def pair(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)))
    out = {}
    for length in LENGTHS:
        whole = full(length).requires_grad_()
        (kept,) = keep_dim0_share((whole,), group)
        kept.backward(upstream(rank, tuple(kept.shape)))
        share = dim0_share(length, group)
        mine = full(length)[share.start : share.stop].clone().requires_grad_()
        joined = gather_dim0_shares(mine, length, group)
        joined.backward(upstream(rank, tuple(joined.shape)))
        out[length] = {
            "kept": kept.detach(),
            "kept grad": whole.grad,
            "joined": joined.detach(),
            "joined grad": mine.grad,
        }
    return out


@pytest.mark.timeout(120)
def test_keep_and_gather_dim0_shares_even_and_uneven() -> None:
    reports = run_ranks(pair, WORLD)
    for length, shares in zip(LENGTHS, [(range(2), range(2, 4)), (range(3), range(3, 5))]):
        rows = [full(length)[s.start : s.stop] for s in shares]
        for rank, report in enumerate(reports):
            got = report[length]
            assert torch.equal(got["kept"], rows[rank]), (length, rank)
            # keep's backward: every rank's gradient of its share, all-gathered in rank order
            assert torch.equal(got["kept grad"], torch.cat([upstream(r, tuple(rows[r].shape)) for r in range(WORLD)]))
            assert torch.equal(got["joined"], full(length)), (length, rank)
            # gather's backward: this rank's share of its own (whole) gradient, no sum over ranks
            share = shares[rank]
            assert torch.equal(got["joined grad"], upstream(rank, (length, 3))[share.start : share.stop]), (
                length,
                rank,
            )
