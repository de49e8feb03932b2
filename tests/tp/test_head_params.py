"""Per-head parameters split with their heads and experts under TP alone (issue 51, items 1 and 4): gpt-oss's
attention sinks and its experts (gate|up interleaved column by column, a bias on each, a clamped SwiGLU, the output
bias counted once), flint's sinks and per-head q/k norms (found by detection, verified by emulation) and MPT's fused
Wqkv with ALiBi, BitNet's sub-norms over the split width (statistics all-reduced) and Dory's per-column scales and
L2 sub-norms (shipped policies), and experts found by transformers' own layout flags (Zaya's [gate | up], Aria's
transposed; MiniMax's beside its attention), against one process: loss, every gradient, parameters after 3 AdamW
steps (autotp.testing's fp32 tolerances: only the order of sums differs), and greedy generate with a cache (logits
within 1e-5: fp32 rounding of reordered sums; a head's sink on
the wrong rank or a bias counted twice moves them by a good part of their scale).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import autotp
from autotp.planning.planner import build_plan
from autotp.planning.sharding import layout_partition, split_ranges
from autotp.testing import assert_parity, compare_training, run_ranks, tiny_config
from models import batch, step_bytes

# What must be sharded (a rank holds its heads' sinks, its width of every expert), under each family's first layer
SHARDED = {
    "gpt_oss": [
        "self_attn.sinks",
        "mlp.experts.gate_up_proj",
        "mlp.experts.gate_up_proj_bias",
        "mlp.experts.down_proj",
    ],
    "flint": ["self_attn.sinks", "self_attn.q_proj.weight", "self_attn.o_proj.weight"],
    "mpt": ["attn.Wqkv.weight", "attn.out_proj.weight", "ffn.up_proj.weight"],  # ALiBi sliced to each rank's heads
    "bitnet": ["self_attn.attn_sub_norm.weight", "mlp.ffn_sub_norm.weight", "self_attn.o_proj.weight"],
    # per-column scales split with the heads' channels and the MLP width, weightless L2 sub-norms over the split width
    # heads dim_head wide; the model's relative position bias table split with the heads (checked by parity)
    "cpmant": ["self_att.self_attention.project_q.weight", "ffn.ffn.w_in.w_0.weight"],
    # full attention by heads as BERT's (CONFIG: block-sparse stays replicated, with its reason) and the MLP
    "big_bird": ["attention.self.query.weight", "attention.output.dense.weight", "intermediate.dense.weight"],
    # the feed-forward by width (its relative attention is einsum tensors with no row linear: replicated)
    "xlnet": ["ff.layer_1.weight", "ff.layer_2.weight"],
    # the dense MLP by a shipped policy, the attention replicated with its reason (tests below)
    "doge": ["mlp.gate_proj.weight", "mlp.down_proj.weight"],
    "dory": ["self_attn.sqk", "self_attn.s_gate", "self_attn.gate_proj.weight", "mlp.suv_gate", "mlp.suv_up"],
    # experts laid out as transformers' use_experts_implementation flags say (no plan of HF's names them whole)
    "zaya": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],  # [experts, gate | up, hidden]
    "aria_text": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],  # transposed: [experts, hidden, gate | up]
    # full attention (layer 0) and experts; its lightning attention (layer 1) stays replicated, the reason in the plan
    "minimax": ["self_attn.q_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
LAYERS = {family: "model.layers" for family in SHARDED} | {
    "mpt": "transformer.blocks",
    "cpmant": "cpmant.encoder.layers",
    "big_bird": "bert.encoder.layer",
    "xlnet": "transformer.layer",
}
# CPM-Ant's defaults draw weights with std 1 and a 10240-wide MLP: logits so large that fp32 rounding alone moves the
# loss by 3e-4 (2e-12 in fp64); at a checkpoint-like scale the harness's fp32 tolerances hold
# Dory runs its layers in input, looped and output sections that overlap in a 2-layer model (each layer twice), which
# `autotp plan`'s byte count (each block once a step) does not know: no output section here, so each layer runs once
CONFIG = {
    "cpmant": {"init_std": 0.02, "dim_ff": 128},
    "dory": {"n_output_layers": 0},
    "big_bird": {"attention_type": "original_full"},
    "xlnet": {"d_inner": 128},  # its default feed-forward is 4096 wide: the same split, at a test's cost
}
# `autotp plan` counts the tokens it is given: CPM-Ant prepends `prompt_length` prompt tokens to each row of 8
TOKENS = {"cpmant": (8 + tiny_config("cpmant").prompt_length) / 8}
PROMPT = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(3))


def config_of(family: str):
    config = tiny_config(family)
    for key, value in CONFIG.get(family, {}).items():
        setattr(config, key, value)
    return config


def trained_like(family: str) -> nn.Module:
    """The tiny model with every bias and sink drawn at random, and every per-column scale varied, as a checkpoint holds
    them (HF initialises some to 0 or to one constant, which would hide a bias counted twice or a scale misplaced)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(family), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.1)
            elif name.endswith(("sqk", "s_gate", "suv_gate", "suv_up")):
                param.mul_(torch.empty_like(param).uniform_(0.5, 1.5))
    return model


def generated(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(
            PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def families_parity(rank: int, world: int, families: list[str]) -> dict:
    """Per family: the training parity report, the sharded names, generate's tokens and logits gap to one process."""
    out = {}
    for family in families:
        report = compare_training(trained_like(family), batch(512), world)
        tokens, logits = generated(trained_like(family).eval())
        wrapped = autotp.wrap(trained_like(family).eval(), world)
        got_tokens, got_logits = generated(wrapped)
        report["shards"] = {n for n, p in wrapped.named_parameters() if hasattr(p, "autotp_shard")}
        report["generate"] = (torch.equal(tokens, got_tokens), (logits - got_logits).abs().max().item())
        report["collective_bytes"] = step_bytes(autotp.wrap(trained_like(family), world))
        out[family] = report
    return out


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sinks_norms_and_experts_shard_with_one_process_parity(tp: int) -> None:
    for reports in run_ranks(families_parity, tp, list(SHARDED)):
        for family, report in reports.items():
            missing = [n for n in SHARDED[family] if f"{LAYERS[family]}.0.{n}" not in report["shards"]]
            assert not missing, f"{family}: not sharded at tp {tp}: {missing}"
            assert_parity(report)
            same_tokens, gap = report["generate"]
            assert same_tokens and gap < 1e-5, (family, report["generate"])
            predicted, moved = report["collective_bytes"]
            tokens = TOKENS.get(family, 1)
            assert predicted * tokens == moved, (
                f"{family}: autotp plan predicts {predicted} bytes x {tokens}, {moved} moved"
            )


def families_pipelined(rank: int, world: int, families: list[str]) -> dict:
    """Per family: the training parity report at tp 2 x pp `world // 2`."""
    return {family: compare_training(trained_like(family), batch(512), 2, pp_size=world // 2) for family in families}


@pytest.mark.slow
def test_sinks_and_experts_under_a_pipeline_train_as_one_process() -> None:
    """gpt-oss's sinks and experts, MPT's ALiBi heads, MiniMax's experts at tp 2 x pp 2."""
    for reports in run_ranks(families_pipelined, 4, ["gpt_oss", "mpt", "minimax"]):
        for report in reports.values():
            assert_parity(report)  # fp32: only the order of sums differs


def test_interleaved_layout_keeps_each_gate_beside_its_up() -> None:
    """ "(w w)": rank r holds gate and up columns of its own width items, in their stored order."""
    partition = layout_partition("(w w)", 1, {"w": split_ranges(6, 2)}, {"w": 1})
    full = torch.arange(12).repeat(3, 1)  # columns g0 u0 g1 u1 ... g5 u5
    assert partition.shard(full, 0)[0].tolist() == list(range(6))
    assert partition.shard(full, 1)[0].tolist() == list(range(6, 12))


@pytest.mark.parametrize("family", list(SHARDED))
def test_plan_shards_sinks_and_experts_on_meta(family: str) -> None:
    """At tp 4 on the meta device (what `autotp plan` prints): the sinks by heads, one head a rank."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config_of(family))
    plan = build_plan(model, 4)
    sharded = plan.sharded_params(model)
    for name in SHARDED[family]:
        assert f"{LAYERS[family]}.0.{name}" in sharded, (family, name)
    if family in ("gpt_oss", "flint"):
        sinks = sharded["model.layers.0.self_attn.sinks"]
        assert [sinks.local_size(r) for r in range(4)] == [1, 1, 1, 1]


def test_doge_attention_stays_replicated_with_its_reason() -> None:
    """Doge's dynamic mask reads every key/value head's values: its attention is never split, and the plan says why."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("doge"))
    reasons = dict(build_plan(model, 2).replicated)
    assert "dynamic mask" in reasons["model.layers.0.self_attn.dt_proj"].detail


def test_big_bird_block_sparse_attention_stays_replicated_with_its_reason() -> None:
    """Block-sparse attention (BigBird's default) draws random blocks head by head: replicated, the MLP still split."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("big_bird"))
    plan = build_plan(model, 2)
    assert "block-sparse" in dict(plan.replicated)["bert.encoder.layer.0.attention.self.query"].detail
    assert "bert.encoder.layer.0.intermediate.dense.weight" in plan.sharded_params(model)
