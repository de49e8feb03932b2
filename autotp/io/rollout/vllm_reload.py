"""What vLLM 0.32's CPU weight reload leaves undone, redone after each round the "autotp-gloo" worker loads.

Why: vLLM's layerwise reload runs each layer's `process_weights_after_loading` only where the round gave it weights
and only as its first load did. Two layers then serve stale or misread values: the CPU MoE experts (prepacked on the
first load only; an update copies checkpoint layout in, read as packed) and a tied LM head (it gets no weight of its
own, so its packed copy of the embedding is never rebuilt). Each fix acts only on the layers vLLM skipped, so
nothing is processed twice once vLLM does it itself.
"""

from __future__ import annotations

from typing import Any

import torch


class CpuExpertPrepack:
    """The CPU MoE experts a load leaves unpacked. vLLM 0.32's `UnquantizedFusedMoEMethod._setup_kernel` runs the
    experts' `process_weights_after_loading` (the CPU prepack of `w13_weight` / `w2_weight`) on the first load
    only; on a weight update it copies the checkpoint layout in and skips it, and the kernel then reads those
    values as packed. While loading, each CPU experts kernel's prepack records the layers it ran for; `prepack()`
    then prepacks, in place, every layer it did not run for (none, once vLLM runs it on updates)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.layers: list[tuple[torch.nn.Module, Any]] = []  # each layer and its CPU experts kernel
        self.done: set[int] = set()
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        except ImportError:  # a vLLM without that kernel has nothing of it to prepack
            return
        for layer in model.modules():
            experts = getattr(getattr(getattr(layer, "quant_method", None), "moe_kernel", None), "fused_experts", None)
            zentorch = getattr(experts, "_use_zentorch", False)  # zentorch keeps the checkpoint layout
            if type(experts) is CPUUnquantizedExperts and not zentorch:  # the "vec" kernel, prepacked
                self.layers.append((layer, experts))

    def __enter__(self) -> None:
        for _layer, experts in self.layers:

            def recorded(target: torch.nn.Module, run=experts.process_weights_after_loading) -> None:
                self.done.add(id(target))
                run(target)

            experts.process_weights_after_loading = recorded  # this instance only, until __exit__

    def __exit__(self, *_: object) -> None:
        for _, experts in self.layers:
            del experts.process_weights_after_loading

    def prepack(self) -> None:
        from vllm._custom_ops import cpu_prepack_moe_weight

        for layer, experts in self.layers:
            if id(layer) not in self.done:
                for weight in (layer.w13_weight, layer.w2_weight):
                    weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))


def unprocessed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers with post-load processing that this reload has given no weight (before `finalize_layerwise_reload`,
    which puts their tensors back unprocessed): a tied LM head, whose weight is the embedding's."""
    from vllm.model_executor.layers.attention import is_deferred_attention_layer
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    return [
        layer
        for layer in model.modules()
        if isinstance(getattr(layer, "quant_method", None), QuantizeMethodBase)
        and (info := LAYERWISE_INFO.get(layer)) is not None
        and info.can_load()
        and info.load_numel <= 0
        and info.load_numel_total
        and not is_deferred_attention_layer(layer)
    ]


def process_tied(model: torch.nn.Module, skipped: list[torch.nn.Module]) -> None:
    """Runs the post-load processing vLLM skipped (its layerwise reload's limitation 2: "tied parameters will only
    reflect processing from one of the parent layers") for each of `skipped` whose weight another, loaded, layer
    holds too: on CPU it rebuilds the LM head's packed copy of the new embedding, which vLLM 0.32 keeps from the
    first load (new weights, old head). Only those: processing a layer twice would pack packed weights."""

    def storages(layer: torch.nn.Module) -> set[int]:
        return {p.untyped_storage().data_ptr() for p in layer.parameters(recurse=False) if p.numel()}

    others = {id(layer) for layer in skipped}
    loaded = set().union(*(storages(layer) for layer in model.modules() if id(layer) not in others))
    for layer in skipped:
        if storages(layer) & loaded:
            layer.quant_method.process_weights_after_loading(layer)
