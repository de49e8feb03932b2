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
| state-dict names `base_layer`, `lora_A/B`,     | the base names `merge_and_unload` leaves, for | 0.21        |
| `original_module`, `modules_to_save.<name>`    | `export_weights` (`base_keys`), `consolidate` |             |
|                                                | (`is_peft_key`)                               |             |
| `lora.Linear.scaling`, `fan_in_fan_out`,       | merging an adapter into a weight shard as     | 0.21        |
| `merged`, `active_adapters`                    | `merge_and_unload` does (`merged_weight`)     |             |
| `get_peft_model_state_dict` (public)           | PEFT's saved adapter names                    | 0.21        |

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
def _classes() -> dict[str, tuple[type[Any], ...]] | None:
    """PEFT's classes autotp recognises, imported once; None without PEFT."""
    try:
        import peft  # noqa: F401
    except ImportError:
        return None

    def load(path: str) -> type[Any]:
        module, _, name = path.rpartition(".")
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            raise missing(path) from None

    peft_classes = tuple(
        load(p)
        for p in (
            "peft.PeftModel",
            "peft.PeftMixedModel",
            "peft.tuners.tuners_utils.BaseTuner",
            "peft.tuners.tuners_utils.BaseTunerLayer",
            "peft.utils.AuxiliaryTrainingWrapper",
        )
    )
    return {
        "lora": (load("peft.tuners.lora.Linear"),),
        "modules_to_save": (load("peft.utils.ModulesToSaveWrapper"),),
        "peft": peft_classes,
    }


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
    modules_to_save: tuple[str, ...] = ()  # the config's: PEFT copies these modules once the adapters are built

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

    return AdapterRequest(
        lora,
        arguments["adapter_name"],
        setting("init_lora_weights", True),
        bool(setting("lora_bias", False)),
        arguments,
        tuple(setting("modules_to_save", None) or ()),
    )


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


# --- PEFT's names and merge, for exporting weights (autotp.io.rollout.export) ------------------------------------------------

_ADAPTER_PARTS = (".lora_A.", ".lora_B.", ".lora_embedding_A.", ".lora_embedding_B.", ".lora_magnitude_vector.")


def is_peft_key(key: str) -> bool:
    """Whether a state-dict key names a tensor of PEFT's (an adapter half, or a base layer or copy PEFT moved)."""
    return any(
        part in f".{key}" for part in (*_ADAPTER_PARTS, ".base_layer.", ".original_module.", ".modules_to_save.")
    )


def peft_inner(model: nn.Module) -> nn.Module:
    """The transformers model a `PeftModel` adapts (`peft_model.base_model.model`), else `model` itself."""
    classes = _classes()
    if classes is not None and isinstance(model, classes["peft"][:2]):
        return model.base_model.model
    return model


def base_keys(root: nn.Module, keys: list[str], copies: bool) -> dict[str, tuple[str, str | None]]:
    """Name as transformers saves it after PEFT's `merge_and_unload` -> (state-dict key of `root`, path of the LoRA
    layer whose base weight it is, or None), for every key that is not an adapter. `copies`: a `modules_to_save`
    module goes out as its active trainable copy (what merge_and_unload keeps), else as the original module."""
    out: dict[str, tuple[str, str | None]] = {}
    for key in keys:
        if any(part in f".{key}" for part in _ADAPTER_PARTS):
            continue
        if ".base_layer." in f".{key}":
            path, _, leaf = key.partition(".base_layer.")
            lora = leaf == "weight" and is_lora_linear(root.get_submodule(path))
            out[f"{path}.{leaf}"] = (key, path if lora else None)
        elif ".original_module." in key:
            if not copies:
                out[key.replace(".original_module.", ".", 1)] = (key, None)
        elif ".modules_to_save." in key:
            path, _, rest = key.partition(".modules_to_save.")
            name, _, leaf = rest.partition(".")
            if copies and name in root.get_submodule(path).active_adapters:
                out[f"{path}.{leaf}"] = (key, None)
        else:
            out[key] = (key, None)
    return out


def merged_weight(lora: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """`weight` (the base layer's, or this rank's rows or columns of it) with every active adapter of PEFT's LoRA
    `lora` added, in fp32, as `merge_and_unload` adds it: W + scaling * B @ A (transposed for Conv1D). Holding the
    halves that match `weight`'s rows (lora_B of a column layer) or columns (lora_A of a row layer), the product is
    this rank's part of the delta."""
    if not is_lora_linear(lora):
        raise NotImplementedError(f"autotp: merging {type(lora).__name__} is not supported; use merge_lora=False")
    out = weight.detach().float()
    if lora.merged:  # merged in place already: the weight holds the delta
        return out
    for name in lora.active_adapters:
        if name not in lora.lora_A:
            continue
        if getattr(lora, "lora_variant", {}).get(name) is not None or lora.lora_B[name].bias is not None:
            raise NotImplementedError(
                f"autotp: merging adapter {name!r} (a LoRA variant or lora_bias) is not supported; use merge_lora=False"
            )
        delta = lora.lora_B[name].weight.detach().float() @ lora.lora_A[name].weight.detach().float()
        out = out + (delta.t() if lora.fan_in_fan_out else delta) * lora.scaling[name]
    return out


def adapter_state_dict(
    peft_model: nn.Module, state_dict: dict[str, torch.Tensor], adapter_name: str
) -> dict[str, torch.Tensor]:
    """PEFT's saved names of `adapter_name`'s tensors (`get_peft_model_state_dict`, what `save_pretrained` writes):
    saved name -> the very tensor of `state_dict` (the PEFT model's keys)."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(peft_model, state_dict=state_dict, adapter_name=adapter_name)
