"""Every place autotp reads Hugging Face transformers beyond its documented model API, in one module.

Checked against transformers 5.19 to 5.24. CI runs three legs (`.ci/run`): the whole suite on the versions pinned in
constraints.txt (5.24), a parity subset on 5.19 (the minimum that pyproject.toml names; 4.x lacks both internals below),
and the fast tier on the newest releases. A transformers upgrade that moves one of these breaks here, with a message
that names the missing piece, rather than somewhere inside a training step.
"""

from __future__ import annotations

import copy
import importlib
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.pytorch_utils import Conv1D

from .peft import is_peft_module
from .versions import missing


def internal(module: str, name: str) -> Callable[..., Any]:
    """`module.name` from transformers, or an error saying which transformers internal autotp lost."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise missing(f"{module}.{name}") from None


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's Conv1D: a linear whose weight is stored [in, out]."""
    return isinstance(module, Conv1D)


def adapter_module(model: nn.Module, where: Callable[[nn.Module], bool] = lambda m: True) -> tuple[str, str] | None:
    """The first module (path, class) that a parameter-efficient tuning library (PEFT) put into `model` (of those
    `where` accepts)."""
    for path, module in model.named_modules():
        if is_peft_module(module) and where(module):
            return path or "the model itself", f"{type(module).__module__}.{type(module).__qualname__}"
    return None


def is_transformers_class(module: nn.Module) -> bool:
    """Whether `module`'s class is one transformers ships (its own code), not a user's or a remote-code model's."""
    return type(module).__module__.startswith("transformers.")


def is_causal_lm(model: nn.Module) -> bool:
    """Whether transformers classifies the model's loss as causal-LM cross-entropy (`PreTrainedModel.loss_type`).

    "ForConditionalGeneration" maps to the same loss in transformers. Only vision-language models
    (a `vision_config`, no encoder-decoder) are counted: their forward calls `self.loss_function`
    (the image-text sweep runs every one), while others of that name (Qwen2-Audio) still compute
    cross-entropy inline, which vocab-sharded logits would break.
    """
    loss_type = getattr(model, "loss_type", None)
    config = model.config
    return loss_type == "ForCausalLM" or (
        loss_type == "ForConditionalGeneration"
        and not getattr(config, "is_encoder_decoder", False)
        and getattr(config, "vision_config", None) is not None
    )


# The forward keyword a model's key/value cache travels under: transformers 5.24 renamed `past_key_values` to `cache`
# (the old name is still accepted, deprecated); Mamba before 5.24 and a few older families use names of their own.
CACHE_KWARGS = ("cache", "past_key_values", "cache_params", "state", "mems", "past_buckets_states")
# a padding-free batch's packed segments for flash's variable-length path (DataCollatorWithFlattening, TRL's collator)
FLASH_VARLEN_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# TRL's `add_fused_lm_head`: with it the forward runs the backbone, then an LM head of its own on last_hidden_state
FUSED_LM_HEAD_KWARG = "fused_lm_head"


def passed_cache(kwargs: dict) -> Any:
    """The key/value cache a forward's keywords carry under any name transformers uses for it, or None."""
    return next((kwargs[name] for name in CACHE_KWARGS if kwargs.get(name) is not None), None)


def attn_implementation(config: PretrainedConfig) -> str | None:
    """The attention implementation a config selects (transformers keeps it in a private field, no public getter)."""
    return config._attn_implementation


def register_function(interface: Any, key: str, function: Callable[..., Any]) -> Callable[[], None]:
    """`function` under `key` in a transformers function registry (`ALL_ATTENTION_FUNCTIONS`,
    `ALL_MASK_ATTENTION_FUNCTIONS`: class-wide, `register`); returns what takes it out again (transformers has no
    public unregister: its class-wide `_global_mapping`), putting back what `key` held before."""
    mapping = type(interface)._global_mapping
    had, before = key in mapping, mapping.get(key)
    type(interface).register(key, function)

    def unregister() -> None:
        if mapping.get(key) is function:
            if had:
                mapping[key] = before
            else:
                del mapping[key]

    return unregister


def set_config_attn_implementation(config: PretrainedConfig, name: str) -> None:
    """Select `name` on one config object alone: `model.set_attn_implementation` does not reach config copies that
    modules hold of their own (autotp gives attention modules one with their rank's head counts)."""
    config._attn_implementation = name


TASKS = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "image-text": "AutoModelForImageTextToText",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "masked-lm": "AutoModelForMaskedLM",
    "classification": "AutoModelForSequenceClassification",
}


def model_class(config: PretrainedConfig, task: str | None = None) -> type[Any]:
    """The class that builds `config` for `task` (a key of `TASKS`): transformers' auto class, by default the
    one of the class named in `config.architectures`, else the first task (in `TASKS` order) with a class
    for the config. A config no auto class maps (a sub-model saved alone, such as Emu3's text model) gets
    the class `config.architectures` names, as transformers' own loading of that save needs."""
    import transformers

    named = (getattr(config, "architectures", None) or [""])[0]
    if task is None:
        mappings = {t: getattr(transformers, auto)._model_mapping for t, auto in TASKS.items()}
        task = next((t for t, mapping in mappings.items() if named in mapping._model_mapping.values()), None) or next(
            (t for t, mapping in mappings.items() if type(config) in mapping), "causal-lm"
        )
    auto = getattr(transformers, TASKS[task])
    if type(config) in auto._model_mapping:
        return auto
    cls = getattr(transformers, named, None)
    if isinstance(cls, type) and isinstance(config, getattr(cls, "config_class", ())):
        return cls
    raise ValueError(
        f"model type {config.model_type!r} has no {TASKS[task]} class in transformers; "
        f"choose another task (--task on the command line, task= in from_pretrained): {', '.join(TASKS)}"
    )


def build_model(config: PretrainedConfig, task: str | None = None, **kwargs: Any) -> nn.Module:
    """`config`'s model for `task` (see `model_class`) with random weights; `kwargs` go to `from_config`."""
    cls = model_class(config, task)
    return cls.from_config(config, **kwargs) if hasattr(cls, "from_config") else cls._from_config(config, **kwargs)


def avoid_grouped_mm(module: nn.Module, widths: Iterable[int], dtype: torch.dtype) -> bool:
    """Give a transformers experts module (`@use_experts_implementation`) its own config asking for `batched_mm` when
    `grouped_mm`, the default, cannot run its shards: it needs every row stride a multiple of 16 bytes, and a shard
    `widths` wide (6 fp32 of a 12-wide expert at tp 2) is not. Padding would change the state dict's shapes; the batched
    path computes the same sums. Returns whether it switched."""
    config = getattr(module, "config", None)
    if getattr(config, "_experts_implementation", None) != "grouped_mm":
        return False
    if all(width * dtype.itemsize % 16 == 0 for width in widths):
        return False
    module.config = copy.copy(config)
    module.config._experts_implementation_internal = "batched_mm"  # not the setter: it also writes shared sub-configs
    return True


def eager_experts(model: nn.Module) -> None:
    """Run `model`'s experts on transformers' eager path where it has another (a planner's narrow twin: grouped_mm
    needs 16-byte row strides, which narrowed experts may lack; every path computes the same sums)."""
    current = getattr(getattr(model, "config", None), "_experts_implementation", None)
    if isinstance(current, str) and current != "eager" and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")


def failed_experts_kernel(model: nn.Module, err: BaseException) -> str | None:
    """The experts implementation ("grouped_mm", "batched_mm") whose transformers kernel raised `err`, or None.

    Such a failure is the model's own, in one process too (grouped_mm's 16-byte strides at an expert width of 37):
    `experts_implementation="eager"` is its fix, not other inputs. Read from the traceback, which must pass through
    transformers' experts kernels (`transformers/integrations/moe.py`)."""
    inside = any(
        Path(frame.filename).parts[-3:] == ("transformers", "integrations", "moe.py")
        for frame in traceback.extract_tb(err.__traceback__)
    )
    if not inside:
        return None
    configs = [getattr(model, "config", None)] + [getattr(m, "config", None) for m in model.modules()]
    names = [getattr(c, "_experts_implementation", None) for c in configs]
    return next((n for n in names if isinstance(n, str) and n != "eager"), "its experts implementation")


def causal_lm_loss() -> Callable[..., torch.Tensor]:
    """transformers' causal-LM cross-entropy (`ForCausalLMLoss`), which a model's `loss_function` is by default."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING["ForCausalLM"]


def own_loss(model: nn.Module) -> str | None:
    """The name of the function the user set as a causal LM's `model.loss_function`, or None where it is transformers'
    causal-LM loss (the default): autotp's sharded losses compute that one, and stand in for nothing else."""
    loss = getattr(model, "loss_function", None)
    if loss is None or loss is causal_lm_loss():
        return None
    return getattr(loss, "__qualname__", None) or type(loss).__qualname__


def router_outputs(module: nn.Module) -> tuple[Callable[[nn.Module], bool], int] | None:
    """Which submodules' outputs transformers records as a model's `router_logits` (`_can_record_outputs`, read by
    its output capturing), and at which index of their output; None where `module`'s class records none."""
    specs = (getattr(type(module), "_can_record_outputs", None) or {}).get("router_logits")
    if specs is None:
        return None
    spec = specs[0] if isinstance(specs, list) else specs
    target: Any = getattr(spec, "target_class", spec)
    name = getattr(spec, "class_name", None) or (target if isinstance(target, str) else None)
    index = getattr(spec, "index", 1)  # transformers' default for a bare class that is not a hidden state
    if name is not None:
        return (lambda m: type(m).__name__.endswith(name)), index
    return (lambda m: isinstance(m, target)), index
