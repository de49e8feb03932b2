"""LoRA put on before `wrap`: `lift` takes PEFT's LoRA layers out so the model is planned and sharded as without
them, and `attach` puts them back around the new layers, splitting each adapter from its full values
(`autotp.tp.lora` then runs them)."""

from __future__ import annotations

from torch import nn

from ..state import TPState
from .layers import LinearAllreduce, LinearLayer
from .lora import TPLora, is_lora_linear


def lift(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """PEFT's LoRA layers taken out of `model` (each slot then holds the layer LoRA wraps), so that `wrap` shards
    the model as if they were not there; `put_back` or `attach` returns them. A LoRA that autotp does not
    shard is refused first, with nothing changed."""
    found = []
    for path, module in model.named_modules():
        if is_lora_linear(module, getattr(module, "base_layer", None)):
            if getattr(module, "lora_variant", None):
                raise NotImplementedError(
                    f"autotp: {path} uses a LoRA variant (DoRA or another), which autotp does not "
                    f"shard yet; use plain LoRA"
                )
            if any(m.bias is not None for m in module.lora_B.values()):
                raise NotImplementedError(f"autotp: {path} has lora_bias, which autotp does not shard yet")
            parent, _, name = path.rpartition(".")
            found.append((model.get_submodule(parent), name, module))
    for parent, name, lora in found:
        parent._modules[name] = lora.base_layer
    return found


def put_back(lifted: list[tuple[nn.Module, str, nn.Module]]) -> None:
    """The LoRA layers back in their slots, around the layers they wrapped (wrap failed)."""
    for parent, name, lora in lifted:
        parent._modules[name] = lora


def attach(model: nn.Module, lifted: list[tuple[nn.Module, str, nn.Module]], state: TPState) -> None:
    """The LoRA layers back around the layers now in their slots; those around sharded layers split their
    adapters like the layer (collective over TP)."""
    paths = {id(module): path for path, module in model.named_modules()}
    for parent, name, lora in lifted:
        layer = parent._modules[name]
        if id(layer) not in paths:  # another pipeline stage's layer (`autotp.pp`): its adapters train there
            continue
        path = paths[id(layer)]
        lora.base_layer = layer
        parent._modules[name] = lora
        if isinstance(layer, (LinearLayer, LinearAllreduce)) and layer.tp_size > 1:
            TPLora(lora, layer, path, state).adapt_new(full=True)
