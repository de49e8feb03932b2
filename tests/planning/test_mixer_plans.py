"""Token mixers in a plan (issue 51 item 3): what `autotp plan` shows of them, their rules' errors, and the
refusal of sequence parallelism over them. In-process: plans only, no ranks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import autotp
from autotp.planning.policy import Origin, parse_policy
from autotp.planning.policy_plan import plan_from_policy
from autotp.planning.verify import verify_by_emulation
from autotp.testing import tiny_config
from models import MIXERS


def mixer_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(MIXERS[family](), dtype=torch.float32)


def test_the_plan_shows_each_mixer_and_what_it_shards_in_place() -> None:
    rwkv = autotp.explain(mixer_model("rwkv"), 2)
    text = rwkv.describe(mixer_model("rwkv"))
    assert "in place   rwkv.blocks.0.attention.time_decay  (64,) -> (32,) each" in text
    assert "state      rwkv.blocks.0.attention(state=...)  items [2, 3, 4]" in text
    assert "gathered   rwkv.blocks.0.feed_forward.receptance" in text
    qwen = autotp.explain(mixer_model("qwen3_next"), 2)  # derived, verified by emulation: sharded, not replicated
    assert {p.path.rpartition(".")[2] for p in qwen.params} == {"weight", "A_log", "dt_bias"}
    assert not [path for path, _ in qwen.replicated if ".linear_attn." in path]
    kimi = autotp.explain(mixer_model("kimi_linear"), 2)  # its gates' low-rank down-projections stay whole
    assert kimi.whole == ("model.layers.0.self_attn.forget_gate.f_a_proj", "model.layers.0.self_attn.g_a_proj")
    assert "model.layers.0.self_attn.forget_gate.f_b_proj" in {layer.path for layer in kimi.layers}
    conv = next(p for p in qwen.params if p.path.endswith("conv1d.weight"))
    # [q | k | v] channels (32 | 32 | 64) by key-head group: each rank two q, two k heads and their four v heads
    assert conv.partition.runs == (((0, 16), (32, 16), (64, 32)), ((16, 16), (48, 16), (96, 32)))


def test_a_mixer_that_emulation_cannot_prove_exact_stays_replicated_with_the_reason() -> None:
    """A rule that splits the gated delta-net by value head while its key heads stay whole: wrong, and caught."""
    model = mixer_model("qwen3_next")
    rule = {
        "match": "model.layers.*.linear_attn",
        "heads": "linear_num_value_heads",  # 8 value heads, but the projections hold them by key-head group
        "column": {"in_proj_qkvz": "w", "in_proj_ba": "w"},
        "row": {"out_proj": "w"},
        "params": {"A_log": {"dim": 0}, "dt_bias": {"dim": 0}},
        "head_norms": ["norm"],
    }
    policy = parse_policy({"mixer": [rule]}, "wrong", Origin.DETECTED)
    planned = plan_from_policy(model, 2, policy)
    assert planned.params  # as a derived plan, it goes to verification
    plan = verify_by_emulation(model, planned)
    assert not plan.params
    reasons = {str(why) for path, why in plan.replicated if ".linear_attn." in path}
    assert reasons and all("not verified" in why for why in reasons), reasons


def test_a_mixer_known_not_to_split_says_why_in_the_plan() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("minimax"))  # layer 1: lightning attention
    reasons = {path: str(why) for path, why in autotp.explain(model, 2).replicated}
    assert "normalises all its heads together" in reasons["model.layers.1.self_attn.qkv_proj"]


@pytest.mark.parametrize(
    "rule,message",
    [
        ({"match": "x", "column": {"a": "w"}, "row": {"b": "w"}}, "a mixer rule needs 'heads'"),
        ({"match": "x", "heads": 2, "column": {"a": "w | w*2"}, "row": {"b": "w"}}, r"layout 'w \| w\*2'"),
        ({"match": "x", "heads": 2, "row": {"b": "w"}, "state": {"arg": "s"}}, "state must be a table with"),
    ],
)
def test_mixer_rules_refuse_what_they_cannot_mean(rule: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_policy({"mixer": [rule]}, "bad", Origin.USER)


def test_sequence_parallel_over_a_mixer_is_refused_before_any_change() -> None:
    model = mixer_model("rwkv")  # its token shift runs before the column projections: on a chunk it would be wrong
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="shards a token mixer") as err:
        autotp.wrap(model, 1, sequence_parallel=True)
    assert "use sequence_parallel=False" in str(err.value)
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())
