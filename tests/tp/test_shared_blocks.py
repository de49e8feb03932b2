"""Blocks that stayed replicated at the families' default configs (issue 51), sharded and equal to one process:
Falcon-H1's MLP (its output is down_proj's times `down_multiplier`) and Zamba2's shared transformer block (attention
on hidden | embeddings, fused gate|up, per-layer low-rank adapters, tied across hybrid layers: made one module).

Tolerances: the parity harness's fp32 ones (`autotp.testing.parity`): a sharded sum rounds differently from one
matmul by a few ulps; a wrong split, or a tie cut (two copies trained apart), is off by a good part of the scale.
Generation is greedy with the cache, compared token for token, and the last step's logits to 1e-4 of their scale.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.planning.plan import Replicated
from autotp.planning.planner import build_plan
from autotp.planning.ties import unshared
from autotp.sp.sequence import sequence_layout
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import cached_generation, edited_model, tiny_model

# multipliers other than 1 so that a factor applied twice or not at all shows; Zamba2 with two hybrid layers (the
# block tied across them) and its attention adapters on (adapters need heads x head_dim = 2 x hidden)
CASES = {
    "falcon_h1": {
        "mamba_d_state": 8,
        "mamba_n_groups": 4,
        "mamba_rms_norm": True,
        "mlp_multipliers": [0.5, 2.0],
        "key_multiplier": 0.7,
        "ssm_multipliers": [1.5, 0.5, 2.0, 0.8, 1.2],
    },
    "zamba2": {
        "mamba_ngroups": 2,
        "mamba_d_state": 8,
        "layers_block_type": ["hybrid", "hybrid"],
        "hybrid_layer_ids": [0, 1],
        "attention_hidden_size": 128,
        "attention_head_dim": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "use_shared_attention_adapter": True,
        "adapter_rank": 8,
    },
}
BLOCKS = {  # what each family's plan must shard
    "falcon_h1": ("model.layers.0.feed_forward.down_proj", "model.layers.1.feed_forward.gate_proj"),
    "zamba2": (
        "model.layers.0.shared_transformer.self_attn.q_proj",
        "model.layers.0.shared_transformer.self_attn.linear_v_adapter_list.1.1",
        "model.layers.0.shared_transformer.feed_forward.gate_up_proj",
        "model.layers.0.shared_transformer.feed_forward.gate_up_proj_adapter_list.0.1",
    ),
}


def _model(family: str) -> torch.nn.Module:
    return edited_model(family, CASES[family])


def shared_parity(rank: int, world: int) -> dict:
    """Runs on each rank: per family, the training report against one process, what the plan shards and shares, and
    the generation check."""
    reports = {}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for family in CASES:
        plan = build_plan(_model(family), world)
        report = parity.compare_training(_model(family), ids, world, steps=2)
        model = autotp.wrap(_model(family), world)
        report["generate"] = cached_generation(_model(family), model, ids)
        report["sharded"] = [layer.path for layer in plan.layers]
        report["shared"] = list(plan.shared)
        layers = model.model.layers
        report["one block"] = family != "zamba2" or layers[1].shared_transformer.self_attn is (
            layers[0].shared_transformer.self_attn
        )
        reports[family] = report
    return reports


@pytest.mark.slow
def test_shared_blocks_tp2() -> None:
    for report in run_ranks(shared_parity, 2):
        for family, found in report.items():
            missing = [path for path in BLOCKS[family] if path not in found["sharded"]]
            assert not missing, f"{family}: not sharded: {missing}"
            parity.assert_parity(found)
            assert found["generate"]["tokens"], f"{family}: greedy tokens differ with the cache"
            assert found["generate"]["logits"] <= 1e-4, f"{family}: logits differ by {found['generate']['logits']}"
            assert found["one block"], f"{family}: the tied block was not made one module"
        assert report["zamba2"]["shared"] == [
            ("model.layers.1.shared_transformer.self_attn", "model.layers.0.shared_transformer.self_attn"),
            ("model.layers.1.shared_transformer.feed_forward", "model.layers.0.shared_transformer.feed_forward"),
        ]


def test_pipeline_keeps_the_tied_block_replicated() -> None:
    """Under a pipeline the tied copies may lie on other stages, each training its own tensor (`autotp.pp.shared` sums
    their gradients): the block and its copies stay replicated there (`unshared`, which `pp_size > 1` applies), as
    before they were shared, rather than shards on one stage against whole copies on another."""
    plan = unshared(build_plan(_model("zamba2"), 2))
    assert not plan.shared
    block = "model.layers.0.shared_transformer"
    assert not [layer.path for layer in plan.layers if layer.path.startswith(block)]
    why = dict(plan.replicated)[f"{block}.self_attn.q_proj"]
    assert why.reason is Replicated.NOT_VERIFIED and "pipeline" in str(why), why


def test_sequence_parallel_refuses_a_module_kept_whole_in_a_block() -> None:
    """A module a rule keeps whole inside a sharded block (an adapter's down-projection, a mixer's `whole`) would see
    one chunk of the sequence under sequence parallelism, its weight gradient partial: refused by name, up front."""
    policy = {
        "mixer": [
            {
                "match": "model.layers.*.mlp",
                "heads": "intermediate_size",
                "column": ["gate_proj", "up_proj"],
                "row": ["down_proj"],
                "whole": ["act_fn"],
            }
        ]
    }
    model = tiny_model("llama")
    plan = build_plan(model, 2, policy=policy)
    with pytest.raises(ValueError, match=r"keeps model\.layers\.0\.mlp\.act_fn whole .* sequence_parallel=False"):
        sequence_layout(model, plan)
