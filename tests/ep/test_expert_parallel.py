"""Expert parallelism (`ep_size`) against one process: the README's DP loop on each rank, the whole batch in one
(the harness and its tolerances: tests/ep/ep_workers.py; the other families: test_ep_families.py).
Controls: expert gradients averaged over the DP group as plain data parallelism would (different experts mixed), and
summed without the division by the replicas (a spurious factor of dp), each fail those tolerances; on 8 ranks
(expert-DP 2), expert gradients summed over the whole world, or not over expert-DP, fail them too.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import run_ranks
from ep_workers import CLIP, GLOBAL, check, ep_rank_run, moe_model, single_process
from models import tiny_model

FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]
pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_on_two_ranks_equals_one_process(family: str) -> None:
    expected = single_process(family)
    for report in run_ranks(ep_rank_run, 2, family, 1, 2):
        check(report, expected)
        assert report["expert_bytes"] * 2 == expected["expert_bytes"]  # each rank holds half the experts


def test_clipping_at_ep2_uses_the_whole_models_norm() -> None:
    """Each EP rank's experts count once in the norm (gradient norms: 1e-5 relative, as in test_data_parallel)."""
    expected = single_process("qwen3_moe", clip=True)
    assert expected["norms"][0] > CLIP, "clipping must be active for this test to mean anything"
    for report in run_ranks(ep_rank_run, 2, "qwen3_moe", 1, 2, "clip"):
        check(report, expected)
        for ours, theirs in zip(report["norms"], expected["norms"]):
            assert abs(ours - theirs) <= 1e-5 * theirs, (report["norms"], expected["norms"])


@pytest.mark.parametrize("mode", ["dp_average", "no_division"])
def test_a_wrong_expert_gradient_sync_fails_the_tolerance(mode: str) -> None:
    expected = single_process("qwen3_moe")
    for report in run_ranks(ep_rank_run, 2, "qwen3_moe", 1, 2, mode):
        with pytest.raises(AssertionError, match="differs"):  # the loss, a gradient or the routing
            check(report, expected)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["world", "no_expert_dp"])
def test_a_wrong_expert_dp_sum_fails_the_tolerance_on_eight_ranks(mode: str) -> None:
    """tp 2 x ep 4 on 8 ranks, whose right sync passes (test_ep_families.py): each expert's gradient must be summed
    over its expert-DP group {r, r + 4}, the one other rank holding that expert, and nowhere else."""
    expected = single_process("qwen3_moe")
    for report in run_ranks(ep_rank_run, 8, "qwen3_moe", 2, 4, mode):
        with pytest.raises(AssertionError, match="differs"):
            check(report, expected)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2), (1, 4)], ids=["dp4-ep2", "tp2-ep2", "dp4-ep4"])
def test_four_ranks_equal_one_process(tp: int, ep: int) -> None:
    """ep 2 at tp 1 sums the experts over an expert-DP group of 2; at tp 2 the TP ranks split the tokens."""
    expected = single_process("qwen3_moe")
    for report in run_ranks(ep_rank_run, 4, "qwen3_moe", tp, ep):
        check(report, expected)
        assert report["expert_bytes"] * ep == expected["expert_bytes"]


def test_refused_before_any_group() -> None:
    with pytest.raises(ValueError, match="ep_size=3 does not divide the 4 experts"):
        autotp.explain(moe_model("qwen3_moe"), 1, ep_size=3)
    with pytest.raises(ValueError, match="no routed experts autotp can find"):
        autotp.explain(tiny_model("llama"), 1, ep_size=2)
    with pytest.raises(ValueError, match="tensor-parallel block inside a MoE block"):  # tests/ep/test_ep_context.py
        autotp.explain(moe_model("qwen2_moe"), 2, ep_size=2, sequence_parallel=True)


def refusals_at_ep2(rank: int, world: int, tmp: str) -> list[str]:
    messages = []
    try:
        autotp.wrap(moe_model("qwen3_moe"), 1, ep_size=4)
    except ValueError as err:
        messages.append(str(err))
    model = autotp.wrap(moe_model("qwen3_moe"), 1, ep_size=2)
    for attempt in (
        lambda: autotp.fully_shard(model),
        lambda: DistributedDataParallel(model, process_group=autotp.dp_group(model)),
    ):
        try:
            attempt()
            messages.append("accepted")
        except NotImplementedError as err:
            messages.append(str(err))
    with autotp.GatherReplacedLayerParams(model):  # every expert on every rank, computed as one process
        logits = model(input_ids=GLOBAL[:1]).logits
    messages.append(logits.shape == (1, GLOBAL.shape[1], model.config.vocab_size))
    return messages


def test_ep_refuses_by_name_what_it_cannot_do_yet(tmp_path) -> None:
    for messages in run_ranks(refusals_at_ep2, 2, str(tmp_path)):
        assert "ep_size=4 must divide the world size 2" in messages[0]
        assert messages[1] == "accepted"  # fully_shard at ep > 1: tests/ep/test_expert_compose.py
        assert "DistributedDataParallel at ep_size=2" in messages[2]
        assert messages[3] is True


def loaded_at_ep2(rank: int, world: int, path: str) -> dict:
    """`from_pretrained(..., ep_size=2)` against `wrap(transformers' own load, ep_size=2)`: same tensors, same loss."""
    direct = autotp.from_pretrained(path, 1, ep_size=2)
    reference = autotp.wrap(AutoModelForCausalLM.from_pretrained(path), 1, ep_size=2)
    theirs = reference.state_dict()
    with torch.no_grad():
        losses = [m(input_ids=GLOBAL[:2], labels=GLOBAL[:2]).loss.item() for m in (direct, reference)]
    return {
        "unequal": [k for k, v in direct.state_dict().items() if not torch.equal(v, theirs[k])],
        "loss": abs(losses[0] - losses[1]),
    }


def test_from_pretrained_at_ep2_equals_wrap_after_transformers_load(tmp_path) -> None:
    moe_model("qwen3_moe").save_pretrained(tmp_path)
    for report in run_ranks(loaded_at_ep2, 2, str(tmp_path)):
        assert report["unequal"] == [] and report["loss"] == 0.0, report
