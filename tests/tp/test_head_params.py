"""Per-head parameters split with their heads and experts under TP alone (issue 51, items 1 and 4): gpt-oss's
attention sinks and its experts (gate|up interleaved column by column, a bias on each, a clamped SwiGLU, the output
bias counted once), flint's sinks and per-head q/k norms (found by detection, verified by emulation) and MPT's fused
Wqkv with ALiBi and BitNet's sub-norms over the split width (statistics all-reduced; shipped policies), and experts
found by transformers' own layout flags (Zaya's [gate | up], Aria's transposed; MiniMax's beside its attention),
against one process: loss, every gradient, parameters after 3 AdamW steps (autotp.testing's fp32 tolerances: only the
order of sums differs), and greedy generate with a cache (logits within 1e-5: fp32 rounding of reordered sums; a head's sink on
the wrong rank or a bias counted twice moves them by a good part of their scale).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

import autotp
from autotp.planning.planner import build_plan
from autotp.planning.report import summary
from autotp.planning.sharding import layout_partition, split_ranges
from autotp.testing import assert_parity, compare_training, run_ranks, tiny_config
from models import batch

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
    # experts laid out as transformers' use_experts_implementation flags say (no plan of HF's names them whole)
    "zaya": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],  # [experts, gate | up, hidden]
    "aria_text": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],  # transposed: [experts, hidden, gate | up]
    # full attention (layer 0) and experts; its lightning attention (layer 1) stays replicated, the reason in the plan
    "minimax": ["self_attn.q_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
LAYERS = {family: "model.layers" for family in SHARDED} | {"mpt": "transformer.blocks"}
PROMPT = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(3))


def trained_like(family: str) -> nn.Module:
    """The tiny model with every bias and sink drawn at random, as a checkpoint holds them (HF initialises some to 0,
    which would hide a bias counted twice)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0.0, 0.1)
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


def step_bytes(model: nn.Module) -> tuple[int, int]:
    """The all-reduce bytes `autotp plan` predicts for a training step, and those a step moves (after a first one:
    it checks the random streams once)."""
    ids = batch(512, (1, 8))
    predicted = summary(model, model.autotp_state.plan, *ids.shape)["collective_bytes_per_step"]
    model(ids, labels=ids).loss.backward()
    moved, original = [0], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        moved[0] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        model(ids, labels=ids).loss.backward()
    finally:
        dist.all_reduce = original
    return predicted, moved[0]


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
            assert predicted == moved, f"{family}: autotp plan predicts {predicted} bytes a step, {moved} moved"


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
        model = AutoModelForCausalLM.from_config(tiny_config(family))
    plan = build_plan(model, 4)
    sharded = plan.sharded_params(model)
    for name in SHARDED[family]:
        assert f"{LAYERS[family]}.0.{name}" in sharded, (family, name)
    if family in ("gpt_oss", "flint"):
        sinks = sharded["model.layers.0.self_attn.sinks"]
        assert [sinks.local_size(r) for r in range(4)] == [1, 1, 1, 1]
