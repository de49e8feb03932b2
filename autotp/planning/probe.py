"""Sample inputs that reach every block of a model: token ids, and for a vision-language model an image too.

Verification records each block's inputs from one forward, so a vision tower is checked only if the
probe carries an image. The image layout is found by asking the model's own `get_image_features`
(the first candidate layout it accepts), and the text gets as many image tokens as it returns
features, so the same inputs serve the parity tests.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

_SPECIAL_IDS = 3  # pad, bos, eos in the tiny configs: kept out of random text
IMAGE_TOKEN_KEYS = ("image_token_id", "image_token_index")  # the config field, by family


def probe_inputs(model: nn.Module, batch: int = 1, seq: int = 8, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs for one forward: `input_ids` (speech: `input_features`), an encoder-decoder's `decoder_input_ids`,
    and a vision-language model's pixel inputs with as many image tokens as its tower makes."""
    config = model.config
    text = getattr(config, "text_config", None) or config
    vocab = getattr(text, "vocab_size", None) or 8
    generator = torch.Generator().manual_seed(seed)
    token = image_token(config)
    image = _image_inputs(model, batch, generator) if token is not None else None
    high = min(vocab, 1000)
    low = _SPECIAL_IDS if high > _SPECIAL_IDS + 1 else 0
    ids = torch.randint(low, high, (batch, seq), generator=generator)
    inputs: dict[str, Any] = {}
    if image is not None:
        pixels, count = image
        ids[ids == token] = low
        ids = torch.cat([torch.full((batch, count), token), ids], dim=1)
        inputs.update(pixels)
        accepted = _parameters(model.forward)
        for key in ("token_type_ids", "mm_token_type_ids"):  # Gemma3 / PaliGemma masks, Qwen-VL's M-RoPE
            if key in accepted:
                inputs[key] = (ids == token).long()
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in _parameters(model.forward):
        # the decoder and its cross-attention run too (BartForCausalLM, a decoder alone, takes none)
        inputs["decoder_input_ids"] = torch.randint(low, high, (batch, seq), generator=generator)
    if getattr(model, "main_input_name", "input_ids") == "input_features":  # speech encoders: mel frames
        frames = 2 * getattr(config, "max_source_positions", seq)  # Whisper's encoder takes exactly this many
        inputs["input_features"] = torch.randn(batch, config.num_mel_bins, frames, generator=generator)
    else:
        inputs["input_ids"] = ids
    device = next(model.parameters()).device
    return {k: v.to(device) for k, v in inputs.items()}


def image_token(config) -> int | None:
    """The id a vision-language config reserves for image positions, or None for a text-only model."""
    if getattr(config, "vision_config", None) is None:
        return None
    for key in IMAGE_TOKEN_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def _parameters(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _image_inputs(model: nn.Module, batch: int, generator: torch.Generator) -> tuple[dict, int] | None:
    """Pixel inputs in the first layout the model's `get_image_features` accepts, and image tokens per sample."""
    features = getattr(model, "get_image_features", None) or getattr(
        getattr(model, "model", None), "get_image_features", None
    )
    vision = model.config.vision_config
    if features is None:
        return None
    for candidate in _layouts(vision, batch, generator):
        try:
            with torch.no_grad():
                out = features(**candidate)
        except Exception:  # not this model's layout: try the next
            continue
        rows = _feature_rows(getattr(out, "pooler_output", None) if not torch.is_tensor(out) else out)
        if rows and rows % batch == 0:
            return candidate, rows // batch
    return None


def _layouts(vision, batch: int, generator: torch.Generator) -> list[dict[str, torch.Tensor]]:
    channels = getattr(vision, "num_channels", None) or getattr(vision, "in_channels", None) or 3
    if isinstance(getattr(vision, "temporal_patch_size", None), int):  # Qwen-VL: flattened patches and a grid
        t, h, w, patch = 1, 4, 4, vision.patch_size
        pixels = torch.randn(
            batch * t * h * w, channels * vision.temporal_patch_size * patch * patch, generator=generator
        )
        return [{"pixel_values": pixels, "image_grid_thw": torch.tensor([[t, h, w]] * batch)}]
    size = getattr(vision, "image_size", None)
    size = size[0] if isinstance(size, (list, tuple)) else size
    if not isinstance(size, int):
        return []
    image = torch.randn(batch, channels, size, size, generator=generator)
    sizes = torch.tensor([[size, size]] * batch)
    return [
        {"pixel_values": image},
        {"pixel_values": image, "image_sizes": sizes},
        {"pixel_values": image.unsqueeze(1)},
    ]


def _feature_rows(out) -> int:
    """How many embedding rows (image tokens) a `get_image_features` result holds, over the batch."""
    if torch.is_tensor(out):
        return out.numel() // out.shape[-1] if out.dim() >= 2 else 0
    if isinstance(out, (list, tuple)) and out and all(torch.is_tensor(t) for t in out):
        return sum(_feature_rows(t) for t in out)
    return 0
