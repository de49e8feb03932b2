"""`Mesh.rank_groups` and the EP fold against hand-worked 8-rank answers: which global ranks form each group.

The grids come from the functions `build_mesh` uses (`dense_grid`, `expert_grid`); no process group is made, since
`rank_groups` is arithmetic on the grid. Every expected tuple below was worked out by hand from the layout the docs give:
rank ((p * dp + d) * cp + c) * tp + t for the dense grid, and EP groups of `ep` consecutive ranks for the experts.
"""

from __future__ import annotations

import pytest
import torch

from autotp.mesh import Mesh, dense_grid, expert_grid


def mesh(sizes: dict[str, int]) -> Mesh:
    return Mesh(dense_grid(sizes, 8), experts=expert_grid(sizes, 8))


def test_dp2_cp2_tp2_ep4() -> None:
    m = mesh({"cp": 2, "tp": 2, "ep": 4})
    #  rank  0 1 2 3 4 5 6 7
    #  dp    0 0 0 0 1 1 1 1
    #  cp    0 0 1 1 0 0 1 1
    #  tp    0 1 0 1 0 1 0 1
    assert torch.equal(m.grid, torch.tensor([[[[0, 1], [2, 3]], [[4, 5], [6, 7]]]]))  # pp 1 outermost
    assert m.rank_groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert m.rank_groups("cp") == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert m.rank_groups("dp") == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert m.rank_groups("dp", "cp") == [(0, 2, 4, 6), (1, 3, 5, 7)]  # DP x CP: the ranks holding the same shards
    assert m.rank_groups("cp", "tp") == [(0, 1, 2, 3), (4, 5, 6, 7)]  # one replica
    # the experts fold over the same ranks: EP takes 4 consecutive ranks (both TP pairs of a CP pair), expert-DP
    # the ranks at the same place in each EP group
    assert torch.equal(m.experts, torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]))
    assert m.rank_groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert m.rank_groups("edp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


def test_pp2_dp2_tp2_pipeline_outermost() -> None:
    m = mesh({"tp": 2, "pp": 2})
    #  rank  0 1 2 3 4 5 6 7
    #  pp    0 0 0 0 1 1 1 1
    #  dp    0 0 1 1 0 0 1 1
    #  tp    0 1 0 1 0 1 0 1
    assert torch.equal(m.grid, torch.tensor([[[[0, 1]], [[2, 3]]], [[[4, 5]], [[6, 7]]]]))
    assert m.rank_groups("pp") == [(0, 4), (1, 5), (2, 6), (3, 7)]  # a stage's peers: one node apart
    assert m.rank_groups("dp") == [(0, 2), (1, 3), (4, 6), (5, 7)]  # replicas within a stage
    assert m.rank_groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert m.rank_groups("dp", "cp") == m.rank_groups("dp")


def test_dp4_tp2_ep4_as_the_groups_docstring_draws_it() -> None:
    m = mesh({"tp": 2, "ep": 4})
    assert m.rank_groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert m.rank_groups("cp") == [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]  # cp 1: every rank alone
    assert m.rank_groups("dp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert m.rank_groups("dp", "cp") == [(0, 2, 4, 6), (1, 3, 5, 7)]  # without CP, DP x CP is DP
    assert m.rank_groups("ep") == [(0, 1, 2, 3), (4, 5, 6, 7)]  # experts E0E1 E2E3 E4E5 E6E7 on ranks 0-3, again on 4-7
    assert m.rank_groups("edp") == [(0, 4), (1, 5), (2, 6), (3, 7)]


@pytest.mark.parametrize(
    "ep, ep_rows, edp_rows",
    [
        (2, [(0, 1), (2, 3), (4, 5), (6, 7)], [(0, 2, 4, 6), (1, 3, 5, 7)]),
        (8, [(0, 1, 2, 3, 4, 5, 6, 7)], [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]),
    ],
)
def test_cp4_tp2_folds_ep(ep: int, ep_rows: list, edp_rows: list) -> None:
    m = mesh({"cp": 4, "tp": 2, "ep": ep})
    assert m.rank_groups("tp") == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert m.rank_groups("cp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert m.rank_groups("dp") == [(0,), (1,), (2,), (3,), (4,), (5,), (6,), (7,)]  # one replica
    assert m.rank_groups("ep") == ep_rows
    assert m.rank_groups("edp") == edp_rows


def test_no_fold_at_ep1() -> None:
    assert expert_grid({"tp": 2}, 8) is None
    assert expert_grid({"tp": 2, "ep": 1}, 8) is None
