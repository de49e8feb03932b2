"""Guards against the mistakes that give silently wrong results around a wrapped model.

- TP or CP ranks of one replica fed different batches (`check_same_inputs`, `wrap(..., check_inputs=True)`).
- DistributedDataParallel over a group that holds two ranks of one TP group, which would average
  different shards together, or, under context parallelism, one that leaves out CP ranks (`DDPGuard`, which asks
  each dimension: `autotp.runtime.dimension.Dimension.check_ddp`).
- A sharded layer swapped for another module after `wrap`, other than PEFT's LoRA, which `autotp.tp.lora`
  makes tensor-parallel (any other adapter sees only the shard and adds an update nobody reduces) (`SwapGuard`).
- torch's own `fully_shard` on a wrapped model (use `autotp.fully_shard`), and FSDP over a mesh that holds two ranks
  of one TP group, checked at the first forward or optimizer step (`MeshGuard`).
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers.pytorch_utils import Conv1D

from ..compat.hf import adapter_module
from ..compat.peft import is_modules_to_save
from ..compat.torch import ddp_under_construction
from ..dp.fsdp import check_mesh
from ..options import WrapOptions
from ..runtime.input_agreement import check_same_batch
from ..runtime.process_hooks import Hold, module_forward_pre_hook, watch_optimizer_steps
from ..runtime.replicas import check_replicas
from ..runtime.slot_guard import SlotGuard
from ..state import TPState, refuse_torch_fsdp, state_of
from ..tp.lora import adapt

REPLICA_CHECK_EVERY = 100


def check_same_inputs(model: nn.Module, *args: Any, **kwargs: Any) -> None:
    """Raise on every rank if the TP or CP ranks of this replica were not given identical tensors; names the first
    that differs. Collective over the TP group, then the CP group."""
    state = state_of(model)
    named = [(f"argument {i}", v) for i, v in enumerate(args)] + [(f"{k}=", v) for k, v in kwargs.items()]
    tensors = [(name, t) for name, t in named if torch.is_tensor(t)]
    check_same_batch(state.tp_group, tensors, "TP")
    for label, group in state.batch_groups():
        check_same_batch(group, tensors, label)


class InputCheck:
    """Forward pre-hook of `wrap(..., check_inputs=True)`: `check_same_inputs` on every forward, and
    `check_replicas` every `REPLICA_CHECK_EVERY` training forwards (replicas drift slowly, and it costs a checksum)."""

    def __init__(self) -> None:
        self.forwards = 0

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        check_same_inputs(module, *args, **kwargs)
        if module.training:
            if self.forwards % REPLICA_CHECK_EVERY == 0:
                check_replicas(module)
            self.forwards += 1


class DDPGuard:
    """Stands in as `model._ddp_params_and_buffers_to_ignore`, which DDP reads while it is being built.

    DDP then already holds its process group, but broadcasts rank 0's weights over it right after;
    if the group holds two ranks of one TP group that broadcast and every gradient average would mix
    different shards, so the guard refuses at once. No public hook exposes the group at that point:
    `_ddp_under_construction` reads it from the constructor's frame (checked on torch 2.4 to 2.13),
    and should a later torch hide it, the check still runs on the DDP module's first forward.
    """

    def __init__(self, model: nn.Module, ignored: tuple[str, ...] = ()):
        self.model, self.ignored = model, ignored
        self._pending: Hold | None = None

    def __iter__(self) -> Iterator[str]:
        ddp = _ddp_under_construction()
        if ddp is not None:
            self.check(ddp.process_group)
        elif self._pending is None:
            self._pending = module_forward_pre_hook(self, DDPGuard._on_forward)
        return iter(self.ignored)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if isinstance(module, DistributedDataParallel) and module.module is self.model:
            if self._pending is not None:  # always: this hook runs only while `_pending` holds it
                self._pending.remove()
            self._pending = None
            self.check(module.process_group)

    def check(self, group: dist.ProcessGroup | None) -> None:
        """Refuse a data-parallel group that would mix what a dimension splits: two ranks of this model's TP group,
        one leaving out CP ranks, any under expert parallelism (each dimension's `check_ddp`)."""
        state = state_of(self.model)
        for dimension in state.dims.values():
            dimension.check_ddp(group, state)


def _ddp_under_construction() -> DistributedDataParallel | None:
    """The DDP whose constructor is reading the ignore list (two frames up), if it can be seen."""
    return ddp_under_construction(2)


PEFT_UNSUPPORTED = (
    "Of PEFT's methods autotp shards only LoRA on linear layers (get_peft_model before or after "
    "autotp.wrap); any other adapter would see only this rank's shard and its update would never be "
    "reduced, giving wrong results. Use LoRA, or, for an adapter that is not around a linear layer (LoRA on "
    "the embedding), put it on before wrapping where autotp splits nothing (tp_size=1, every other *_size 1)"
)


def refuse_adapters(model: nn.Module, options: WrapOptions) -> None:
    """Refuse a model that already holds PEFT modules, before anything changes. Where nothing is split (every `*_size`
    1) an adapter around a layer the plan leaves as it is (LoRA on the embedding: the plan replaces linears only)
    sees whole weights, and trains as in one process."""
    found = adapter_module(model)
    if (
        found is not None
        and found[0] == "the model itself"
        and isinstance(getattr(model, "base_model", None), nn.Module)
    ):
        raise TypeError(
            f"autotp: the model is a {found[1]}; wrap the transformers model it holds instead: "
            f"autotp.wrap(peft_model.base_model.model, tp_size)"
        )
    if found is not None and is_modules_to_save(model.get_submodule(found[0])):
        raise TypeError(
            f"autotp: {found[0]} is a {found[1]} (PEFT's modules_to_save), which wrap cannot shard. "
            f"get_peft_model after autotp.wrap works: wrap the model without PEFT, then call "
            f"get_peft_model(model, LoraConfig(..., modules_to_save=[...])) on the wrapped model"
        )
    if found is None:
        return
    if options.tp_group is not None or any(n > 1 for n in options.sizes().values()):
        raise TypeError(f"autotp: {found[0]} is a {found[1]}. {PEFT_UNSUPPORTED}")
    linear = adapter_module(model, lambda m: isinstance(getattr(m, "base_layer", None), (nn.Linear, Conv1D)))
    if linear is not None:
        raise TypeError(
            f"autotp: {linear[0]} is a {linear[1]} around a linear layer, which wrap replaces even at tp_size=1; of "
            f"PEFT's methods autotp carries over only LoRA on linear layers to the new layer. Use LoRA, or train this "
            f"adapter without autotp.wrap"
        )


class MeshGuard:
    """Stops a model sharded by torch's own `fully_shard` (not `autotp.fully_shard`) at its first forward or
    optimizer step, and FSDP over a mesh that holds two ranks of one TP group before any step.

    Inside a forward FSDP's parameters are plain tensors; before a step they are DTensors again, so the mesh is
    checked there, once per parameter object, before any weight changes. The model's state keeps its guard alive;
    the process-wide step hook (`autotp.runtime.process_hooks.watch_optimizer_steps`) visits it while it lives.
    """

    def __init__(self, model: nn.Module):
        self.model, self.state = model, state_of(model)
        self._checked: weakref.ref | None = None
        model.register_forward_pre_hook(self.on_forward)
        self.state.mesh_guard = self
        self.watch = watch_optimizer_steps(self, MeshGuard.before_step)

    def __deepcopy__(self, memo: dict) -> MeshGuard:
        """The guard of a deep-copied model (its forward hook is this guard's bound method, copied with it); a part of
        the model copied alone (PEFT's modules_to_save) keeps this guard, as it keeps the state."""
        state = copy.deepcopy(self.state, memo)
        if state is self.state:
            return self
        new = MeshGuard.__new__(MeshGuard)
        memo[id(self)] = new
        new.model, new.state, new._checked = copy.deepcopy(self.model, memo), state, None
        new.watch = watch_optimizer_steps(new, MeshGuard.before_step)
        return new

    def on_forward(self, module: nn.Module, args: tuple) -> None:
        self.check()

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.check()

    def check(self) -> None:
        """Refuse FSDP over a mesh mixing TP ranks, then torch's own FSDP; one lookup while nothing changed."""
        first = next(self.model.parameters(), None)
        if first is None or (self._checked is not None and self._checked() is first):
            return
        check_mesh(first, self.state.tp_group)
        refuse_torch_fsdp(self.model, self.state, deep=True)
        self._checked = weakref.ref(first)  # FSDP swaps the parameter objects, so any change is seen again


def refuse_meta(model: nn.Module, call: str = "wrap") -> None:
    """Refuse a model whose parameters or buffers are still on the meta device (built under `torch.device("meta")`,
    `init_empty_weights`, or loaded with `device_map="meta"`), naming them: `call` shards and broadcasts real values,
    and a meta tensor has none. Before, such a model was wrapped without an error, or broadcast failed in gloo
    ("unsupported device type meta", or a rank that skipped its meta tensors left the others waiting)."""
    names = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if not names:
        return
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    raise ValueError(
        f"autotp: {type(model).__name__} has {len(names)} parameters and buffers on the meta device ({shown}), which "
        f"hold no values to shard. Load the weights before {call} (build the model on a real device, or call "
        f"model.to_empty(device=...) and then load_state_dict), or let autotp.from_pretrained(path, tp_size) read "
        f"each rank's shards straight from the checkpoint. Nothing was changed."
    )


def refuse_quantized(model: nn.Module) -> None:
    """Refuse a quantised model (bitsandbytes, GPTQ, AWQ, ...: QLoRA's base) before anything changes: its linears
    hold packed integer blocks with per-block scales, which splitting rows or columns would tear apart."""
    config = getattr(model, "config", None)
    quantization = getattr(config, "quantization_config", None)
    if quantization is None and getattr(model, "hf_quantizer", None) is None:
        return
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    ) or type(getattr(model, "hf_quantizer", None)).__name__
    method = getattr(method, "value", method)
    raise NotImplementedError(
        f"autotp: {type(model).__name__} is quantised ({method}, config.quantization_config). autotp shards "
        f"unquantised weights only; a quantised base (QLoRA) is not supported yet. Load it unquantised (e.g. "
        f"dtype=torch.bfloat16), wrap it, then add LoRA: each rank then holds 1/tp of the weights"
    )


class SwapGuard(SlotGuard):
    """Watches the slots of sharded modules (`autotp.runtime.slot_guard`): adapts PEFT's LoRA put around a sharded
    linear after wrap (`autotp.tp.lora`), and refuses to run once one was replaced by anything else."""

    recheck = "autotp_lora"  # a LoRA-adapted layer in place is still looked at (`adapt` may release it)

    def __init__(
        self, parent: nn.Module, parent_path: str, slots: dict[str, nn.Module], carrier: nn.Module, state: TPState
    ):
        super().__init__(parent, parent_path, slots, carrier)
        self.state = state
        state.swap_guards.append(self)

    def changed(self, path: str, current: nn.Module | None, original: nn.Module) -> None:
        if adapt(current, original, path, self.state):
            return
        found = adapter_module(current) if current is not None else None
        why = (
            PEFT_UNSUPPORTED
            if found
            else ("autotp's sharded layers must stay in place; re-run wrap on an unwrapped model instead")
        )
        raise RuntimeError(
            f"autotp: {path} was replaced after wrap by {type(current).__module__}.{type(current).__qualname__}. {why}"
        )

    @classmethod
    def refresh(cls, model: nn.Module, state: TPState, paths: list[str]) -> None:
        """Guard `paths` anew: autotp itself rebuilt their modules (a vocabulary resize)."""
        for guard in list(state.swap_guards):
            for name in list(guard.slots):
                if guard.path(name) in paths:
                    del guard.slots[name]
            if not guard.slots:
                guard.handle.remove()
                state.swap_guards.remove(guard)
        cls.install(model, {path: model.get_submodule(path) for path in paths}, state)
