"""Tiny configs from any model type's defaults: small dimensions, dropout off, token ids inside the vocabulary."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

SHRINK = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128, "head_dim": 16,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "ffn_dim": 128, "d_ff": 128, "n_inner": 128,
    "encoder_layers": 2, "decoder_layers": 2, "d_model": 64, "encoder_attention_heads": 4,
    "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
}
RECIPES = {  # tried in order until a model builds
    "shrunk": SHRINK,
    "shrunk, own head_dim": {k: v for k, v in SHRINK.items() if k != "head_dim"},
    "defaults, 2 layers": {"num_hidden_layers": 2, "vocab_size": 512},
}


def tiny_config(model_type: str, recipe: str = "shrunk") -> PretrainedConfig:
    """`model_type`'s default config with the sizes in `RECIPES[recipe]` and no dropout."""
    config = AutoConfig.for_model(model_type)
    for key, value in RECIPES[recipe].items():
        if hasattr(config, key) and isinstance(getattr(config, key), int):
            try:
                setattr(config, key, value)
            except AttributeError:  # a derived, read-only property
                pass
    config.use_cache = False  # training; hybrid models' caches refuse some calls
    vocab = getattr(config, "vocab_size", None)
    for key, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2), ("decoder_start_token_id", 0)):
        value = getattr(config, key, None)
        if isinstance(vocab, int) and isinstance(value, int) and value >= vocab:
            setattr(config, key, token)
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or "jitter" in key or key == "layerdrop"):
            setattr(config, key, 0.0)
        if key == "layer_types" and isinstance(value, list):
            setattr(config, key, value[: config.num_hidden_layers])
    return config
