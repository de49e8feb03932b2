"""Plain state dicts of a sharded model: each one says whose rows it holds, and a load checks it.

`model.state_dict()` on a wrapped model holds this rank's shards under the original keys, so a dict
saved on rank 0 and loaded on rank 1 would match every key and silently give rank 1 rank 0's rows.
Every module holding a sharded parameter records (TP rank, TP size) in its entry of the state dict's
`_metadata` (torch.save keeps it, `torch.load(weights_only=True)` reads it back), and every load
into it checks that record first:

- this rank's own record: loads as it is;
- another rank's or another layout's record: refused, naming the tensor and the ranks;
- a full tensor (a one-process model's dict, or one taken inside `GatherReplacedLayerParams`): this
  rank keeps its rows of it, from the partition on the parameter (`param.autotp_shard`);
- a shard-shaped tensor with no record (a safetensors file, say): refused, unless only this rank holds
  that shape.

A hook on the wrapped model checks the whole dict before any module loads, so a refused load changes
nothing; the hooks on the sharded modules check again and cut full tensors, so a load into one
submodule is covered too. While the model is gathered the hooks do nothing (full weights, full dicts),
and autotp's own checkpoints copy tensors without `load_state_dict`.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from torch import nn

from ..planning.sharding import Shard
from ..state import TPState
from .layers import ParallelLinear

_KEY = "autotp"  # in a module's `_metadata` entry: {"tp_rank": r, "tp_size": n}
_HOW = (
    "Save and load with autotp.save_checkpoint / autotp.load_checkpoint (every rank its own rows), load each "
    "rank's own model.state_dict() on that rank, or load a full state dict (a one-process model's, or one taken "
    "inside autotp.GatherReplacedLayerParams). Nothing was loaded."
)


def guard_state_dicts(model: nn.Module, state: TPState) -> None:
    """Record the layout in the state dicts of `model` (wrapped, TP size > 1) and check it on every load."""
    layout = _Layout(state)
    layout.ensure(model)
    model.register_state_dict_post_hook(state.sharded_only(layout.record_all))
    model.register_load_state_dict_pre_hook(layout.check_all)


class _Layout:
    """The hooks: on the wrapped model (the whole dict, first) and on every module holding shards (a load or save of
    that module alone; they are added to modules that came later, such as a resized LM head, at the next load)."""

    def __init__(self, state: TPState):
        self.state = state

    def __deepcopy__(self, memo: dict) -> _Layout:
        """A deep-copied model's hooks check against the copy's state; a part copied alone keeps this model's."""
        state = copy.deepcopy(self.state, memo)
        return self if state is self.state else _Layout(state)

    def ensure(self, model: nn.Module) -> None:
        for _, module in _owners(model, ""):
            if not getattr(module, "autotp_state_dict_hooks", False):  # copied with the module and its hooks
                module.register_state_dict_post_hook(self.state.sharded_only(self.record))
                module.register_load_state_dict_pre_hook(self.load)
                module.autotp_state_dict_hooks = True

    def _idle(self) -> bool:
        """Gathered (full weights load as they are) or under FSDP (DTensors carry their layout). The load hooks ask
        rather than go through `sharded_only`: torch wraps load pre-hooks in a `_WrappedHook`, whose
        `functools.update_wrapper` copies the wrapper object's attributes over its own."""
        return self.state.is_gathered() or self.state.fsdp

    def record(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if not self.state.fsdp:  # FSDP's DTensors carry their own layout
            local_metadata[_KEY] = {"tp_rank": self.state.tp_rank, "tp_size": self.state.plan.tp_size}

    def record_all(self, model: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is None:
            return
        for path, module in _owners(model, prefix):
            if path in metadata:
                self.record(module, state_dict, "", metadata[path])

    def check_all(self, model: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *_: Any) -> None:
        """Every sharded tensor of the dict, before any module copies one; hooks for modules added since wrap."""
        if self._idle():
            return
        self.ensure(model)
        metadata = getattr(state_dict, "_metadata", None) or {}
        for path, module in _owners(model, prefix):
            record = metadata.get(path, {}).get(_KEY)
            for key, _param, shard in _sharded(module, f"{path}." if path else ""):
                if key in state_dict:
                    _check(key, state_dict[key], shard, record, local_metadata)

    def load(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, *_: Any) -> None:
        """Check this module's tensors, and keep this rank's rows of full ones."""
        if self._idle():
            return
        record = local_metadata.get(_KEY)
        for key, _param, shard in _sharded(module, prefix):
            if key in state_dict and _check(key, state_dict[key], shard, record, local_metadata):
                state_dict[key] = shard.partition.shard(state_dict[key], shard.rank)


def _owners(model: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Module]]:
    """(state-dict path, module) of the model's parts that hold shards: replaced linears and sharded regions (experts,
    a vocab-split embedding). Not LoRA's halves nor PEFT's `modules_to_save` copies: `autotp.io.rollout.adapters` slices
    those, and an adapter file holds them at shard size."""
    for path, module in model.named_modules(prefix=prefix[:-1]):
        if (
            isinstance(module, ParallelLinear) or hasattr(module, "autotp_region")
        ) and "modules_to_save" not in path.split("."):
            yield path, module


def _sharded(module: nn.Module, prefix: str) -> Iterator[tuple[str, nn.Parameter, Shard]]:
    """(state-dict key, parameter, shard) of the module's own sharded parameters."""
    for name, param in module.named_parameters(recurse=False):
        shard = getattr(param, "autotp_shard", None)
        if shard is not None:
            yield f"{prefix}{name}", param, shard


def _check(key: str, tensor: Any, shard: Shard, record: dict | None, local_metadata: dict) -> bool:
    """Raise unless `tensor` may load into this rank's shard; whether it is a full tensor (to cut) rather than a shard."""
    if not torch.is_tensor(tensor):
        return False
    partition, rank = shard.partition, shard.rank
    size = partition.tp_size
    if local_metadata.get("assign_to_params_buffers", False):
        raise RuntimeError(
            f"autotp: load_state_dict(assign=True) would replace the sharded parameter {key} with a "
            f"plain tensor; load without assign=True"
        )
    if record is not None and (record.get("tp_rank"), record.get("tp_size")) != (rank, size):
        raise RuntimeError(
            f"autotp: state dict tensor {key} {tuple(tensor.shape)} was saved by TP rank "
            f"{record.get('tp_rank')} of {record.get('tp_size')}, but this is TP rank {rank} of {size}: "
            f"its rows belong to another rank or layout. {_HOW}"
        )
    rows = tensor.shape[partition.dim] if tensor.dim() > partition.dim else None
    mine = partition.local_size(rank)
    if record is not None or rows is None or rows == mine == partition.full_size:
        return (
            False  # recorded as this rank's, not a tensor of this layout at all (torch names it), or whole everywhere
        )
    if rows == partition.full_size:
        return True
    holders = [r for r in range(size) if partition.runs[r] != partition.runs[rank] and partition.local_size(r) == rows]
    if rows == mine and not holders:
        return False  # only this rank's rows have this shape
    what = (
        f"TP ranks {[rank, *holders]} all hold {rows} rows"
        if rows == mine
        else f"it is TP rank {holders[0]}'s shape"
        if holders
        else f"this rank holds {mine}"
    )
    raise RuntimeError(
        f"autotp: state dict tensor {key} {tuple(tensor.shape)} has {rows} rows on dim {partition.dim} "
        f"(the full tensor has {partition.full_size}; {what}) and no record of the rank that saved it "
        f"(a state dict saved without its metadata, by safetensors say), so whose rows it holds is "
        f"unknown on TP rank {rank} of {size}. {_HOW}"
    )
