"""Ranks that must agree, and state that must not cross ranks: DP replicas broadcast at wrap and checked; configs,
options and plans compared before the model is touched; plain state dicts tagged with their layout; explicit
plans applied with the user's example inputs; MoE experts at widths grouped_mm refuses.

Parity tolerances are autotp.testing's (fp32, only the order of sums differs).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import assert_parity, compare_training, run_ranks, tiny_config
from models import batch, tiny_model


def dp_replicas(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama", seed=rank), 2)  # no common seed: every rank starts apart
    tensors = [t.detach() for t in [*model.parameters(), *model.buffers()]]
    theirs: list = [None] * autotp.dp_size()
    dist.all_gather_object(theirs, tensors, group=autotp.dp_group())
    equal = all(torch.equal(a, b) for a, b in zip(theirs[0], theirs[1]))
    autotp.check_replicas(model)  # passes: wrap made them equal
    if rank == 3:
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.add_(1e-3)  # a shard drifts on one DP replica
    try:
        autotp.check_replicas(model)
        error = None
    except RuntimeError as err:
        error = str(err)
    return {"equal": equal, "error": error}


@pytest.mark.slow
def test_dp_replicas_are_broadcast_at_wrap_and_their_drift_is_named() -> None:
    reports = run_ranks(dp_replicas, 4)
    assert all(report["equal"] for report in reports), reports
    assert reports[0]["error"] is None and reports[2]["error"] is None  # DP group {0, 2} still agrees
    for report in reports[1], reports[3]:
        assert "model.layers.0.self_attn.q_proj.weight (32, 64) differs between DP ranks 1 and 3" in report["error"]


def moe_parity(rank: int, world: int, model_type: str) -> dict:
    config = tiny_config(model_type)
    config.moe_intermediate_size = 12  # 6 fp32 per rank: 24 bytes, not a multiple of 16 (grouped_mm's stride)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    return compare_training(reference, batch(config.vocab_size), world)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "olmoe"])
def test_moe_experts_whose_shard_width_grouped_mm_refuses_train_with_parity(model_type: str) -> None:
    for report in run_ranks(moe_parity, 2, model_type):
        assert_parity(report)
        assert report["sharded"]


DISAGREEMENTS = {  # rank 1's difference -> what the error names
    "intermediate_size": ({"config": {"intermediate_size": 128}}, "config key intermediate_size is 96 on rank 0 but 128"),
    "num_hidden_layers": ({"config": {"num_hidden_layers": 3}}, "config key num_hidden_layers is 2 on rank 0 but 3"),
    "vocab_parallel": ({"options": {"vocab_parallel": False}}, "option vocab_parallel is True on rank 0 but False"),
    "sequence_parallel": ({"options": {"sequence_parallel": True}},
                          "option sequence_parallel is False on rank 0 but True"),
}


def disagreeing(rank: int, world: int, case: str) -> str:
    change = DISAGREEMENTS[case][0] if rank == 1 else {}
    model = tiny_model("llama", **change.get("config", {}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError) as err:
        autotp.wrap(model, world, timeout=20, **change.get("options", {}))
    assert not autotp.parallel.apply.parallel_layers(model)  # refused before anything changed
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return str(err.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_ranks_that_built_or_wrapped_differently_are_named_before_anything_changes(case: str) -> None:
    for message in run_ranks(disagreeing, 2, case):
        assert DISAGREEMENTS[case][1] + " on rank 1" in message, message
        assert "ranks disagree before sharding" in message
