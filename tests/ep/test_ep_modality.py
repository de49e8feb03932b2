"""Modality experts at ep > 1 against one process (the harness and its tolerances: ep_workers.py): Ernie 4.5 VL's
MoE layers hold text experts and vision experts, and run the vision ones only when the batch holds vision tokens
(`moe_mm_token_type_ids`). With one replica text-only and the other not, the EP ranks used to run different
numbers of all-to-alls (gloo: "collective mismatch"); every rank now runs each group's dispatch, with zero tokens
where it has none. The routing check is left out: each experts call sees one modality's tokens, not a batch's rows.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autotp
from autotp.testing import run_ranks
from ep_workers import GLOBAL, check_training, ep_rank_run, moe_model, single_process, whole
from models import OUT_OF_MEMORY, FailOnce, held_by_autotp

pytestmark = pytest.mark.timeout(240)


def token_types(rows: list[tuple[int, int]]) -> torch.Tensor:
    """Per row, the [start, stop) of its vision tokens (1); the rest text (0)."""
    types = torch.zeros(GLOBAL.shape, dtype=torch.long)
    for row, (start, stop) in enumerate(rows):
        types[row, start:stop] = 1
    return types


MIXED = [(0, 0), (0, 0), (3, 9), (0, 16)]  # rows 0-1 text only; row 2 mixed; row 3 vision only (no text token)


@pytest.mark.parametrize(
    "world,tp,ep,rows",
    [(2, 1, 2, MIXED), (2, 1, 2, [(0, 0)] * 4), (2, 1, 1, MIXED), pytest.param(4, 2, 4, MIXED, marks=pytest.mark.slow)],
    ids=["dp2-ep2-text-only-beside-mixed", "dp2-ep2-text-only-everywhere", "dp2-text-only-beside-mixed", "tp2-ep4"],
)
def test_modality_experts_equal_one_process(world: int, tp: int, ep: int, rows: list[tuple[int, int]]) -> None:
    """dp 2: replica 0's rows are text only, so its model skips the vision experts and their router, while replica
    1's hold vision tokens; and a batch with none, where no rank may give the vision experts a gradient. At ep 1 the
    router's gradient alone differs between the replicas; at tp 2 x ep 4 an EP group spans both replicas, each TP
    rank dispatching its half of the rows, none when it has none."""
    inputs = {"moe_mm_token_type_ids": token_types(rows)}
    expected = single_process("ernie4_5_vl_moe", inputs=inputs)
    for report in run_ranks(ep_rank_run, world, "ernie4_5_vl_moe", tp, ep, "right", None, inputs):
        check_training(report, expected)
        # the experts (and router) no token reached get no gradient on any rank, as in one process: AdamW skips them
        assert report["grads"].keys() == expected["grads"].keys(), report["grads"].keys() ^ expected["grads"].keys()


def fully_shard_modality(rank: int, world: int) -> dict:
    model = autotp.wrap(moe_model("ernie4_5_vl_moe"), 1, ep_size=2)
    try:
        autotp.fully_shard(model)
        message = "accepted"
    except NotImplementedError as err:
        message = str(err)
    return {"message": message, "dtensors": [n for n, p in model.named_parameters() if isinstance(p, DTensor)]}


def test_fully_shard_of_modality_experts_at_ep2_is_refused_by_name() -> None:
    """FSDP2 reduces only the gradients this rank's batch reached: a text-only replica's skipped vision router left
    the ranks' reductions unpaired (gloo aborted), and the vision experts got zero gradients in a step without
    vision tokens, where one process gives none. Refused before anything is sharded."""
    for report in run_ranks(fully_shard_modality, 2):
        assert (
            "autotp.fully_shard at ep_size=2: model.language_model.layers.1.mlp runs its experts modules "
            "(model.language_model.layers.1.mlp.text_moe.experts, model.language_model.layers.1.mlp.vision_moe."
            "experts) only on the batches holding their modality's tokens" in report["message"]
        ), report["message"]
        assert report["dtensors"] == []


def raised_then_text_only(model: torch.nn.Module, first: int, rows: int) -> dict:
    """A step whose forward raises in Ernie 4.5 VL's vision experts (rows with vision tokens), then an AdamW step on
    text-only rows: what autotp's objects still hold of the failed try, the retry's loss, gradients and parameters."""
    layer = model.model.language_model.layers[1].mlp
    layer.vision_moe.experts.register_forward_hook(FailOnce())
    before = held_by_autotp(model)
    ids = GLOBAL[first : first + rows]
    try:
        model(input_ids=ids, labels=ids, moe_mm_token_type_ids=token_types(MIXED)[first : first + rows])
    except RuntimeError as err:
        assert OUT_OF_MEMORY in str(err)
    kept = sorted(path for key, path in held_by_autotp(model).items() if key not in before)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    loss = model(input_ids=ids, labels=ids, moe_mm_token_type_ids=token_types([(0, 0)] * 4)[first : first + rows]).loss
    loss.backward()
    if dist.is_initialized():
        autotp.allreduce_gradients(model)
        dist.all_reduce(loss := loss.detach(), group=autotp.dp_group(model))
        loss /= autotp.dp_size(model)
    full = (lambda t, p: whole(t, p, model)) if dist.is_initialized() else (lambda t, p: t.detach())
    # after the sync every rank holds a gradient or none does (an experts module no token reached: none)
    grads = {n: full(p.grad, p) for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    return {
        "kept": kept,
        "losses": [loss.item()],
        "grads": grads,
        "params": {n: full(p, p) for n, p in model.named_parameters()},
    }


def ep_raised_then_text_only(rank: int, world: int) -> dict:
    model = autotp.wrap(moe_model("ernie4_5_vl_moe"), 1, ep_size=2)
    rows = GLOBAL.shape[0] // world
    return raised_then_text_only(model, rank * rows, rows)


def test_a_forward_raising_in_the_modality_experts_leaves_no_state_behind() -> None:
    """dp 2 x ep 2, replica 1's rows with vision tokens: a forward raising in the vision experts (replica 0 runs them
    with none) held the MoE block's input and skipped outputs, and left the vision experts marked as fed, so the next,
    text-only step gave them zero gradients where one process gives none, and AdamW's weight decay moved them."""
    expected = raised_then_text_only(moe_model("ernie4_5_vl_moe"), 0, GLOBAL.shape[0])
    assert expected["kept"] == []
    for report in run_ranks(ep_raised_then_text_only, 2):
        assert report["kept"] == [], report["kept"]
        assert report["grads"].keys() == expected["grads"].keys(), report["grads"].keys() ^ expected["grads"].keys()
        check_training(report, expected)
