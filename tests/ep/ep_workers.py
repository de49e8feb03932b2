"""The expert-parallel parity harness (a helper module beside tests/ep's tests): MoE models of every family, one
process's run on the whole batch, and the README's DP loop at tp x ep on each rank.

Tolerances (fp32) as in test_parity: EP moves whole tokens and runs whole experts, so only the order of sums changes
(the experts' matmuls on other row counts, the slot sums in another association). Loss 1e-5 absolute; gradients
after the sync 1e-5 of the tensor's largest reference entry (floored at 1e-3, `grad_error`); parameters after 3
AdamW steps 3e-5 absolute. Routing ties: the inputs do not avoid them by construction; `check` compares every MoE
layer's top-k indices with one process's on every step instead, so a flipped near-tie fails by name.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import transformers as tf
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig

import autotp
from autotp.testing import tiny_config
from autotp.testing.parity import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL, full_tensor, grad_error
from models import batch

GLOBAL = batch(size=(4, 16))
STEPS = 3
CLIP = 0.5

HAND_WRITTEN = {  # families whose tiny builder fails on transformers 5.24 (MLA head sizes, unset expert counts, ...)
    "deepseek_v3": lambda: tf.DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=64,
        use_cache=False,
    ),
    "hunyuan_v1_moe": lambda: tf.HunYuanMoEV1Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        moe_topk=2,
        max_position_embeddings=64,
        use_cache=False,
    ),
    "dbrx": lambda: tf.DbrxConfig(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=64,
        vocab_size=256,
        use_cache=False,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    # MLA (as DeepSeek-V3), routed by group-limited greedy top-k; defaults leave num_experts_per_tok unset
    "deepseek_v2": lambda: tf.DeepseekV2Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
        use_cache=False,
    ),
    # MLA, a dense shortcut beside the experts in every layer (2 sub-layers each), and zero-computation experts
    # (half as many as the routed ones, as LongCat-Flash's 256 beside 512) that the router picks among them
    "longcat_flash": lambda: tf.LongcatFlashConfig(
        vocab_size=256,
        hidden_size=64,
        ffn_hidden_size=128,
        expert_ffn_hidden_size=32,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
        use_cache=False,
    ),
    # MLA with DeepSeek sparse attention's indexer; its defaults make the first 3 layers dense
    "glm_moe_dsa": lambda: tf.GlmMoeDsaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=4,
        max_position_embeddings=64,
        use_cache=False,
    ),
    # MLA; the tiny builder's head sizes do not fit its rope
    "glm4_moe_lite": lambda: tf.Glm4MoeLiteConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        mlp_layer_types=["dense", "sparse"],
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        max_position_embeddings=64,
        use_cache=False,
    ),
    # MLA with the sparse-attention indexer; its defaults make the first 3 layers dense (no experts in the tiny model)
    # and split the 4 experts into 8 groups
    "deepseek_v32": lambda: tf.DeepseekV32Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=4,
        max_position_embeddings=64,
        use_cache=False,
    ),
    # defaults leave the expert counts unset
    "dots1": lambda: tf.Dots1Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
    ),
    # short convolutions and attention; defaults leave layer_types unset and the first 2 layers dense
    "lfm2_moe": lambda: tf.Lfm2MoeConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_dense_layers=1,
        layer_types=["conv", "full_attention", "conv"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        use_cache=False,
    ),
    # Mamba-2 and attention layers; the tiny builder keeps 128 Mamba heads of 64 on a 64-wide model
    "granitemoehybrid": lambda: tf.GraniteMoeHybridConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=64,
        num_hidden_layers=2,
        layer_types=["linear_attention", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        max_position_embeddings=64,
        use_cache=False,
    ),
    # Kimi delta attention and MLA layers: the tiny builder keeps 32 linear heads of 128 (a minute a test, on the
    # reference kernel) and no MLA layer
    "kimi_linear": lambda: tf.KimiLinearConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse"],
        num_attention_heads=4,
        num_key_value_heads=4,
        num_local_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        linear_num_heads=4,
        linear_head_dim=16,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    ),
}


def _ernie_vl() -> PretrainedConfig:
    """Ernie 4.5 VL's modality experts (text_moe and vision_moe per MoE layer); the tiny builder's M-RoPE sections
    do not fit its head size, and its expert widths stay at 1536 and 512."""
    config = tiny_config("ernie4_5_vl_moe")
    config.text_config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
    config.text_config.moe_intermediate_size = [32, 16]
    return config


HAND_WRITTEN["ernie4_5_vl_moe"] = _ernie_vl
IMAGE_TEXT = {"ernie4_5_vl_moe"}  # built with AutoModelForImageTextToText, not as a causal LM


def moe_config(family: str, **overrides) -> PretrainedConfig:
    config = HAND_WRITTEN[family]() if family in HAND_WRITTEN else tiny_config(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def moe_model(family: str, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    auto = AutoModelForImageTextToText if family in IMAGE_TEXT else AutoModelForCausalLM
    return auto.from_config(moe_config(family, **overrides), dtype=torch.float32)


def record_routing(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every experts call's top-k indices, in call order (the model's own router picks them)."""
    seen: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith(".experts") and hasattr(module, "_is_expert_parallel"):
            module.register_forward_pre_hook(lambda m, args: seen.append(args[1].detach().clone()))
    return seen


def single_process(family: str, clip: bool = False, config: dict | None = None, inputs: dict | None = None) -> dict:
    """One process's STEPS on the whole batch; `inputs`: more per-row inputs of the whole batch, beside the ids."""
    model = moe_model(family, **(config or {}))
    routing = record_routing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, grads, norms = [], {}, []
    for step in range(STEPS):
        loss = model(input_ids=GLOBAL, labels=GLOBAL, **(inputs or {})).loss
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    return {
        "losses": losses,
        "grads": grads,
        "routing": routing,
        "expert_bytes": experts,
        "norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def whole(tensor: torch.Tensor, param: torch.nn.Parameter, model: torch.nn.Module) -> torch.Tensor:
    """The full tensor behind this rank's part: experts all-gathered over EP (FSDP's rows first), TP shards over TP."""
    if hasattr(param, "autotp_expert"):
        tensor = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        parts = [torch.empty_like(tensor) for _ in range(autotp.ep_size(model))]
        dist.all_gather(parts, tensor.detach().contiguous(), group=autotp.ep_group(model))
        return torch.cat(parts)
    return full_tensor(tensor, param, autotp.tp_group(model))


def wrong_sync(model: torch.nn.Module, mode: str) -> None:
    """The controls: expert gradients averaged over DP like dense ones, summed but never divided, summed over the
    whole world instead of expert-DP (`world`: other experts' gradients mixed in), or never summed over expert-DP
    (`no_expert_dp`: the other EP groups' tokens left out, the same as the right sync where expert-DP is 1 rank)."""
    if mode == "dp_average":
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=autotp.dp_group(model))
                p.grad /= autotp.dp_size(model)
        return
    mine = {
        p: torch.zeros_like(p) if p.grad is None else p.grad.clone()  # before the sync: this EP group's tokens
        for p in model.parameters()
        if hasattr(p, "autotp_expert")
    }
    autotp.allreduce_gradients(model)
    for p, grad in mine.items():
        if mode == "world":
            dist.all_reduce(grad)  # every rank's experts, whichever they are
        p.grad = p.grad * autotp.dp_size(model) if mode == "no_division" else grad / autotp.dp_size(model)


def dp_loop(model: torch.nn.Module, sync, clip: bool = False, inputs: dict | None = None) -> dict:
    """The README's DP loop on this replica's rows of the global batch (and of `inputs`, more per-row inputs):
    STEPS AdamW steps, the gradients synced by `sync()` (then clipped: `clip`); the losses (mean over replicas), the
    first step's gradients and the last parameters (whole), the clipped norms and this replica's rows."""
    replicas = autotp.dp_size(model)
    rows = GLOBAL.shape[0] // replicas
    first = autotp.dp_rank(model) * rows
    mine = GLOBAL[first : first + rows]
    extra = {name: tensor[first : first + rows] for name, tensor in (inputs or {}).items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, grads, norms = [], {}, []
    for step in range(STEPS):
        loss = model(input_ids=mine, labels=mine, **extra).loss
        loss.backward()
        sync()
        if clip:
            norms.append(autotp.clip_grad_norm_(model, CLIP).item())
        if step == 0:
            grads = {n: whole(p.grad, p, model) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=autotp.dp_group(model))
        losses.append(mean.item() / replicas)
    return {
        "losses": losses,
        "grads": grads,
        "norms": norms,
        "rows": (first, rows),
        "params": {n: whole(p, p, model) for n, p in model.named_parameters()},
    }


def ep_rank_run(
    rank: int,
    world: int,
    family: str,
    tp: int,
    ep: int,
    mode: str = "right",
    config: dict | None = None,
    inputs: dict | None = None,
) -> dict:
    """The README's DP loop at tp x ep: this replica's rows of the global batch, gradients synced, AdamW."""
    model = autotp.wrap(moe_model(family, **(config or {})), tp, ep_size=ep)
    assert autotp.ep_size(model) == ep and autotp.ep_rank(model) == rank % ep
    routing = record_routing(model)
    sync = (
        (lambda: autotp.allreduce_gradients(model)) if mode in ("right", "clip") else (lambda: wrong_sync(model, mode))
    )
    report = dp_loop(model, sync, clip=mode == "clip", inputs=inputs)
    experts = sum(p.numel() * p.element_size() for p in model.parameters() if hasattr(p, "autotp_expert"))
    return {**report, "routing": routing, "expert_bytes": experts}


def check(report: dict, expected: dict) -> None:
    """Parity with one process, the routing included; raises AssertionError naming the worst tensor."""
    first, rows = report["rows"]
    seq = GLOBAL.shape[1]
    assert len(report["routing"]) == len(expected["routing"]), "not every experts call was seen"
    for ours, theirs in zip(report["routing"], expected["routing"]):
        assert torch.equal(ours, theirs[first * seq : (first + rows) * seq]), "top-k differs from one process's"
    check_training(report, expected)


def check_training(report: dict, expected: dict) -> None:
    """The losses, the first step's gradients and the parameters after the steps against one process's."""
    loss = max(abs(a - b) for a, b in zip(report["losses"], expected["losses"]))
    assert loss <= LOSS_ATOL, f"loss differs by {loss:.3g}"
    worst = max((grad_error(report["grads"][n], g), n) for n, g in expected["grads"].items())
    assert worst[0] <= GRAD_RTOL, f"gradient of {worst[1]} differs by {worst[0]:.3g}"
    worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
    assert worst[0] <= PARAM_ATOL, f"{worst[1]} differs by {worst[0]:.3g} after AdamW steps"
