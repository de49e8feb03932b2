"""Expert parallelism on every MoE causal-LM family transformers 5.24 builds, against one process (the harness and
its tolerances: ep_workers.py): ep 2 on 2 ranks at tp 1, tp 2 x ep 2 on 4 ranks (EP takes the TP ranks first,
expert-DP 2), and tp 2 x ep 4 on 8 ranks (dp 4: one row of the batch per TP pair; EP groups 0..3 and 4..7, one of
the tiny models' 4 experts per rank; expert-DP {r, r + 4}: autotp/ep/groups.py's picture); the router's
load-balancing loss at dp 1; the families autotp refuses, by name.

The quick tier keeps one family per way of holding experts that autotp/ep/regions.py meets: gpt-oss (found by
structure; interleaved gate|up, biases), DBRX (found by structure; flat [experts * width, hidden] tensors, a 3-D
input) and DeepSeek-V3 (shared experts, grouped top-k with a correction bias, dense first layer). The rest, and every
family's 4-rank and 8-rank cases, are `slow` (4 ranks: about 2.5 minutes on 2 cores). The 8 gloo ranks oversubscribe
CI's 2 cores, yet every family fits: on 2 cores the whole 8-rank set took 31 s idle and 44 s beside other jobs (load
5), the one-process reference included: about 1 s a family (0.8-1.8 s), nemotron_h 6.8-8.9 s, qwen3_next and
qwen3_5_moe_text 3.6-6.2 s (measured before the families from deepseek_v2 on were added).
scripts/sweep_expert_parallel.py runs the same harness over every causal-LM type for docs/supported-models.md's
"ep 2" column; the last test keeps that column to what these tests check.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import autotp
from autotp.testing import run_ranks
from ep_workers import check, ep_rank_run, moe_model, single_process

QUICK = ["gpt_oss", "dbrx", "deepseek_v3"]
SLOW = [
    "qwen2_moe",
    "phimoe",
    "glm4_moe",
    "granitemoe",
    "granitemoeshared",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "minimax",
    "jamba",
    "flex_olmo",
    "exaone_moe",
    "solar_open",
    "nemotron_h",
    "afmoe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "deepseek_v2",
    "glm_moe_dsa",
    "dots1",
    "lfm2_moe",
    "granitemoehybrid",
    "aria_text",
    "cohere2_moe",
    "deepseek_v4",
    "granitemoe_swa",
    "hy_v3",
    "inkling_text",
    "inkling2_text",
    "inkling2_loop_text",
    "kimi_linear",
    "kolibri1",
    "laguna",
    "lara_mini",
    "mellum",
    "mimo_v2_flash",
    "minimax_m2",
    "minimax_m3_vl_text",
    "qwen3_5_moe",
    "qwen4_exp",
    "qwen4_exp_text",
    "sarvam_moe",
    "zaya",
    "glm4_moe_lite",
    "deepseek_v32",
]
EVERY = ["qwen3_moe", "mixtral", "olmoe", *QUICK, *SLOW]
REFUSED = [
    ("llama4_text", "Llama4TextExperts", "is not called as experts"),
    ("llama4", "Llama4TextExperts", "is not called as experts"),
    ("jetmoe", "JetMoeMoA", "is not called as experts"),
    ("longcat_flash", "LongcatFlashExperts", "has no integer num_experts"),
]
SWEEP = Path(__file__).resolve().parents[2] / "scripts" / "sweep_results_ep.json"  # the page's "ep 2" column
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.5)
pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("family", [*QUICK, *(pytest.param(f, marks=pytest.mark.slow) for f in SLOW)])
def test_ep2_on_two_ranks_equals_one_process(family: str) -> None:
    expected = single_process(family)
    for report in run_ranks(ep_rank_run, 2, family, 1, 2):
        check(report, expected)
        assert report["expert_bytes"] * 2 == expected["expert_bytes"]


@pytest.mark.slow
@pytest.mark.parametrize("world,ep", [(4, 2), (8, 4)], ids=["tp2-ep2-on-4-ranks", "tp2-ep4-on-8-ranks"])
@pytest.mark.parametrize("family", EVERY)
def test_tp2_on_more_ranks_equals_one_process(family: str, world: int, ep: int) -> None:
    """tp 2 x ep 2 on 4 ranks (expert-DP 2) and tp 2 x ep 4 on 8 (EP groups 0..3 and 4..7, expert-DP {r, r + 4})."""
    expected = single_process(family)
    for report in run_ranks(ep_rank_run, world, family, 2, ep):
        check(report, expected)
        assert report["expert_bytes"] * ep == expected["expert_bytes"]


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_load_balancing_loss_at_dp1_equals_one_process(family: str) -> None:
    """tp 2 x ep 2 on 2 ranks (dp 1): the router runs on every token on each TP rank, before the experts split the
    tokens, so transformers' load-balancing loss reads every token's router logits, as one process does."""
    expected, plain = single_process(family, config=AUX), single_process(family)
    assert min(a - b for a, b in zip(expected["losses"], plain["losses"])) > 0.1, "the aux loss must count"
    for report in run_ranks(ep_rank_run, 2, family, 2, 2, "right", AUX):
        check(report, expected)


@pytest.mark.parametrize("family,module,why", REFUSED)
def test_families_autotp_cannot_dispatch_to_are_refused_by_name(family: str, module: str, why: str) -> None:
    """Llama 4's experts take every token scaled by its score ([experts * tokens, hidden], no top-k indices);
    JetMoE's mixture of attention heads is called with its own routing. LongCat-Flash's router picks among the routed
    experts and zero-computation ones, which its experts module runs as identities (indices past the routed experts;
    its gate_up_proj holds rows for both, its down_proj for the routed ones): no token of those may leave the rank,
    and the module has no `num_experts`. Refused before any group exists."""
    with pytest.raises(NotImplementedError, match=f"ep_size=2: .*experts \\({module}\\) {why}"):
        autotp.explain(moe_model(family), 1, ep_size=2)


def test_the_supported_models_ep_column_claims_only_what_these_tests_check() -> None:
    """docs/supported-models.md's "ep 2" column comes from scripts/sweep_results_ep.json (same harness): every type
    it calls matched is a parity test here at ep 2, tp 2 x ep 2 and tp 2 x ep 4 (qwen3_moe, mixtral and olmoe at ep 2 in
    test_expert_parallel.py), every type it calls refused is refused here by name, and none is a MISMATCH."""
    sweep = json.loads(SWEEP.read_text())
    by = {v: {t for t, r in sweep.items() if r["result"] == v} for v in ("matched", "refused", "MISMATCH")}
    assert by["matched"] == set(EVERY) == {"qwen3_moe", "mixtral", "olmoe", *QUICK, *SLOW}
    assert by["refused"] == {family for family, _, _ in REFUSED}
    assert not by["MISMATCH"]
