"""A meta-device MoE too large for a narrowed twin is verified on a twin with fewer routed experts."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import autotp
from autotp.planning.plan import Replicated
from autotp.planning.probe import probe_inputs
from autotp.planning.twin import _MAX_TWIN_PARAMS, fewer_experts, structural_twin, twin_config

# Qwen3-235B-A22B's config.json (the fields that shape the model): 128 experts x 94 layers, 917M parameters even
# when narrowed 16 times, over the twin's cap.
QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "moe_intermediate_size": 1536,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(scope="module")
def qwen3_235b() -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(**QWEN3_235B))


@pytest.mark.slow  # the 235B config on meta (about 3 s); its EP check stays quick
@pytest.mark.timeout(240)
def test_a_235b_moe_on_meta_shards_every_attention_projection(qwen3_235b: torch.nn.Module) -> None:
    """Before, no twin was built (too many experts) and all 376 attention projections stayed replicated."""
    with torch.device("meta"):
        narrowed = AutoModelForCausalLM.from_config(twin_config(qwen3_235b.config))
    assert sum(p.numel() for p in narrowed.parameters()) > _MAX_TWIN_PARAMS
    twin = structural_twin(qwen3_235b)
    assert twin.config.num_experts == 8 and twin.config.num_experts_per_tok == 8  # top-8 needs 8
    assert twin.config.num_hidden_layers == 94 and twin.config.num_attention_heads == 64
    assert sum(p.numel() for p in twin.parameters()) < _MAX_TWIN_PARAMS

    plan = autotp.explain(qwen3_235b, 8)
    projections = {
        f"model.layers.{i}.self_attn.{name}" for i in range(94) for name in ("q_proj", "k_proj", "v_proj", "o_proj")
    }
    assert projections <= {layer.path for layer in plan.layers}
    assert len(plan.regions) == 94 and plan.regions[0].partitions[0][1] == (128, 3072, 4096)  # the model's experts
    assert not [path for path, why in plan.replicated if why.reason == Replicated.NOT_VERIFIED]
    assert not plan.replicated  # the vocabulary too: no shipped qwen3_moe policy, its logits' path checked on the twin
    assert plan.vocab is not None, plan.vocab_reason


@pytest.mark.timeout(240)
@pytest.mark.parametrize("ep", [8, 16])
def test_expert_parallelism_checks_the_model_not_its_twin(qwen3_235b: torch.nn.Module, ep: int) -> None:
    """The twin holds 8 experts, which 16 does not divide: EP's checks read the model's 128, so ep 8 and 16 plan as
    at ep 1, and an ep_size the model's count refuses names 128."""
    plan = autotp.explain(qwen3_235b, 8)
    assert autotp.explain(qwen3_235b, 8, ep_size=ep) == plan
    with pytest.raises(ValueError, match="ep_size=256 does not divide the 128 experts"):
        autotp.explain(qwen3_235b, 8, ep_size=256)


@pytest.mark.timeout(60)
def test_grouped_routing_keeps_whole_groups_that_hold_the_top_k() -> None:
    """DeepSeek-V3 scores 8 groups by their top two experts, takes 4 of them, then the top 8 experts in those: 16
    experts (2 a group) is the fewest that still runs; the cut twin's forward runs."""
    config = AutoConfig.for_model(
        "deepseek_v3",
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        vocab_size=512,
        n_routed_experts=256,
        n_group=8,
        topk_group=4,
        num_experts_per_tok=8,
    )
    cut = fewer_experts(config)
    assert (cut.n_routed_experts, cut.n_group, cut.topk_group, cut.num_experts_per_tok) == (16, 8, 4, 8)
    assert config.n_routed_experts == 256  # the model's own config is left alone
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cut).eval()
    with torch.no_grad():
        assert torch.isfinite(model(**probe_inputs(model)).logits).all()


@pytest.mark.timeout(60)
def test_expert_fields_are_cut_by_each_familys_names_and_in_sub_configs() -> None:
    mixtral = fewer_experts(AutoConfig.for_model("mixtral", num_local_experts=8, num_experts_per_tok=2))
    ernie = fewer_experts(AutoConfig.for_model("ernie4_5_moe", moe_num_experts=64, moe_k=6))
    vl = fewer_experts(AutoConfig.for_model("qwen3_vl_moe", text_config={"num_experts": 60, "num_experts_per_tok": 4}))
    assert (mixtral.num_local_experts, ernie.moe_num_experts, vl.text_config.num_experts) == (2, 6, 4)
    # no experts-per-token field: the routing is unknown, so nothing is cut
    assert fewer_experts(AutoConfig.for_model("deepseek_v2", n_routed_experts=64, num_experts_per_tok=None)) is None
    assert fewer_experts(AutoConfig.for_model("llama")) is None
