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

A class or method that moved raises `versions.missing`'s error naming it.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

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
