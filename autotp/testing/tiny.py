"""Tiny configs from any model type's defaults: small dimensions, dropout off, token ids inside the vocabulary."""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

from ..planning.probe import IMAGE_TOKEN_KEYS
from ..planning.twin import ssm_heads

SHRINK = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 128,
    "head_dim": 16,
    "global_head_dim": 32,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "ffn_dim": 128,
    "d_ff": 128,
    "n_inner": 128,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "d_model": 64,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_source_positions": 16,
    "num_mel_bins": 16,
    "decoder_vocab_size": 512,
}
RECIPES = {  # tried in order until a model builds
    "shrunk": SHRINK,
    "shrunk, own head_dim": {k: v for k, v in SHRINK.items() if k != "head_dim"},
    "defaults, 2 layers": {"num_hidden_layers": 2, "vocab_size": 512},
}


# Vision towers (in a `vision_config`): small images, and outputs as wide as the tiny text model.
VISION = {
    "image_size": 32,
    "patch_size": 8,
    "depth": 2,
    "embed_dim": 64,
    "num_heads": 4,
    "projection_dim": 64,
    "out_hidden_size": 64,
    "vision_output_dim": 64,
}
# A composite model's own fields: as many image tokens as the tiny tower makes (4x4 patches, pooled to 4).
COMPOSITE = {"mm_tokens_per_image": 4, "image_seq_length": 16, "projection_dim": 64}


def tiny_config(model_type: str, recipe: str = "shrunk") -> PretrainedConfig:
    """`model_type`'s default config with the sizes in `RECIPES[recipe]` and no dropout.

    Sub-configs (a vision-language model's `text_config` and `vision_config`) are shrunk the same
    way; the image token then lies inside the tiny vocabulary.
    """
    config = AutoConfig.for_model(model_type)
    _shrink(config, {**RECIPES[recipe], **COMPOSITE})
    for name, sub in vars(config).items():
        if isinstance(sub, PretrainedConfig):
            _shrink(sub, {**RECIPES[recipe], **(VISION if "vision" in name else {})})
            _rope_sections(sub, default="vl" in model_type)
            _valid(sub)
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = 0  # T5 starts decoding from the pad token
    text = getattr(config, "text_config", None)
    vocab = getattr(text, "vocab_size", None)
    if isinstance(text, PretrainedConfig) and isinstance(vocab, int):
        for key in IMAGE_TOKEN_KEYS:
            if isinstance(getattr(config, key, None), int):
                setattr(config, key, vocab - 1)
    return config


def _shrink(config: PretrainedConfig, sizes: dict) -> None:
    """Integer fields from `sizes`, token ids inside the vocabulary, dropout off, no cache."""
    kept, heterogeneous = {}, getattr(config, "is_heterogeneous", False)
    before, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if isinstance(getattr(config, "num_experts_per_tok", None), int):  # never more than the model allows (ZAYA: 1)
        sizes = {**sizes, "num_experts_per_tok": min(config.num_experts_per_tok, sizes.get("num_experts_per_tok", 99))}
    if heterogeneous:  # per-layer overrides (Gemma4): those of the first layers and of the last, which
        # transformers makes full attention whatever layer_types says, so the config round-trips through a save
        layers, last = sizes.get("num_hidden_layers", config.num_hidden_layers), config.num_hidden_layers - 1
        for i, override in (config.to_dict().get("per_layer_config") or {}).items():
            if int(i) < layers - 1 or int(i) == last:
                kept[min(int(i), layers - 1)] = {k: sizes.get(k, v) for k, v in override.items()}
        config.per_layer_config = None  # so that the global fields below can be set; restored after them
    for key, value in sizes.items():
        try:
            if isinstance(getattr(config, key, None), int):
                setattr(config, key, value)
        except Exception:  # a derived, read-only property
            pass
    if kept:
        config.per_layer_config = kept
    config.use_cache = False  # training; hybrid models' caches refuse some calls
    vocab = getattr(config, "vocab_size", None)
    for key, value in list(vars(config).items()):  # Inkling2's unpadded_vocab_size: the head's rows, at most vocab
        if key.endswith("vocab_size") and isinstance(vocab, int) and isinstance(value, int) and value > vocab:
            setattr(config, key, vocab)
    for key, token in (("pad_token_id", 0), ("bos_token_id", 1), ("eos_token_id", 2), ("decoder_start_token_id", 0)):
        value = getattr(config, key, None)
        if isinstance(vocab, int) and isinstance(value, int) and value >= vocab:
            setattr(config, key, token)
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and (
            "dropout" in key or "pdrop" in key or "jitter" in key or "drop_path" in key or key.endswith("layerdrop")
        ):
            setattr(config, key, 0.0)
    _cut_per_layer(config, before, heterogeneous)
    _derived_widths(config, hidden)
    _ssm_heads(config)
    if isinstance(getattr(config, "attention_types", None), list):  # GPT-Neo: [[kinds, repeats]] makes the list
        kinds = config.attention_types[0][0]
        config.attention_types = [[kinds, max(1, config.num_layers // len(kinds))]]
    if all(isinstance(getattr(config, k, None), int) for k in ("d_head", "d_model", "n_head")):
        config.d_head = config.d_model // config.n_head  # XLNet checks it


def _derived_widths(config: PretrainedConfig, hidden: int | None) -> None:
    """Widths the config computed from the default hidden size at init (Zamba's and Zamba2's attention over hidden |
    embeddings: `attention_hidden_size` = 2 x hidden), scaled with it as the model requires."""
    value, now = getattr(config, "attention_hidden_size", None), getattr(config, "hidden_size", None)
    if isinstance(value, int) and isinstance(hidden, int) and isinstance(now, int) and hidden != now:
        config.attention_hidden_size = value * now // hidden


def _ssm_heads(config: PretrainedConfig) -> None:
    """A Mamba-2 mixer's heads that fill its shrunk width (expand x hidden, Falcon-H1's `mamba_d_ssm` shrunk to it),
    as the model requires; a head wider than half of it (Zamba2's 640) narrowed to 16."""
    if isinstance(getattr(config, "mamba_d_ssm", None), int):
        config.mamba_d_ssm = None  # the expansion of the shrunk hidden size
    for heads, width, channels in ssm_heads(config):
        if 2 * getattr(config, width) > channels or channels % getattr(config, width):
            setattr(config, width, 16)
        setattr(config, heads, channels // getattr(config, width))


def _cut_per_layer(config: PretrainedConfig, before: int | None, heterogeneous: bool) -> None:
    """Per-layer lists cut to the layers kept: `*layer_types` keep the first layers (per-layer configs: the first
    and the last, see `_shrink`), or, if the config then refuses them, one layer of every kind; other lists as long
    as the old layer count (Laguna's heads per layer) keep the first."""
    layers = getattr(config, "num_hidden_layers", None)
    if not isinstance(layers, int):
        return
    kinds_kept = {}
    for key, value in list(vars(config).items()):
        if not isinstance(value, list):
            continue
        if key.endswith("layer_types"):
            cut = value[: layers - 1] + value[-1:] if heterogeneous else value[:layers]
            setattr(config, key, cut)
            lost = [kind for kind in dict.fromkeys(value) if kind not in cut]
            if lost:
                kinds_kept[key] = cut[: max(layers - len(lost), 0)] + lost[:layers]
        elif len(value) == before != layers:
            setattr(config, key, value[:layers])
    for key, value in kinds_kept.items():  # OLMo-Hybrid refuses first layers without an attention layer among them
        if "layer" in _invalid(config):
            setattr(config, key, value)


def _invalid(config: PretrainedConfig) -> str:
    """Why the config's own checks refuse it (transformers runs them when it saves and loads), or ""."""
    try:
        config.validate()
    except Exception as err:
        return str(err)
    return ""


def _valid(config: PretrainedConfig) -> None:
    """Undo a shrink that the config's own checks refuse; other refusals show when transformers loads the save."""
    if "num_key_value_heads" in _invalid(config):
        config.num_key_value_heads = config.num_attention_heads  # GLM-5-Next's text model: no grouped queries


def _rope_sections(config: PretrainedConfig, default: bool) -> None:
    """Multimodal RoPE splits head_dim / 2 into sections (Qwen-VL's mrope_section, by `default` 16/24/24): fit the
    tiny head."""
    head_dim = getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // max(getattr(config, "num_attention_heads", 1) or 1, 1)
    )
    for rope in (getattr(config, "rope_parameters", None), getattr(config, "rope_scaling", None)):
        if isinstance(rope, dict) and default:
            rope.setdefault("mrope_section", [16, 24, 24])
        sections = rope.get("mrope_section") if isinstance(rope, dict) else None
        if isinstance(rope, dict) and sections and sum(sections) != head_dim // 2:  # sections: rope is a dict
            half = head_dim // 2
            scaled = [max(1, s * half // sum(sections)) for s in sections]
            scaled[0] += half - sum(scaled)
            rope["mrope_section"] = scaled
