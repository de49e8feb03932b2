"""Every place autotp reads Hugging Face transformers beyond its documented model API, in one module.

Checked against transformers 5.19 to 5.23 (CI runs the whole suite on 5.23 and a parity subset on
5.19, the minimum that pyproject.toml names; 4.x lacks both internals below). A transformers upgrade that moves one of these breaks here, with a
message that names the missing piece, rather than somewhere inside a training step.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D


def _internal(module: str, name: str) -> Callable[..., Any]:
    """`module.name` from transformers, or an error saying which transformers internal autotp lost."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        import transformers

        raise RuntimeError(
            f"autotp needs {module}.{name}, which transformers {transformers.__version__} lacks ({err}); "
            f"install a transformers version that autotp supports (see the README)"
        ) from None


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a linear whose weight is stored [in, out]."""
    return isinstance(module, Conv1D)


def adapter_module(model: nn.Module) -> tuple[str, str] | None:
    """The first module (path, class) that a parameter-efficient tuning library (PEFT) put into `model`."""
    for path, module in model.named_modules():
        if type(module).__module__.split(".")[0] == "peft":
            return path or "the model itself", f"{type(module).__module__}.{type(module).__qualname__}"
    return None


def is_causal_lm(model: nn.Module) -> bool:
    """Whether transformers classifies the model's loss as causal-LM cross-entropy (`PreTrainedModel.loss_type`).

    "ForConditionalGeneration" maps to the same loss in transformers. Only vision-language models
    (a `vision_config`, no encoder-decoder) are counted: their forward calls `self.loss_function`
    (the image-text sweep runs every one), while others of that name (Qwen2-Audio) still compute
    cross-entropy inline, which vocab-sharded logits would break.
    """
    loss_type = getattr(model, "loss_type", None)
    config = model.config
    return loss_type == "ForCausalLM" or (loss_type == "ForConditionalGeneration" and not getattr(
        config, "is_encoder_decoder", False) and getattr(config, "vision_config", None) is not None)


def keys_to_ignore_on_save(model: nn.Module) -> set[str]:
    """State-dict keys transformers leaves out of a saved checkpoint."""
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())


def remove_tied_weights(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without the tied aliases transformers leaves out of a checkpoint."""
    return _internal("transformers.modeling_utils", "remove_tied_weights_from_state_dict")(state_dict, model)


def checkpoint_names(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict under the key names transformers writes to disk (it may rename on save)."""
    return _internal("transformers.core_model_loading", "revert_weight_conversion")(model, state_dict)


@dataclass(frozen=True)
class ExpertSource:
    """A fused expert tensor that transformers builds while loading: each expert's checkpoint tensor stacked
    over the experts (dim 0) and, with several source patterns (gate, up), concatenated along dim 1.

    `parts[j][e]` is the checkpoint key of expert `e` for pattern `j`. `problem`, if set, says why this
    conversion cannot be read by slices (an operation other than stacking and concatenation).
    """

    parts: tuple[tuple[str, ...], ...]
    problem: str = ""


def checkpoint_sources(model: nn.Module, keys: Iterable[str]) -> dict[str, str | ExpertSource]:
    """Model tensor name -> where transformers' own loading takes it from the checkpoint `keys`.

    A key stored under another name (a renamed module) maps to that key; MoE experts saved one per
    expert (the hub's layout, which transformers also writes) map to an `ExpertSource`. A transformers
    without this machinery (before 5.19) converts nothing, so every name maps to itself.
    """
    try:
        transforms = _internal("transformers.conversion_mapping", "get_model_conversion_mapping")(model)
        rename = _internal("transformers.core_model_loading", "rename_source_key")
        natural = _internal("transformers.core_model_loading", "dot_natural_key")
    except RuntimeError:
        return {key: key for key in keys}
    renamings = [t for t in transforms if type(t).__name__ == "WeightRenaming"]
    converters = [t for t in transforms if type(t).__name__ != "WeightRenaming"]
    names = {name: True for name, _ in model.named_parameters(remove_duplicate=False)}
    names.update({name: True for name, _ in model.named_buffers(remove_duplicate=False)})
    out: dict[str, str | ExpertSource] = {}
    fused: dict[str, dict[str, list[str]]] = {}
    for key in sorted(keys, key=natural):
        target, pattern = rename(key, renamings, converters, getattr(model, "base_model_prefix", None), names)
        if pattern is None:
            out.setdefault(target, key)
        else:
            fused.setdefault(target, {}).setdefault(pattern, []).append(key)
    for target, by_pattern in fused.items():
        converter = next(c for c in converters if set(by_pattern) <= set(c.source_patterns))
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", ())]
        parts = tuple(tuple(by_pattern.get(p, ())) for p in converter.source_patterns)
        stacked = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(parts) > 1 else [])
        problem = "" if ops == stacked else f"transformers converts it with {ops}, which autotp cannot read by slices"
        out[target] = ExpertSource(parts, problem)
        first = converter.target_patterns[0]
        for other in converter.target_patterns[1:]:  # a split: one checkpoint tensor becomes several
            out.setdefault(target.replace(first, other), ExpertSource(parts, problem or "split from one tensor"))
    return out
