"""PEFT's own adapter files from a wrapped model: full-size on save, this rank's slices on load.

A saved adapter must load in one process (`PeftModel.from_pretrained`), so its split halves are
written at full size; only the adapters are gathered for that, never the base weights, so saving
costs the adapter's own size. `PeftModel.save_pretrained` is wrapped for that while a wrapped model
lives, and restored once the last is collected (models autotp did not wrap save as before in the
meantime); so is PEFT's `update_layer`, so that an adapter added after wrap is drawn at full size as
in one process and split at once. Loading needs no collective: a pre-hook on the wrapped model cuts
every full-size adapter tensor to this rank's part before PyTorch copies it, whichever PEFT entry
point loads (`PeftModel.from_pretrained`, `load_adapter`, `set_peft_model_state_dict`).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import weakref
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ...compat.peft import AdapterRequest, patch_update_layer
from ...mesh import is_global_rank0
from ...runtime.process_hooks import CLASS_ATTRIBUTE, Effect, Hold, patch_class_attribute
from ...state import TPState, find_state, wrapped_model
from ...tp.lora import adapt_all, adapter_partition, build_adapter, sharded_loras, trainable_copies
from ..errors import describe, failures, world


@contextmanager
def gathered_adapters(model: nn.Module) -> Iterator[None]:
    """Inside, the LoRA halves and `modules_to_save` copies of `model` hold their full tensors (collective over TP).

    Adapters PEFT added since the last forward are made tensor-parallel first, so a save right after
    `get_peft_model` writes what training would start from.
    """
    state, root = find_state(model), wrapped_model(model)
    if state is None or root is None or state.tp_group is None or state.is_gathered():  # root: None with state
        yield
        return
    adapt_all(root, state)
    parts = [lora.autotp_lora for _, lora, _ in sharded_loras(root)]
    parts += [copy for module in root.modules() for copy in trainable_copies(module)]
    for part in parts:
        part.gather_()
    try:
        yield
    finally:
        for part in parts:
            part.partition_()


def _save_pretrained(original: Any) -> Any:
    """PEFT's `save_pretrained`, which on a wrapped model writes the full-size adapter once (global rank 0)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def save_pretrained(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        state = find_state(self)
        if state is None or state.tp_group is None:
            return original(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["is_main_process"] = bound.arguments.get("is_main_process", True) and is_global_rank0()
        error = None
        with gathered_adapters(self):
            try:
                original(*bound.args, **bound.kwargs)
            except Exception as err:  # every rank must reach the agreement below
                error = err
        failed = failures(error, world())  # also: no rank reads the adapter before rank 0 has written it
        if error is not None:
            raise error
        if failed:
            raise RuntimeError(f"PeftModel.save_pretrained failed on {describe(failed)}")

    return save_pretrained


class _PeftPatch:
    """While any model that autotp wrapped lives (a PEFT model holds the one it adapts): `PeftModel.save_pretrained`
    wrapped, and PEFT's `update_layer` building adapters around sharded layers at full size, then splitting them
    (`autotp.tp.lora.build_adapter`); PEFT's own again once the last of them is garbage-collected or rolled back
    (a process-wide effect of `autotp.runtime.process_hooks`)."""

    def __init__(self) -> None:
        self.models: weakref.WeakKeyDictionary[nn.Module, Hold] = weakref.WeakKeyDictionary()

    def watch(self, model: nn.Module) -> None:
        """Wrap PEFT's methods while `model` lives, if PEFT is installed (imported here so no later import misses it)."""
        if importlib.util.find_spec("peft") is None or (model in self.models and not self.models[model].removed):
            return
        from peft import PeftModel

        self.models[model] = patch_class_attribute(
            model,
            "PEFT's methods",
            self.install,
            [
                Effect(CLASS_ATTRIBUTE, "save_pretrained", PeftModel),
                Effect(CLASS_ATTRIBUTE, "update_layer", "peft lora.Linear"),
            ],
        )

    def install(self) -> Callable[[], None]:
        from peft import PeftModel

        original = PeftModel.save_pretrained
        PeftModel.save_pretrained = _save_pretrained(original)
        restore_update_layer = patch_update_layer(self.build)

        def restore() -> None:
            if getattr(PeftModel.save_pretrained, "__wrapped__", None) is original:  # not replaced since by others
                PeftModel.save_pretrained = original
            restore_update_layer()

        return restore

    def build(self, request: AdapterRequest, build: Callable[[], None]) -> None:
        build_adapter(request, build, [model for model, hold in list(self.models.items()) if not hold.removed])


watch_peft = _PeftPatch()


class AdapterSlices:
    """Load pre-hook on a wrapped model: full-size LoRA halves and `modules_to_save` copies become this rank's rows.

    A tensor already at the shard's size is left alone (autotp's own per-rank files), so either loads.
    """

    def __init__(self, model: nn.Module, state: TPState):
        self.state = state
        self.handle = model.register_load_state_dict_pre_hook(self)

    def __call__(
        self, model: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict, *_: Any
    ) -> None:
        if self.state.is_gathered() or not any("lora_" in key or "modules_to_save" in key for key in state_dict):
            return
        assign = local_metadata.get("assign_to_params_buffers", False)
        rank = self.state.tp_rank
        for path, lora, layer in sharded_loras(model):
            for half in ("lora_A", "lora_B"):
                partition = adapter_partition(layer, half)
                for name, module in getattr(lora, half).items():
                    for key, param in module.named_parameters(prefix=f"{prefix}{path}.{half}.{name}"):
                        if partition is not None and self._cut(state_dict, key, param, partition, rank, assign):
                            vars(lora).setdefault("autotp_loaded", set()).add(name)
        for path, module in model.named_modules():
            for name, copy in getattr(module, "modules_to_save", {}).items() if trainable_copies(module) else ():
                for key, param in copy.named_parameters(prefix=f"{prefix}{path}.modules_to_save.{name}"):
                    shard = getattr(param, "autotp_shard", None)
                    if shard is not None:
                        self._cut(state_dict, key, param, shard.partition, rank, assign)

    @staticmethod
    def _cut(
        state_dict: dict[str, Any], key: str, param: torch.Tensor, partition: Any, rank: int, assign: bool
    ) -> bool:
        """Replace a full-size `state_dict[key]` by this rank's part; whether it was there at full size."""
        tensor = state_dict.get(key)
        dim = partition.dim
        if tensor is None or tensor.shape[dim] != partition.full_size or tensor.shape[dim] == param.shape[dim]:
            return False
        if assign and hasattr(param, "autotp_shard"):
            raise NotImplementedError(
                f"autotp: loading {key} with assign=True (PEFT's low_cpu_mem_usage=True) would "
                f"replace a sharded parameter autotp tracks; load with low_cpu_mem_usage=False"
            )
        state_dict[key] = partition.shard(tensor, rank)
        return True


def slice_adapters_on_load(model: nn.Module, state: TPState) -> AdapterSlices:
    """Install the load pre-hook on a wrapped model, and the save wrapper on PEFT while the model lives."""
    watch_peft.watch(model)
    return AdapterSlices(model, state)
