"""The plan is data: built on the meta device with no process group, from shipped or user policies."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

import autotp
from autotp.planning.plan import Replicated
from autotp.testing import assert_parity, tiny_config
from autotp.testing.spawn import run_ranks
from models import CONFIGS, DERIVED, SoftmaxMLP, family_parity, focal_loss, tiny_model


def test_explain_on_meta_device_without_process_group() -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIGS["qwen3"]())
    plan = autotp.explain(model, 4)
    styles = {layer.path.rsplit(".", 1)[-1]: layer.style for layer in plan.layers}
    assert styles == {
        "q_proj": "column",
        "k_proj": "column",
        "v_proj": "column",
        "o_proj": "row",
        "gate_proj": "column",
        "up_proj": "column",
        "down_proj": "row",
        "lm_head": "column",
    }
    assert plan.vocab.embedding == "model.embed_tokens" and not plan.vocab.tied
    q = next(layer for layer in plan.layers if layer.path == "model.layers.0.self_attn.q_proj")
    assert [q.partition.local_size(r) for r in range(4)] == [32, 32, 32, 32]  # 8 heads x 16 over 4 ranks
    assert plan.head_norms == (
        "model.layers.0.self_attn.q_norm",
        "model.layers.0.self_attn.k_norm",
        "model.layers.1.self_attn.q_norm",
        "model.layers.1.self_attn.k_norm",
    )
    assert plan.replicated == ()
    ((path, why),) = autotp.explain(model, 4, vocab_parallel=False).replicated
    assert (path, why.reason, str(why)) == (
        "lm_head",
        Replicated.NOT_COVERED,
        "not covered by the plan; replicated, which is always correct",
    )
    text = plan.describe()
    assert "model.layers.1.mlp.down_proj" in text and "lm_head" in text


def test_uneven_mlp_width_is_split_on_row_boundaries() -> None:
    config = CONFIGS["llama"]()
    config.intermediate_size = 90
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    up = next(layer for layer in autotp.explain(model, 4).layers if layer.path.endswith("up_proj"))
    assert [up.partition.local_size(r) for r in range(4)] == [23, 23, 22, 22]


MLP_ONLY = {
    "model_types": ["llama"],
    "mlp": [{"match": "model.layers.*.mlp", "column": ["gate_proj", "up_proj"], "row": ["down_proj"]}],
}


def test_user_policy_dict_shards_only_what_it_names() -> None:
    for report in run_ranks(family_parity, 2, "llama", 3, MLP_ONLY):
        assert report["sharded"] == 2 * 3 + 2  # gate/up/down in 2 layers, and the vocab-split embedding and head
        assert_parity(report)


def test_policy_errors_name_the_problem() -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
    with pytest.raises(ValueError, match="unknown keys \\['layers'\\]"):
        autotp.explain(model, 2, policy={"layers": {}})
    with pytest.raises(ValueError, match="shards nothing in LlamaForCausalLM"):
        autotp.explain(model, 2, policy={"mlp": [{"match": "model.blocks.*.mlp", "column": ["a"], "row": ["b"]}]})


def bytes_after_wrap(rank: int, world: int, family: str) -> tuple[list[int], int]:
    model = tiny_model(family)
    predicted = autotp.explain(model, world).param_bytes(model)
    autotp.wrap(model, world)
    return predicted, sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("family", ["llama", "gpt2", "phi3", "mixtral", "falcon"])
def test_explain_bytes_equal_real_bytes_after_wrap(family: str) -> None:
    for rank, (predicted, real) in enumerate(run_ranks(bytes_after_wrap, 4, family)):
        assert predicted[rank] == real


def test_shipped_policies_load_and_claim_each_model_type_once() -> None:
    from autotp.planning.policy import builtin_policies

    policies = builtin_policies()
    assert len(policies) >= 14
    claimed = [t for p in policies for t in p.model_types]
    assert len(claimed) == len(set(claimed)), "a model type is claimed by two policies"


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", sorted(DERIVED))
def test_a_meta_model_gets_the_plan_wrap_makes_on_the_loaded_one(family: str, tp: int) -> None:
    """Derived plans are verified by running a structural twin when the model itself cannot run."""
    real = tiny_model(family)
    with torch.device("meta"):  # as `autotp plan` and from_pretrained build it; planned inside the context too
        meta = AutoModelForCausalLM.from_config(CONFIGS[family]())
        plan = autotp.explain(meta, tp)
    assert plan == autotp.explain(real, tp)
    assert plan.layers and not any("meta device" in str(why) for _, why in plan.replicated)


def test_a_custom_block_the_twin_cannot_show_stays_replicated_on_meta() -> None:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(CONFIGS["llama"]())
        model.model.layers[1].mlp = SoftmaxMLP(64, 96)
    model.config.model_type = "my_custom_lm"  # detection, so every block needs a verdict
    plan = autotp.explain(model, 2)
    why = str(dict(plan.replicated)["model.layers.1.mlp.down_proj"])
    assert "not in the structural twin" in why
    assert "model.layers.0.mlp.down_proj" in {layer.path for layer in plan.layers}


def test_the_twin_keeps_quarter_rotary_heads_in_whole_frequency_pairs() -> None:
    """NeoMME rotates a quarter of each full-attention head, interleaving row and column frequencies: a head
    narrowed to 8 dims would rotate 2, one pair that cannot split, and the twin's forward failed on meta."""
    from autotp.planning.twin import shrink_factor

    neomme, llama = tiny_config("neomme"), tiny_config("llama")
    assert neomme.head_dim == llama.head_dim == 16
    assert shrink_factor(neomme) == 1 and shrink_factor(llama) == 2
    with torch.device("meta"):
        planned = autotp.explain(AutoModelForMaskedLM.from_config(neomme), 2)
    assert planned == autotp.explain(AutoModelForMaskedLM.from_config(neomme), 2)  # the same on the real model


def test_derived_plans_are_verified_with_dropout_off_and_the_mode_restored() -> None:
    config = tiny_config("seed_oss")
    config.residual_dropout = 0.1
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    plan = autotp.explain(model, 2)
    assert plan.layers, plan.describe()
    assert all(m.training for m in model.modules())


def logged(rank: int, world: int) -> list[tuple[str, str]]:
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("autotp")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    model = tiny_model("olmo")
    model.loss_function = focal_loss  # a loss of the user's: vocab parallelism stays off
    autotp.wrap(model, world)
    return [(r.levelname, r.getMessage()) for r in records]


def test_wrap_logs_a_summary_and_warns_on_rank0_only() -> None:
    first, second = run_ranks(logged, 2)
    assert second == []
    assert first[0][0] == "INFO" and "tp_size=2" in first[0][1] and "sharded" in first[0][1]
    assert (
        "WARNING",
        "autotp: vocab parallelism is off: the model's loss_function is focal_loss, not transformers' causal-LM "
        "loss, so it gets whole logits",
    ) in first


def test_vocab_parallelism_off_is_a_warning_only_when_it_was_asked_for() -> None:
    """The plan knows whether vocab parallelism was asked for (`VOCAB_OFF`), so its warnings need no option passed."""
    off = "autotp: vocab parallelism is off"
    assert not any(w.startswith(off) for w in autotp.explain(tiny_model("llama"), 2, vocab_parallel=False).warnings())
    own = tiny_model("olmo")
    own.loss_function = focal_loss  # the user's loss: it gets whole logits
    assert any(w.startswith(off) for w in autotp.explain(own, 2).warnings())


HF_MLP_PLAN = {
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


@pytest.mark.parametrize(
    "hf_plan, origin",
    [
        ({"embed_tokens": "embedding_rowwise"}, autotp.Origin.DETECTED),  # transformers 5.24's plan for a dozen types
        (HF_MLP_PLAN, autotp.Origin.HF_PLAN_FILLED),
    ],
)
def test_blocks_transformers_plan_leaves_out_are_detected(hf_plan: dict, origin: autotp.Origin) -> None:
    """transformers' plan is taken where it speaks; the blocks it leaves out are detected (and verified) as for a model
    with no plan, so an embedding-only plan shards what detection alone shards."""
    plan = autotp.explain(tiny_model("olmo", base_model_tp_plan=hf_plan), 2, vocab_parallel=False)  # blocks only
    detected = autotp.explain(tiny_model("olmo", base_model_tp_plan={}), 2, vocab_parallel=False)
    assert plan.origin is origin and detected.origin is autotp.Origin.DETECTED
    block_layers = [(layer.path, layer.style) for layer in plan.layers if layer.block]
    assert block_layers == [(layer.path, layer.style) for layer in detected.layers if layer.block]
    assert len(block_layers) == 14, block_layers  # q, k, v, o, gate, up, down in both layers


def test_a_block_transformers_plan_keeps_replicated_is_not_detected() -> None:
    """A block HF's plan names in a style autotp does not shard (here attention gathered) keeps HF's decision."""
    hf_plan = {**HF_MLP_PLAN, "layers.*.self_attn.q_proj": "colwise_gather_output"}
    plan = autotp.explain(tiny_model("olmo", base_model_tp_plan=hf_plan), 2, vocab_parallel=False)  # blocks only
    assert plan.origin is autotp.Origin.HF_PLAN
    assert sorted({layer.path.rsplit(".", 1)[-1] for layer in plan.layers if layer.block}) == [
        "down_proj",
        "gate_proj",
        "up_proj",
    ]


def test_a_parameter_transformers_plan_splits_beside_the_projections_goes_with_the_heads() -> None:
    """Beam's plan names its attention's `gate_bias` (one entry per head, no linear) colwise with q/k/v and the gate:
    the attention is split by head, the bias with its heads, verified by emulation (it was all kept whole)."""
    plan = autotp.explain(tiny_model("beam"), 2)
    assert plan.origin is autotp.Origin.HF_PLAN
    assert [p.path for p in plan.params] == [f"model.layers.{i}.self_attn.gate_bias" for i in range(2)]
    names = {layer.path.rsplit(".", 1)[-1] for layer in plan.layers if ".self_attn." in layer.path}
    assert names == {"q_proj", "k_proj", "v_proj", "gate_proj", "o_proj"}


def test_trocr_splits_its_mlp_and_says_why_its_attention_stays_whole() -> None:
    """TrOCR's attention reshapes its output to its input's width, which a rank's heads do not fill: its policy
    splits the decoder layers' fc1/fc2 and keeps self- and cross-attention whole, with that reason in the plan."""
    plan = autotp.explain(tiny_model("trocr"), 2)
    assert [layer.path.rsplit(".", 1)[-1] for layer in plan.layers] == ["fc1", "fc2"] * 2
    reasons = {str(why) for path, why in plan.replicated if "_attn." in path}
    assert len(reasons) == 1 and "reshapes its output to its input's width" in reasons.pop()


@pytest.mark.parametrize("hf_plan", [{"embed_tokens": "embedding_rowwise"}, HF_MLP_PLAN])
def test_a_filled_plan_trains_like_one_process(hf_plan: dict) -> None:
    """Detected blocks beside an embedding-only or MLP-only HF plan: loss, every gradient and the parameters after 3
    AdamW steps equal one process at tp=2 (fp32 tolerances of autotp.testing.parity: reduction order only)."""
    for report in run_ranks(family_parity, 2, "olmo", 3, None, {"base_model_tp_plan": hf_plan}):
        assert report["sharded"] == 16, report  # 14 block linears, the LM head and embedding split by vocabulary
        assert_parity(report)


def test_explain_takes_wraps_options_and_refuses_what_wrap_refuses_in_planning() -> None:
    """`explain` checks a `wrap` call as is before a launch: sequence_parallel on MoE experts and cp_size on a
    sliding-window model are refused by name, as `wrap` refuses them; the options that only shape the wrapped layers
    change nothing in the plan."""
    with torch.device("meta"):
        mixtral = AutoModelForCausalLM.from_config(CONFIGS["mixtral"]())
        sliding = AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="sdpa")
    sliding.config.sliding_window = 8
    with pytest.raises(ValueError, match="sequence_parallel supports dense attention and MLP blocks"):
        autotp.explain(mixtral, 2, sequence_parallel=True)
    with pytest.raises(NotImplementedError, match="cp_size=2: sliding-window attention"):
        autotp.explain(sliding, 1, cp_size=2)
    plan = autotp.explain(mixtral, 2)
    assert autotp.explain(mixtral, 2, check_inputs=True, timeout=5, overlap=False, recompute_glu=False) == plan
