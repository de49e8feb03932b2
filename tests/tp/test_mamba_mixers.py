"""Mamba and Mamba-2 mixers split by heads (issue 51, items 1-2): equal to one process in training and in cached
generation, planned so at the families' default sizes too.

Tolerances: the parity harness's fp32 ones (`autotp.testing.parity`): a sharded sum of per-head partial products
rounds differently from one matmul by a few ulps; a wrong split is off by a good part of the scale. Generation is
greedy, compared token for token, and the cached step's logits to 1e-4 of their scale.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.planning.planner import build_plan
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import cached_generation, edited_model

# family -> config edits: `n_groups` chosen so that both norms run (whole groups per rank, and one group over several
# ranks, its statistics summed); the hybrids with an attention layer, which their cache needs to generate
CASES = {
    "mamba2": {"n_groups": 1, "state_size": 8},
    "zamba2": {
        "mamba_ngroups": 2,
        "mamba_d_state": 8,
        "layers_block_type": ["linear_attention", "hybrid"],
        "attention_hidden_size": 128,
        "kv_channels": 16,
        "num_query_groups": 4,
        "hybrid_layer_ids": [1],
    },
    "granitemoehybrid": {
        "mamba_n_groups": 1,
        "mamba_d_state": 8,
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "layer_types": ["linear_attention", "full_attention"],
    },
    "mamba": {"state_size": 8},
    "falcon_mamba": {"state_size": 8},
    "zamba": {
        "n_mamba_heads": 4,
        "mamba_d_state": 8,
        "mamba_dt_rank": 8,
        "layers_block_type": ["mamba", "hybrid", "hybrid"],
        "num_hidden_layers": 3,
        "attention_hidden_size": 128,
        "attention_head_dim": 32,
    },
    "jamba": {"mamba_d_state": 8, "attn_layer_period": 2, "attn_layer_offset": 1},
    "falcon_h1": {"mamba_d_state": 8, "mamba_n_groups": 4, "mamba_rms_norm": True},
    # Mamba-2, experts, attention and an MLP in its 4 layers (`layers.*.mixer` each); 8 heads where the defaults' 128
    # would fill 8192 channels
    "nemotron_h": {
        "mamba_num_heads": 8,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "ssm_state_size": 8,
        "moe_shared_expert_intermediate_size": 64,
    },
    "bamba": {
        "mamba_n_heads": 8,
        "mamba_d_head": 16,
        "mamba_n_groups": 1,
        "mamba_d_state": 8,
        "attn_layer_indices": [1],
    },
}
QUICK = ("mamba2", "mamba")  # Mamba-2 with one group over both ranks; Mamba's row x_proj read again
# at tp 4: groups over ranks (1, 2), aligned (4: Falcon-H1's own norm), Mamba's norms on x_proj's output, a MoE
# hybrid, Zamba's per-head Mamba
SLOW = (
    "mamba2",
    "zamba2",
    "falcon_h1",
    "jamba",
    "granitemoehybrid",
    "falcon_mamba",
    "zamba",
    "mamba",
    "nemotron_h",
    "bamba",
)
# at tp 2 besides QUICK, in the slow tier: the hybrids and Falcon-Mamba
HYBRIDS = ("zamba2", "falcon_h1", "jamba", "granitemoehybrid", "falcon_mamba", "nemotron_h", "bamba")
# at tp 2 x pp 2 (slow): Mamba-2 with one group over both TP ranks, and every family here that the pipeline sweep
# matches at pp 2 (Bamba's pipeline is refused; Zamba2's shared block is kept whole when its copies span stages)
PIPELINED = ("mamba2", "nemotron_h", "falcon_h1", "zamba2", "granitemoehybrid", "falcon_mamba", "mamba", "jamba")


def _model(family: str) -> torch.nn.Module:
    return edited_model(family, CASES[family])


def mixers_parity(rank: int, world: int, families: tuple[str, ...], sequence_parallel: bool = False) -> dict:
    """Runs on each rank: per family, the training report against one process, what the plan split, and the
    generation check; with `sequence_parallel`, also the training report under it (the mixer gathers the sequence
    at in_proj and reduce-scatters at out_proj)."""
    reports = {}
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for family in families:
        reference = _model(family)
        plan = build_plan(reference, world)
        report = parity.compare_training(reference, ids, world, steps=2)
        model = autotp.wrap(_model(family), world)
        report["generate"] = cached_generation(_model(family), model, ids)
        report["mixers"] = sum(p.name == "A_log" for p in plan.params)
        report["group_norms"] = len(plan.group_norms)
        if sequence_parallel:
            report["sp"] = parity.compare_training(_model(family), ids, world, steps=2, sequence_parallel=True)
        reports[family] = report
    return reports


def mixers_pipelined(rank: int, world: int, families: tuple[str, ...]) -> dict:
    """Runs on each rank: per family, the training report at tp 2 x pp `world // 2` against one process."""
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    return {family: parity.compare_training(_model(family), ids, 2, steps=2, pp_size=world // 2) for family in families}


def _check(reports: list[dict]) -> None:
    for report in reports:
        for family, found in report.items():
            assert found["mixers"], f"{family}: no mixer split"
            parity.assert_parity(found)
            if "sp" in found:
                parity.assert_parity(found["sp"])
            assert found["generate"]["tokens"], f"{family}: greedy tokens differ with the cache"
            assert found["generate"]["logits"] <= 1e-4, f"{family}: logits differ by {found['generate']['logits']}"


def test_mamba_mixers_tp2() -> None:
    _check(run_ranks(mixers_parity, 2, QUICK, True))


@pytest.mark.slow
def test_hybrid_mixers_tp2() -> None:
    _check(run_ranks(mixers_parity, 2, HYBRIDS))


@pytest.mark.slow
def test_mamba_mixers_tp4() -> None:
    reports = run_ranks(mixers_parity, 4, SLOW)
    _check(reports)
    assert all(reports[0][family]["group_norms"] for family in ("mamba2", "zamba2", "granitemoehybrid"))


@pytest.mark.slow
def test_mamba_mixers_under_a_pipeline() -> None:
    for reports in run_ranks(mixers_pipelined, 4, PIPELINED):
        for report in reports.values():
            parity.assert_parity(report)  # fp32: only the order of sums differs
