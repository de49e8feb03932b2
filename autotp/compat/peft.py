"""Every place autotp relies on PEFT beyond its documented API, in one module. PEFT is optional: without it
every test here answers False.

| piece                                          | used for                                      | checked on  |
|------------------------------------------------|-----------------------------------------------|-------------|
| `peft.tuners.lora.Linear` (the class itself)   | finding LoRA layers to make tensor-parallel   | 0.17, 0.21  |
| `peft.utils.ModulesToSaveWrapper`              | finding `modules_to_save` copies              | 0.17, 0.21  |
| `PeftModel`, `PeftMixedModel`, `BaseTuner`,    | finding anything PEFT put into a model        | 0.17, 0.21  |
| `BaseTunerLayer`, `AuxiliaryTrainingWrapper`   |                                               |             |
| `lora.Linear._check_forward_args`              | PEFT's argument checks, in autotp's forward   | 0.17, 0.21  |
| `BaseTunerLayer._cast_input_dtype`             | the adapter's input dtype, as PEFT casts it   | 0.17, 0.21  |
| `lora.Linear.update_layer` (wrapped), its      | drawing an adapter around a sharded layer at  | 0.21        |
| arguments, `LoraLayer.in_features` /           | the layer's full size, as one process draws   |             |
| `out_features` (read there)                    | it, then splitting it at once                 |             |
| `LoraLayer.resolve_lora_variant`               | whether an adapter is DoRA (or another        | 0.21        |
|                                                | variant) before PEFT builds it                |             |

A class or method that moved raises `versions.missing`'s error naming it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .versions import missing, require


@functools.cache
def _classes() -> dict[str, tuple[type, ...]] | None:
    """PEFT's classes autotp recognises, imported once; None without PEFT."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return None

    def load(path: str) -> type:
        module, _, name = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            raise missing(path) from None

    peft_classes = tuple(load(p) for p in (
        "peft.PeftModel", "peft.PeftMixedModel", "peft.tuners.tuners_utils.BaseTuner",
        "peft.tuners.tuners_utils.BaseTunerLayer", "peft.utils.AuxiliaryTrainingWrapper"))
    return {"lora": (load("peft.tuners.lora.Linear"),), "modules_to_save": (load("peft.utils.ModulesToSaveWrapper"),),
            "peft": peft_classes}


def is_lora_linear(module: Any) -> bool:
    """Whether `module` is PEFT's LoRA `Linear` itself: a subclass (torchao's) computes differently, and autotp
    replaces its forward with plain LoRA's."""
    classes = _classes()
    return classes is not None and type(module) in classes["lora"]


def is_modules_to_save(module: Any) -> bool:
    """Whether `module` is PEFT's `modules_to_save` wrapper (the original module and its trainable copies)."""
    classes = _classes()
    return classes is not None and isinstance(module, classes["modules_to_save"])


def is_peft_module(module: Any) -> bool:
    """Whether PEFT made `module`: a PEFT model, a tuner, a tuner layer or a trainable-copy wrapper."""
    classes = _classes()
    return classes is not None and isinstance(module, classes["peft"])


def check_forward_args(lora: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """PEFT's own checks of a LoRA layer's forward arguments (mixed adapter batches, merged adapters)."""
    require(lora, "_check_forward_args", "peft.tuners.lora.Linear._check_forward_args")(x, *args, **kwargs)


def cast_input_dtype(lora: nn.Module, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype` as PEFT casts an adapter's input (unless the layer was told to keep its dtype)."""
    return require(lora, "_cast_input_dtype", "peft.tuners.tuners_utils.BaseTunerLayer._cast_input_dtype")(x, dtype)


@dataclass
class AdapterRequest:
    """One call of PEFT's `lora.Linear.update_layer`: the LoRA layer and what it is asked to build."""

    lora: nn.Module
    name: str
    init: Any  # init_lora_weights: True, False, "gaussian", or an init that reads the base weight ("pissa", ...)
    bias: bool  # lora_bias
    arguments: dict[str, Any]  # every argument by name, LoraConfig's fields included

    def uses_variant(self) -> bool:
        """Whether PEFT will build DoRA or another LoRA variant rather than plain LoRA."""
        resolve = require(self.lora, "resolve_lora_variant", "peft.tuners.lora.LoraLayer.resolve_lora_variant")
        return resolve(**self.arguments) is not None


def _request(lora: nn.Module, signature: inspect.Signature, args: tuple, kwargs: dict) -> AdapterRequest | None:
    """`update_layer`'s arguments by name (PEFT 0.18+ passes a LoraConfig, earlier ones its fields); None if they do
    not bind, so PEFT raises its own error."""
    try:
        bound = signature.bind(lora, *args, **kwargs)
    except TypeError:
        return None
    arguments = {k: v for k, v in bound.arguments.items() if k not in ("self", "kwargs")}
    arguments.update(bound.arguments.get("kwargs", {}))
    config = arguments.get("config")

    def setting(key: str, default: Any) -> Any:
        return arguments[key] if key in arguments else getattr(config, key, default)

    return AdapterRequest(lora, arguments["adapter_name"], setting("init_lora_weights", True),
                          bool(setting("lora_bias", False)), arguments)


def patch_update_layer(around: Callable[[AdapterRequest, Callable[[], None]], None]) -> Callable[[], None]:
    """PEFT's `lora.Linear.update_layer` (which builds one adapter) replaced by `around(request, build)`, `build`
    running PEFT's own; returns what puts PEFT's back (unless someone replaced it since). Without PEFT, nothing."""
    classes = _classes()
    if classes is None:
        return lambda: None
    linear = classes["lora"][0]
    original = require(linear, "update_layer", "peft.tuners.lora.Linear.update_layer")
    own = "update_layer" in vars(linear)  # PEFT 0.21's Linear inherits LoraLayer's
    signature = inspect.signature(original)

    @functools.wraps(original)
    def update_layer(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        request = _request(self, signature, args, kwargs)
        if request is None:
            return original(self, *args, **kwargs)
        return around(request, lambda: original(self, *args, **kwargs))

    linear.update_layer = update_layer

    def restore() -> None:
        if vars(linear).get("update_layer") is update_layer:
            if own:
                linear.update_layer = original
            else:
                del linear.update_layer

    return restore
