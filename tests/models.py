"""Tiny configs of the supported families: heads and kv heads divide 1, 2 and 4; hidden <= 128."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM, GemmaConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config,
)

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
              num_key_value_heads=4, vocab_size=256, max_position_embeddings=64)

CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**COMMON),  # q/k/v biases
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16),  # per-head q_norm / k_norm, head_dim != hidden/heads
    "gemma": lambda: GemmaConfig(**COMMON, head_dim=16),  # tied embeddings
}
FAMILIES = sorted(CONFIGS)


def tiny_model(family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised tiny model of `family`, the same on every rank for the same seed."""
    config = CONFIGS[family]()
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def batch(vocab: int = 256, size: tuple[int, int] = (2, 16), seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, size, generator=generator)
