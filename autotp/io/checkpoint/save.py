"""Training checkpoints on `torch.distributed.checkpoint` (DCP): saved at one layout, loaded at any other.

    directory/
      autotp_checkpoint.json    format, the layout saved at, the user's state, the optimizer's parameter names,
                                when the save began
      config.json               the model config, so `consolidate` needs no model code
      .metadata, __R_0.distcp   DCP's index and each rank's data

Every tensor is stored at its full shape under its name in the model's `state_dict()`: weights, each optimizer
state tensor as `optimizer/NAME/KEY` (Adam's `exp_avg`, `exp_avg_sq`, `step`). Each rank writes the boxes of the full
tensors it holds (`autotp.io.checkpoint.chunks`) and no rank gathers a tensor; a load at any pp x tp x dp x ep, with
or without `autotp.fully_shard`, reads only this rank's boxes (where a dimension holds the model in parts over its
ranks, of its part: `Dimension.owned`, a pipeline's stages). The optimizer's hyperparameters, the scheduler and each
rank's random generators travel as DCP byte items. Saves are staged (`autotp.io.staging`): a crash, even during an
`async_save`, leaves the previous checkpoint in place.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import threading
import time
import warnings
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ...mesh import at_finish, global_rank, group_size, new_group, world_timeout
from ...runtime.dimension import owned_part
from ...runtime.shards import held_part
from ...state import find_state, outside_module_holders
from ..errors import CheckpointError, agree, world
from ..staging import place_now, staged_directory
from . import rng_state
from .chunks import Chunks

META = "autotp_checkpoint.json"
FORMAT = "autotp-checkpoint/2"
_KEYS = {
    FORMAT: ("tp_size", "world_size", "state", "optimizer_params"),  # what a loader reads, per format
    "autotp-checkpoint/1": ("tp_size", "world_size", "state", "partitions"),
}
_groups: dict[int, dist.ProcessGroup] = {}  # world group id -> the gloo group DCP's collectives use


def layout(model: nn.Module) -> dict[str, Any]:
    """The sizes a checkpoint records: rows of a tensor per rank follow from them."""
    state = find_state(model)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    tp = group_size(None if state is None else state.tp_group)
    record = {
        "tp_size": tp,
        "cp_size": 1,
        "ep_size": 1,
        "pp_size": 1,
        "world_size": world_size,
        "dp_size": world_size,
        "fsdp": state is not None and state.fsdp,
    }
    for dimension in [] if state is None else state.dims.values():  # cp_size, ep_size, the pipeline's size and cut
        record.update(dimension.layout())
    record["dp_size"] = world_size // (tp * record["cp_size"] * record["pp_size"])  # each stage's tensors' savers
    return record


def model_entries(model: nn.Module) -> dict[str, Chunks]:
    """Every tensor of the model's state dict as this rank's boxes of the full tensor, under its own name (where the
    model is held in parts, this rank's part: `Dimension.owned`)."""
    part, tensors = owned_part(model), model.state_dict(keep_vars=True).items()
    return {name: Chunks.of(t, held_part(t)) for name, t in tensors if part is None or part.holds(name)}


def optimizer_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The model's name for each parameter of each optimizer group (the layout-free key of its state)."""
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        missing = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if missing:
            raise ValueError(
                f"optimizer parameter group {index} holds {len(missing)} tensors that are not parameters "
                f"of the model (shapes {missing[:3]}): a checkpoint names optimizer state by parameter"
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def _optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    part = owned_part(model)  # held in parts: the state of the parameters this rank's part holds
    for group, names in zip(optimizer.param_groups, optimizer_names(model, optimizer)):
        for param, name in ((p, n) for p, n in zip(group["params"], names) if part is None or part.holds(n)):
            for key, value in optimizer.state.get(param, {}).items():
                entries[f"optimizer/{name}/{key}"] = _state_entry(name, key, value, param)
    hyper = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    entries["optimizer/param_groups"] = pickle.dumps(hyper)
    return entries


def _state_entry(name: str, key: str, value: Any, param: nn.Parameter) -> Any:
    """An optimizer state value as saved: a tensor shaped like its parameter is cut as the parameter is."""
    if not torch.is_tensor(value):
        return pickle.dumps(value)
    if value.shape == param.shape and value.dim() > 0:
        return Chunks.of(value, held_part(param))
    if value.dim() > 0 and (held_part(param) is not None or hasattr(param, "device_mesh")):
        raise NotImplementedError(
            f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, its parameter's "
            f"shard {tuple(param.shape)}: autotp checkpoints store state shaped like its "
            f"parameter (Adam, SGD momentum) or scalars, not factored state (Adafactor)"
        )
    return Chunks.of(value)


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer (one file per rank, synced), whose OS errors name the checkpoint, and a full disk as such.

    torch.save reports a write that fails inside a tensor's record as its zip writer's "[enforce fail at
    inline_container.cc] unexpected pos", with the OSError only as its context, which DCP's exchange of failures
    between ranks then drops: the OSError is found here, on the rank that failed."""

    def __init__(self, path: Path, target: str | os.PathLike):
        super().__init__(path, single_file_per_rank=True, sync_files=True)
        self.target = target

    def write_data(self, plan: Any, planner: Any) -> Any:
        with _disk_errors(self.target):
            return super().write_data(plan, planner)

    def finish(self, metadata: Metadata, results: Any) -> None:
        with _disk_errors(self.target):
            super().finish(metadata, results)


@contextmanager
def _disk_errors(target: str | os.PathLike) -> Iterator[None]:
    """An exception caused by an OSError as that OSError's errno, naming `target` (and saying when its disk is full)."""
    try:
        yield
    except Exception as err:
        cause: BaseException | None = err
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__
        if cause is None or (cause is err and cause.errno != errno.ENOSPC):
            raise
        file = f" ({cause.filename})" if cause.filename else ""
        if cause.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"the disk holding {target} is full{file}: nothing was put in place there (a "
                f"previous checkpoint stays); free space on it, or save elsewhere",
            ) from err
        raise OSError(cause.errno, f"{cause.strerror}{file}, writing {target}") from err


def checkpoint_group() -> dist.ProcessGroup | None:
    """A gloo group over the world for DCP's collectives: CPU-capable (async saves need it) and apart from training's."""
    if not dist.is_initialized():
        return None
    key = id(dist.group.WORLD)
    if key not in _groups:
        _groups.clear()
        _groups[key] = new_group(
            list(range(dist.get_world_size())), world_timeout(), "checkpoint group", backend="gloo"
        )
    return _groups[key]


def run_dcp(operation: Callable[..., Any], entries: dict[str, Any], **kwargs: Any) -> Any:
    """DCP's `save`, `async_save` or `load` over `checkpoint_group()`, or in this one process without
    torch.distributed (DCP warns that it assumes so on every call: that is the intent here)."""
    group = checkpoint_group()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled|unavailable)")
        try:
            return operation(entries, process_group=group, no_dist=group is None, **kwargs)
        except CheckpointException as err:
            raise named(err) from None


def named(err: CheckpointException) -> Exception:
    """DCP's failure (the same on every rank: its ranks gathered it) as an `OSError` with the first failure's errno,
    or a `RuntimeError`, naming each failed rank and its error; DCP's own is a BaseException that lists tracebacks."""
    failed = sorted(err.failures.items())
    message = "failed on " + "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in failed)
    code = getattr(failed[0][1][0], "errno", None) if failed else None
    return OSError(code, message) if code is not None else RuntimeError(message)


class _Pending:
    """An `async_save` being written: its future and the staged directory it is put in place from. DCP's write
    succeeds only once every rank's data and the index are written (its ranks exchange outcomes in the write's thread,
    over `checkpoint_group()`), so global rank 0 puts it in place as soon as its write completes (`place_now`, from
    that thread: no collective of training's). `wait` exchanges the outcome, raising a failure on every rank."""

    def __init__(self, future: Any, staging: ExitStack, tmp: Path, target: Path):
        self.future, self.staging = future, staging
        self.placed = threading.Event()  # rank 0's completion callback has run (the others have none)
        if global_rank() == 0:
            future.add_done_callback(lambda done: self._place(done, tmp, target))
        else:
            self.placed.set()

    def _place(self, done: Any, tmp: Path, target: Path) -> None:
        try:
            if not done.cancelled() and done.exception() is None:
                place_now(tmp, target)
        finally:
            self.placed.set()

    def wait(self) -> None:
        try:
            try:
                self.future.result()
            except CheckpointException as err:
                raise named(err) from None
            finally:  # the future runs its callbacks after waking those waiting for its result
                self.placed.wait()
        except BaseException as err:  # the staging exit tells every rank, and removes what was written
            if not self.staging.__exit__(type(err), err, err.__traceback__):
                raise
        else:
            self.staging.close()


_pending: list[_Pending] = []


def wait_for_pending() -> None:
    """Block until an `async_save` in progress is written and in place (collective, like the save)."""
    while _pending:
        _pending.pop().wait()


at_finish(wait_for_pending)


class _Copied:
    """DCP's `AsyncStager`: our boxes copied to CPU memory (`Chunks.snapshot`), so training may change the model."""

    _synchronize_after_execute = False
    should_synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: v.snapshot() if isinstance(v, Chunks) else v for k, v in state_dict.items()}

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any = None,
    *,
    overwrite: bool = False,
    async_save: bool = False,
    **state: Any,
) -> None:
    """Save everything needed to resume, at this layout or any other; call on every rank. `state` must be JSON.

    A non-empty `directory` is replaced only with `overwrite=True`, and only once the new one is complete.
    A failure on any rank (a full disk, say) is raised on every rank and leaves the previous one in place.
    `async_save=True` returns once this rank's tensors are copied to CPU memory and writes in the background; the
    checkpoint is put in place as soon as every rank's write completed (a process killed after that keeps it), and
    the next save, load, `latest_checkpoint` or `autotp.finish()` waits for it (and raises its failure, on every
    rank).
    """
    try:
        json.dumps(state)
    except TypeError as err:
        raise TypeError(f"save_checkpoint: the user state must be JSON-serialisable ({err})") from None
    write(directory, model, optimizer, scheduler, state, overwrite=overwrite, async_save=async_save)


def write(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    *,
    overwrite: bool,
    async_save: bool = False,
    weights: bool = True,
    rng: bool = True,
    what: str = "autotp.save_checkpoint",
) -> None:
    """`save_checkpoint`, of which a caller that saves the weights and random state apart (AutoTPTrainer, beside
    Trainer's own files) may leave those out (`weights=False`, `rng=False`)."""
    wait_for_pending()
    model = outside_module_holders(model)
    tp_state, part = find_state(model), owned_part(model)  # `part`: the names this rank saves, where held in parts
    if tp_state is not None:
        tp_state.refuse_gathered(what)
    record, names, group = layout(model), optimizer_names(model, optimizer), checkpoint_group()
    meta = {
        "format": FORMAT,
        **record,
        "model_class": type(model).__name__,
        "state": state,  # the optimizer's names as one process's holds them (held in parts: gathered over the world)
        "optimizer_params": names if part is None else part.optimizer_names(names, group),
        "scheduler": scheduler is not None,
        "weights": weights,
        "rng": rng,
        "saved_at": time.time(),
    }  # when it began: latest_checkpoint's order
    staging = ExitStack()
    tmp = staging.enter_context(staged_directory(directory, overwrite, what=what))
    try:
        entries = _entries(model, optimizer, scheduler, weights, rng, what)
        if global_rank() == 0:
            (tmp / META).write_text(json.dumps(meta, indent=1))
            if getattr(model, "config", None) is not None:
                model.config.save_pretrained(tmp)
        writer = _Writer(tmp, directory)
        if async_save:
            future = run_dcp(dcp.async_save, entries, storage_writer=writer, async_stager=_Copied())
            _pending.append(_Pending(future, staging, tmp, Path(directory)))
            return
        run_dcp(dcp.save, entries, storage_writer=writer)
    except BaseException as err:
        if not staging.__exit__(type(err), err, err.__traceback__):
            raise
        return
    staging.close()


def _entries(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, weights: bool, rng: bool, what: str
) -> dict[str, Any]:
    """What this rank saves; a failure to describe it on any rank is raised on every rank before DCP's collectives."""
    entries: dict[str, Any] = {}
    error = None
    try:
        entries = {**(model_entries(model) if weights else {}), **_optimizer_entries(model, optimizer)}
        if rng:
            entries[f"rng/{global_rank()}"] = pickle.dumps(rng_state.capture())
        if scheduler is not None:
            entries["scheduler"] = pickle.dumps(scheduler.state_dict())
    except Exception as err:  # every rank must still reach the agreement below
        error = err
    agree(error, world(), what)
    return entries


def read_meta(directory: Path) -> dict[str, Any]:
    """The checkpoint's `autotp_checkpoint.json`, checked to be one (of either format)."""
    meta_file = directory / META
    if not meta_file.is_file():
        raise CheckpointError(f"{directory}: not an autotp training checkpoint (no {META})")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{meta_file}: cannot be read as JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") not in _KEYS:
        raise CheckpointError(
            f"{meta_file}: unknown format {meta.get('format') if isinstance(meta, dict) else meta!r}, "
            f"expected {FORMAT!r}"
        )
    missing = [key for key in _KEYS[meta["format"]] if key not in meta]
    if missing:
        raise CheckpointError(f"{meta_file}: missing the key {missing[0]!r}")
    return meta


def read_index(directory: Path) -> Metadata:
    """DCP's metadata, and a check that every data file it names exists and holds the bytes it places there."""
    try:
        metadata = dcp.FileSystemReader(directory).read_metadata()
    except Exception as err:
        raise CheckpointError(f"{directory / '.metadata'}: cannot be read ({type(err).__name__}: {err})") from None
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{file}: missing (the checkpoint's metadata places {end} bytes in it)")
        if file.stat().st_size < end:
            raise CheckpointError(
                f"{file}: {file.stat().st_size} bytes, the checkpoint's metadata places data up "
                f"to byte {end} (a truncated file)"
            )
    return metadata
