"""JetMoE under TP alone (issue 51): its mixture of attention split by kv heads (kv_proj shared by the experts, each
expert's query rows and output columns by the same heads) and its MoE by each expert's width (gate | up kept beside
each other), both parallel-experts linears whose row side is summed as it returns, before the routing weights and the
block's bias. Against one process: loss, every gradient, parameters after 3 AdamW steps (autotp.testing's fp32
tolerances: only the order of sums differs), greedy generate with a cache (logits within 1e-5: fp32 rounding of
reordered sums; a head paired with another rank's keys or a bias counted twice moves them by a good part of their
scale), and the all-reduce bytes `autotp plan` predicts against those a step moves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

import autotp
from autotp.planning.planner import build_plan
from autotp.testing import assert_parity, compare_training, run_ranks, tiny_config
from autotp.testing.parity import compare_loading
from models import batch, step_bytes

SHARDED = [  # under the first layer: what each rank holds a part of
    "self_attention.kv_proj.weight",
    "self_attention.experts.input_linear.weight",
    "self_attention.experts.output_linear.weight",
    "mlp.input_linear.weight",
    "mlp.output_linear.weight",
]
PROMPT = torch.randint(0, 512, (2, 6), generator=torch.Generator().manual_seed(3))


def trained_like() -> torch.nn.Module:
    """Tiny JetMoE (hidden 64, 4 kv heads so that tp 4 splits them too) with its blocks' biases drawn at random, as a
    checkpoint holds them (HF initialises them to 0, which would hide a bias counted twice)."""
    config = tiny_config("jetmoe")
    config.num_key_value_heads = 4
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    return model


def generated(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model.generate(
            PROMPT, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
            return_dict_in_generate=True, use_cache=True,
        )  # fmt: skip
    return out.sequences, torch.stack(out.logits)


def jetmoe_parity(rank: int, world: int, path: str) -> dict:
    report = compare_training(trained_like(), batch(512), world)
    tokens, logits = generated(trained_like().eval())
    wrapped = autotp.wrap(trained_like().eval(), world)
    got_tokens, got_logits = generated(wrapped)
    report["shards"] = {n for n, p in wrapped.named_parameters() if hasattr(p, "autotp_shard")}
    report["generate"] = (torch.equal(tokens, got_tokens), (logits - got_logits).abs().max().item())
    report["collective_bytes"] = step_bytes(autotp.wrap(trained_like(), world))
    report["attentions"] = attentions_gap(world)
    report["loading"] = compare_loading(rank, world, f"{path}/hf")
    autotp.save_pretrained(wrapped, f"{path}/ours-{world}")
    if rank == 0:
        saved = load_file(f"{path}/ours-{world}/model.safetensors")
        whole = trained_like().state_dict()
        report["saved"] = sorted(k for k in whole if k in saved and not torch.equal(saved[k], whole[k]))
        report["saved_names"] = set(saved) == set(whole) - {"lm_head.weight"}  # tied to the embedding
    return report


def attentions_gap(world: int) -> float:
    """`output_attentions=True` (eager): the weights of every head of each of a token's top-k attention experts, in
    one process's order, though each rank computes only its kv heads' (each of its top-k runs gathered by heads)."""
    models = [trained_like().eval() for _ in range(2)]
    for model in models:
        model.set_attn_implementation("eager")
    models[1] = autotp.wrap(models[1], world)
    with torch.no_grad():
        whole, gathered = (model(PROMPT, output_attentions=True).attentions for model in models)
    return max((a - b).abs().max().item() if a.shape == b.shape else float("inf") for a, b in zip(whole, gathered))


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_jetmoe_attention_and_moe_experts_shard_with_one_process_parity(tp: int, tmp_path: Path) -> None:
    """Also its checkpoints: transformers' save loads into the shards as `wrap` does after transformers' own load
    (bit for bit), and `autotp.save_pretrained` writes the one-process tensors (bit for bit: gathers copy rows)."""
    trained_like().save_pretrained(tmp_path / "hf")
    for report in run_ranks(jetmoe_parity, tp, str(tmp_path)):
        missing = [n for n in SHARDED if f"model.layers.0.{n}" not in report["shards"]]
        assert not missing, f"not sharded at tp {tp}: {missing}"
        assert_parity(report)
        same_tokens, gap = report["generate"]
        assert same_tokens and gap < 1e-5, report["generate"]
        predicted, moved = report["collective_bytes"]
        assert predicted == moved, f"autotp plan predicts {predicted} bytes a step, {moved} moved"
        assert report["attentions"] < 1e-6, report["attentions"]
        loading = report["loading"]
        assert loading["keys"] and loading["unequal"] == [] and loading["shards"] > 0, loading
        assert loading["logits"] == 0.0 and loading["loss"] == 0.0 and loading["grads"] == [], loading
        assert report.get("saved", []) == [] and report.get("saved_names", True), report.get("saved")


def test_jetmoe_default_config_at_tp8_holds_an_eighth_a_rank_on_meta() -> None:
    """Issue 51's measure at the default (flagship) config: the largest rank's share of the parameter bytes."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("jetmoe"))
    plan = build_plan(model, 8)
    fraction = max(plan.param_bytes(model)) / sum(p.numel() * p.element_size() for p in model.parameters())
    assert fraction <= 0.16, fraction
    sharded = plan.sharded_params(model)
    assert all(f"model.layers.11.{name}" in sharded for name in SHARDED)
    assert plan.vocab is not None and plan.vocab.tied


def test_jetmoe_fewer_kv_heads_than_ranks_is_refused_by_name() -> None:
    """2 kv heads over 4 ranks: every expert's queries of a head meet that head's keys, so a head cannot be shared
    by ranks that split its queries (it has one query a head per expert)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("jetmoe"))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attention: 2 query heads over tp_size=4"):
        build_plan(model, 4)
