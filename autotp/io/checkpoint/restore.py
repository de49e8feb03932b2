"""Loading a training checkpoint (`autotp.io.checkpoint.save`) at any layout: every rank reads the boxes it holds.

Nothing changes before every rank has checked the checkpoint: DCP's metadata parses, each data
file exists and is as long as the metadata says, every tensor of the model is there at its full
shape, and the optimizer names the same parameters. A failure on any rank is raised on every rank.
Then DCP reads each rank's boxes into the model's own storage, and into fresh optimizer state that
`optimizer.load_state_dict` takes once everything is read.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ...mesh import global_rank, group_rank
from ...runtime.dimension import owned_part
from ...runtime.shards import held_part
from ...state import find_state, outside_module_holders
from ..errors import CheckpointError, describe, failures, world
from . import legacy, rng_state
from .save import (
    FORMAT,
    Chunks,
    layout,
    model_entries,
    optimizer_names,
    read_index,
    read_meta,
    run_dcp,
    wait_for_pending,
)

_LAYOUT = ("tp_size", "world_size", "fsdp", "cp_size", "pp_size")
_BEFORE = {"pp_size": 1}  # what a checkpoint saved before a size was recorded was saved at
_PARTS = ("pp_size",)  # the record's sizes at which each rank saved only its part of the names (`Dimension.owned`)


def load_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
) -> dict[str, Any]:
    """Restore the model, optimizer, scheduler and random state saved by `save_checkpoint`, at this run's layout,
    whatever the layout it was saved at; returns the user state. Call on every rank.

    Every rank checks the checkpoint before anything changes; a failure on any rank raises
    `CheckpointError` on every rank and leaves every model, optimizer and generator as it was.
    Random generators are restored exactly at the layout saved at, and re-seeded deterministically at
    another (`autotp.io.checkpoint.rng_state`).
    """
    return read(directory, model, optimizer, scheduler)


def read(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    *,
    weights: bool = True,
) -> dict[str, Any]:
    """`load_checkpoint`, of which a caller that loads the weights apart (AutoTPTrainer, from the full checkpoint
    beside) may leave them out (`weights=False`); the random state is restored when the checkpoint holds it."""
    wait_for_pending()
    directory, model = Path(directory), outside_module_holders(model)
    error, plan = None, None
    try:
        meta, part = read_meta(directory), owned_part(model)
        if meta["format"] != FORMAT and part is not None:
            raise CheckpointError(
                f"{directory}: a per-rank checkpoint of format {meta['format']!r} loads at the layout it was saved "
                f"at, never {part.where}; load it at {part.whole} and save it again with autotp.save_checkpoint"
            )
        plan = (
            legacy.Reader(directory, meta, model, optimizer, scheduler)
            if meta["format"] != FORMAT
            else _Reader(directory, meta, model, optimizer, scheduler, weights)
        )
    except CheckpointError as err:  # every rank must still reach the agreement below
        error = err
    except Exception as err:
        error = CheckpointError(f"{directory}: {type(err).__name__}: {err}")
        error.__cause__ = err
    failed = failures(error, world())
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"{directory}: nothing was loaded, as loading failed on {describe(failed)}")
    assert plan is not None  # always: the try either built it or set error, raised above
    return plan.restore()


class _Reader:
    """What this rank reads from a DCP checkpoint, checked before anything is read, and how it is applied."""

    def __init__(
        self,
        directory: Path,
        meta: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
        weights: bool,
    ):
        self.directory, self.meta, self.model, self.optimizer, self.scheduler = (
            directory,
            meta,
            model,
            optimizer,
            scheduler,
        )
        state = find_state(model)
        if state is not None:
            state.refuse_gathered("autotp.load_checkpoint")
        if weights and not meta.get("weights", True):
            raise CheckpointError(
                f"{directory}: holds the optimizer state alone (an AutoTPTrainer checkpoint's "
                f"optimizer/); load the model from the full checkpoint beside it"
            )
        index, self.part = read_index(directory), owned_part(model)  # `part`: held in parts, what this rank loads
        self.entries: dict[str, Any] = {}  # DCP key -> what it is read into (built apart: it holds b"" too)
        if weights:
            self.entries.update(model_entries(model))
            self._check_model(index)
        self.same_layout = all(meta.get(k, _BEFORE.get(k)) == v for k, v in layout(model).items() if k in _LAYOUT)
        self.rng_key = f"rng/{global_rank() if self.same_layout else 0}" if meta.get("rng", True) else None
        if self.rng_key is not None:
            self.entries[self.rng_key] = b""
        # the replica's index: its TP and CP ranks draw alike (wrap aligns them), replicas apart
        self.dp_rank = global_rank() if state is None else group_rank(state.dp_group)
        self.optimizer_state: dict[str, dict[str, str]] = {}  # parameter name -> state key -> DCP key
        self.fresh: dict[str, torch.Tensor] = {}  # DCP key -> the new optimizer state tensor it is read into
        self.current: list[list[str]] = []  # this optimizer's parameter names, by group
        if optimizer is not None:
            self._plan_optimizer(index)
        if scheduler is not None and meta.get("scheduler"):
            self.entries["scheduler"] = b""

    def _check_model(self, index: Metadata) -> None:
        saved = {k for k in index.state_dict_metadata if not k.startswith(("optimizer/", "rng/", "scheduler"))}
        missing = sorted(self.entries.keys() - saved)  # held in parts: what other ranks load is not extra here
        extra = sorted(k for k in saved - self.entries.keys() if self.part is None or not self.part.elsewhere(k))
        if missing or extra:
            raise CheckpointError(
                f"{self.directory}: the checkpoint does not hold this model's tensors "
                f"(missing: {missing[:5]}{' ...' if len(missing) > 5 else ''}; not in the model: "
                f"{extra[:5]}{' ...' if len(extra) > 5 else ''}); it was saved from a "
                f"{self.meta.get('model_class')}, this is a {type(self.model).__name__}"
            )
        for name, chunks in self.entries.items():
            md = index.state_dict_metadata[name]
            if isinstance(md, BytesStorageMetadata) or md.size != chunks.size():
                shape = "no tensor" if isinstance(md, BytesStorageMetadata) else f"shape {tuple(md.size)}"
                raise CheckpointError(
                    f"{self.directory}: tensor {name} has {shape} in the checkpoint, the model's "
                    f"full tensor has shape {tuple(chunks.size())}"
                )

    def _plan_optimizer(self, index: Metadata) -> None:
        saved, current = self.meta.get("optimizer_params"), optimizer_names(self.model, self.optimizer)
        self.current = current
        if self.part is not None or any(self.meta.get(size, 1) > 1 for size in _PARTS):  # matched by name
            self._check_parts(saved or [], current)
        elif saved != current:
            sizes = [len(g) for g in saved] if isinstance(saved, list) else None
            first = next(
                (
                    f"group {g}, position {i}: {a!r} saved, {b!r} here"
                    for g, (sg, cg) in enumerate(zip(saved or [], current))
                    for i, (a, b) in enumerate(zip(sg, cg))
                    if a != b
                ),
                "",
            )
            raise CheckpointError(
                f"{self.directory}: the optimizer was saved with parameter groups of {sizes} "
                f"parameters, this one has {[len(g) for g in current]}{'; ' if first else ''}{first}"
            )
        by_param: dict[str, dict[str, Any]] = {}
        for fqn, md in index.state_dict_metadata.items():
            if fqn.startswith("optimizer/") and fqn != "optimizer/param_groups":
                name, key = fqn[len("optimizer/") :].rsplit("/", 1)
                by_param.setdefault(name, {})[key] = (fqn, md)
        params = dict(self.model.named_parameters())
        for name in (n for group in self._trained(current) for n in group):
            for key, (fqn, md) in by_param.get(name, {}).items():
                self.optimizer_state.setdefault(name, {})[key] = fqn
                if isinstance(md, BytesStorageMetadata):
                    self.entries[fqn] = b""
                else:
                    self.fresh[fqn], self.entries[fqn] = _fresh(params[name], md.size, md.properties.dtype, fqn)
        self.entries["optimizer/param_groups"] = b""

    def _trained(self, names: list[list[str]]) -> list[list[str]]:
        """The parameters of each optimizer group whose state this rank loads (held in parts: its part's)."""
        return names if self.part is None else self.part.trained(names)

    def _check_parts(self, saved: list[list[str]], current: list[list[str]]) -> None:
        """Saved or loaded in parts (a pipeline's stages): each group of this rank's optimizer trains parameters of
        one group of the saved one (held whole: all of them). Parameters are matched by name, so another cut reads
        them."""
        if len(saved) != len(current):
            raise CheckpointError(
                f"{self.directory}: the optimizer was saved with {len(saved)} parameter groups, this one has "
                f"{len(current)}"
            )
        at = ", ".join(f"{size}={self.meta.get(size, 1)}" for size in _PARTS)
        for index, (names, kept) in enumerate(zip(saved, self._trained(current))):
            absent = sorted(set(kept) - set(names)) or (sorted(set(names) - set(kept)) if self.part is None else [])
            if absent:
                raise CheckpointError(
                    f"{self.directory}: optimizer parameter group {index} (of {len(saved)} saved at {at}) does not "
                    f"hold the same parameters here: {absent[:3]} in one and not the other"
                )

    def restore(self) -> dict[str, Any]:
        try:
            run_dcp(dcp.load, self.entries, storage_reader=dcp.FileSystemReader(self.directory))
        except Exception as err:
            raise CheckpointError(f"{self.directory}: reading failed ({type(err).__name__}: {err})") from err
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer_state_dict())
        if "scheduler" in self.entries:
            self.scheduler.load_state_dict(pickle.loads(self.entries["scheduler"]))
        if self.rng_key is not None:
            saved_rng = pickle.loads(self.entries[self.rng_key])
            if self.same_layout:
                rng_state.restore(saved_rng)
            else:
                rng_state.reseed(saved_rng, self.dp_rank)
        return self.meta["state"]

    def _optimizer_state_dict(self) -> dict[str, Any]:
        names = [n for group in self.current for n in group]  # this optimizer's order, matched by name
        state = {}
        for index, name in enumerate(names):
            entry = {}
            for key, fqn in self.optimizer_state.get(name, {}).items():
                entry[key] = self.fresh[fqn] if fqn in self.fresh else pickle.loads(self.entries[fqn])
            if entry:
                state[index] = entry
        groups, start = [], 0
        for hyper, held in zip(pickle.loads(self.entries["optimizer/param_groups"]), self.current):
            groups.append({**hyper, "params": list(range(start, start + len(held)))})
            start += len(held)
        return {"state": state, "param_groups": groups}


def _fresh(param: nn.Parameter, size: torch.Size, dtype: torch.dtype, fqn: str) -> tuple[torch.Tensor, Chunks]:
    """A zero tensor for saved state of full shape `size`: shaped and cut like `param` when `size` is its full shape."""
    shard = held_part(param)
    full = torch.Size(shard.full_shape(param.shape) if shard is not None else param.shape)
    if size == full and len(size) > 0:
        tensor = torch.zeros_like(param.detach(), dtype=dtype)
        return tensor, Chunks.of(tensor, shard)
    if len(size) > 0 and (shard is not None or hasattr(param, "device_mesh")):
        raise CheckpointError(
            f"optimizer state {fqn} has shape {tuple(size)}, its parameter {tuple(full)}: only "
            f"state shaped like its parameter, or scalars, can be re-cut for a sharded parameter"
        )
    tensor = torch.zeros(size, dtype=dtype)
    return tensor, Chunks.of(tensor)
