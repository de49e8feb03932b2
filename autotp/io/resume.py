"""Resumable training checkpoints: per-rank shards of model and optimizer, RNG states and user state.

    directory/
      autotp_checkpoint.json    tp / world sizes, step and user state, each sharded tensor's partition
      config.json               the model config, so `consolidate` needs no model code
      rank-00000/model.safetensors, optimizer.safetensors, rng.safetensors, state.json

Everything is written into a hidden sibling directory that replaces `directory` only when every rank
has finished, so a crash during a save leaves the previous checkpoint loadable. Loading reads and
checks every rank's files before anything changes, and `consolidate` before anything is written,
so a damaged checkpoint fails on every rank and changes nothing. Per-rank files
only load at the same tp and world size; `consolidate` turns them into a full HF checkpoint that
`autotp.from_pretrained` loads at any tp.
"""

from __future__ import annotations

import json
import os
import random
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..compat.hf import build_model
from ..parallel.dtensor_rows import dp_chunk, local_rows
from ..parallel.groups import global_rank, group_size
from ..planning.sharding import Partition
from ..parallel.state import find_state
from .errors import CheckpointError, describe, failures, world
from .safetensors import NAMES, open_tensors, read_header, read_tensors, write_tensors
from .save import write_hf_checkpoint
from .staging import staged_directory

_META = "autotp_checkpoint.json"
_FORMAT = "autotp-checkpoint/1"


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own data of a tensor: under FSDP (`autotp.fully_shard`), its DP rows of its TP shard."""
    return local_rows(tensor)[0]


def _rank_dir(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}"


def _layout(model: nn.Module) -> dict[str, Any]:
    state = find_state(model)
    size = dist.get_world_size() if dist.is_initialized() else 1
    return {"tp_size": group_size(None if state is None else state.tp_group), "world_size": size,
            "fsdp": state is not None and state.fsdp}


def save_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: Any = None, *, overwrite: bool = False, **state: Any) -> None:
    """Save everything needed to resume exactly; call on every rank. `state` must be JSON-serialisable.

    A non-empty `directory` is replaced only with `overwrite=True`, and only once the new one is complete.
    A failure on any rank (a full disk, say) is raised on every rank and leaves the previous one in place.
    """
    rank = global_rank()
    try:
        json.dumps(state)
    except TypeError as err:
        raise TypeError(f"save_checkpoint: the user state must be JSON-serialisable ({err})") from None
    with staged_directory(directory, overwrite, what="autotp.save_checkpoint") as tmp:
        mine = _rank_dir(tmp, rank)
        mine.mkdir()
        write_tensors({name: _local(t) for name, t in model.state_dict().items()}, mine / "model.safetensors")
        tensors, rest = _split_optimizer(optimizer.state_dict())
        write_tensors(tensors, mine / "optimizer.safetensors")
        rng_tensors, rng_rest = _rng_state()
        write_tensors(rng_tensors, mine / "rng.safetensors")
        rank_state = {"optimizer": rest, "rng": rng_rest,
                      "scheduler": None if scheduler is None else scheduler.state_dict()}
        (mine / "state.json").write_text(json.dumps(rank_state))
        if rank == 0:
            kept = model.state_dict(keep_vars=True)
            partitions = {name: p.autotp_shard.partition.to_json() for name, p in kept.items()
                          if hasattr(p, "autotp_shard")}
            meta = {"format": _FORMAT, **_layout(model), "model_class": type(model).__name__,
                    "state": state, "partitions": partitions,
                    "dp_rows": sorted(name for name, p in kept.items() if isinstance(p, DTensor))}
            (tmp / _META).write_text(json.dumps(meta, indent=1))
            if getattr(model, "config", None) is not None:
                model.config.save_pretrained(tmp)


def load_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None) -> dict[str, Any]:
    """Restore model shards, optimizer, scheduler and RNG states in place; returns the user state. Call on every rank.

    Every rank reads and checks all of its files before anything changes, and the ranks agree on
    the outcome: if any rank's files are missing, truncated or do not fit the model, every rank
    raises `CheckpointError` and no rank's model, optimizer or RNG has changed.
    """
    directory = Path(directory)
    error = None
    try:
        restore = _read_rank(directory, model, optimizer, scheduler)
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
    return restore()


def _read_rank(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               scheduler: Any) -> Callable[[], dict[str, Any]]:
    """Read and check this rank's files; returns what applies them, which can no longer fail on bad files."""
    meta = read_meta(directory)
    here = _layout(model)
    if meta.get("fsdp", False) != here["fsdp"]:
        saved, now = ("with", "without") if meta.get("fsdp", False) else ("without", "with")
        raise CheckpointError(f"{directory} was saved {saved} autotp.fully_shard and this model is {now} it; per-rank "
                              f"files hold different rows then. Apply the same sharding before loading, or run "
                              f"`python -m autotp consolidate {directory} FULL_DIR` and load that")
    if (meta["tp_size"], meta["world_size"]) != (here["tp_size"], here["world_size"]):
        raise CheckpointError(
            f"{directory} was saved at tp={meta['tp_size']} on {meta['world_size']} ranks; this run has "
            f"tp={here['tp_size']} on {here['world_size']} ranks. Per-rank checkpoints load only at the same sizes: "
            f"run `python -m autotp consolidate {directory} FULL_DIR`, then "
            f"autotp.from_pretrained(FULL_DIR, tp_size={here['tp_size']})."
        )
    mine = _rank_dir(directory, global_rank())
    saved = read_tensors(mine / "model.safetensors")
    current = {name: _local(t) for name, t in model.state_dict().items()}
    for name, tensor in current.items():
        if name not in saved:
            raise CheckpointError(f"{mine / 'model.safetensors'}: tensor {name} is missing")
        if tuple(saved[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{mine / 'model.safetensors'}: tensor {name} has shape {tuple(saved[name].shape)}, "
                                  f"the model holds {tuple(tensor.shape)}")
    rank_state = _read_json(mine / "state.json", ("optimizer", "rng", "scheduler"))
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = _join_optimizer(read_tensors(mine / "optimizer.safetensors"), rank_state["optimizer"])
        groups = [len(g["params"]) for g in optimizer_state["param_groups"]]
        if groups != [len(g["params"]) for g in optimizer.param_groups]:
            raise CheckpointError(f"{mine / 'state.json'}: the saved optimizer has parameter groups of {groups} "
                                  f"parameters, this one {[len(g['params']) for g in optimizer.param_groups]}")
    rng = read_tensors(mine / "rng.safetensors")
    if "torch" not in rng or "python" not in rank_state["rng"]:
        raise CheckpointError(f"{mine}: the RNG state is incomplete (rng.safetensors holds {sorted(rng)}, state.json "
                              f"{sorted(rank_state['rng'])})")

    def restore() -> dict[str, Any]:
        with torch.no_grad():
            for name, tensor in current.items():
                tensor.copy_(saved[name])
        if optimizer_state is not None:
            optimizer.load_state_dict(as_params(optimizer_state, optimizer))
        if scheduler is not None and rank_state["scheduler"] is not None:
            scheduler.load_state_dict(rank_state["scheduler"])
        _set_rng_state(rng, rank_state["rng"])
        return meta["state"]

    return restore


def read_meta(directory: Path) -> dict[str, Any]:
    """The checkpoint's `autotp_checkpoint.json`, checked to be one."""
    meta_file = directory / _META
    if not meta_file.is_file():
        raise CheckpointError(f"{directory}: not an autotp training checkpoint (no {_META})")
    meta = _read_json(meta_file, ())
    if meta.get("format") != _FORMAT:
        raise CheckpointError(f"{meta_file}: unknown format {meta.get('format')!r}, expected {_FORMAT!r}")
    return meta


def _read_json(file: Path, keys: tuple[str, ...]) -> dict[str, Any]:
    """A JSON object from `file` holding `keys`, or a `CheckpointError` that names the file."""
    try:
        content = json.loads(file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{file}: missing") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{file}: cannot be read as JSON ({err})") from None
    if not isinstance(content, dict) or not set(keys) <= content.keys():
        raise CheckpointError(f"{file}: expected a JSON object with the keys {list(keys)}")
    return content


def _split_optimizer(state: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, plain = {}, {}
    for index, entry in state["state"].items():
        plain[str(index)] = {}
        for key, value in entry.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = _local(value.detach()).contiguous().cpu()
            else:
                plain[str(index)][key] = value
    return tensors, {"state": plain, "param_groups": state["param_groups"]}


def local_optimizer_state(state: dict) -> dict:
    """An optimizer `state_dict()` with this rank's own data in place of DTensors (FSDP), for torch.save."""
    return {**state, "state": {index: {key: _local(value) if torch.is_tensor(value) else value
                                       for key, value in entry.items()} for index, entry in state["state"].items()}}


def as_params(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """Saved per-parameter states held as their parameter is: FSDP's DTensors again, from this rank's rows."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in state["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            for key, value in entry.items():
                if torch.is_tensor(value) and value.shape == param.to_local().shape and value.dim() > 0:
                    entry[key] = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                                    run_check=False, shape=param.shape, stride=param.stride())
    return state


def _join_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict] = {int(i): dict(entry) for i, entry in rest["state"].items()}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    return {"state": state, "param_groups": rest["param_groups"]}


def _rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda.{i}"] = s
    version, internal, gauss = random.getstate()
    rest: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        rest["numpy"] = [name, keys.tolist(), pos, has_gauss, cached]
    except ImportError:
        pass
    return tensors, rest


def _set_rng_state(tensors: dict[str, torch.Tensor], rest: dict) -> None:
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    version, internal, gauss = rest["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in rest:
        import numpy as np

        name, keys, pos, has_gauss, cached = rest["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, max_shard_size: int | str = "5GB",
                overwrite: bool = False) -> None:
    """A full HF checkpoint from a per-rank one, in one process: shards are reassembled from their partitions.

    Every rank's model file is checked first (present, complete, and holding every tensor with its
    rank's shape), so that a damaged checkpoint raises `CheckpointError` before anything is written.

    It is not collective, and it refuses to run inside a distributed job (torch.distributed initialised on
    more than one rank), at once: there the write would wait for every rank, so a call from rank 0 alone
    would block until the process group's timeout. Run it after the job (`python -m autotp consolidate`),
    or save a full checkpoint from inside the job with `autotp.save_pretrained` on every rank.
    """
    _refuse_inside_a_job(checkpoint, out)
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    checkpoint = Path(checkpoint)
    meta = read_meta(checkpoint)
    tp, world_size = meta["tp_size"], meta["world_size"]
    config = AutoConfig.from_pretrained(checkpoint)
    if not getattr(config, "architectures", None) and meta.get("model_class"):
        config.architectures = [meta["model_class"]]  # a model built from a config: the class save_checkpoint saw
    files = [_rank_dir(checkpoint, r) / "model.safetensors" for r in range(world_size)]
    headers = [_model_header(file) for file in files]
    with init_empty_weights():  # the checkpoint's own class (config.architectures), as autotp.from_pretrained builds
        model = build_model(config, dtype=NAMES[next(iter(headers[0].values()))["dtype"]])
    model.tie_weights()
    partitions = {name: Partition.from_json(p) for name, p in meta["partitions"].items()}
    dp_rows, dp = set(meta.get("dp_rows", ())), world_size // tp  # FSDP: each rank saved its DP rows of its TP shard
    params = model.state_dict(keep_vars=True)
    for rank, (file, header) in enumerate(zip(files, headers)):
        for name, tensor in params.items():
            expected = list(tensor.shape)
            if name in partitions:
                expected[partitions[name].dim] = partitions[name].local_size(rank % tp)
            if name in dp_rows:
                expected[0] = dp_chunk(expected[0], dp, rank // tp)[1]
            if name not in header:
                raise CheckpointError(f"{file}: tensor {name} is missing")
            if header[name]["shape"] != expected:
                raise CheckpointError(f"{file}: tensor {name} has shape {tuple(header[name]['shape'])}, rank {rank} "
                                      f"of this config holds {tuple(expected)}")
    with ExitStack() as stack:  # one open file per rank that holds a part; tensors are read one at a time
        handles = [stack.enter_context(open_tensors(file)) for file in files[:tp * dp if dp_rows else tp]]

        def tp_shard(name: str, tp_rank: int) -> torch.Tensor:
            if name in dp_rows:
                return torch.cat([handles[d * tp + tp_rank].get_tensor(name) for d in range(dp)])
            return handles[tp_rank].get_tensor(name)

        def fetch(name: str) -> torch.Tensor:
            if name in partitions:
                return partitions[name].unshard([tp_shard(name, t) for t in range(tp)])
            return tp_shard(name, 0)

        with staged_directory(out, overwrite, what="autotp.consolidate") as tmp:
            write_hf_checkpoint(model, params, fetch, tmp, max_shard_size)


def _refuse_inside_a_job(checkpoint: str | os.PathLike, out: str | os.PathLike) -> None:
    """`consolidate` runs in one process: raise before anything is read when torch.distributed runs on several ranks."""
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks > 1:
        raise RuntimeError(f"autotp.consolidate runs in one process, and torch.distributed is running here on {ranks} "
                           f"ranks (rank {global_rank()}), where writing {out} would wait for every rank. Run "
                           f"`python -m autotp consolidate {checkpoint} {out}` after the job, or call "
                           f"autotp.save_pretrained(model, {str(out)!r}) on every rank inside it")


def _model_header(file: Path) -> dict[str, dict]:
    """A rank's model file's validated header (tensors only)."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    header = read_header(file)[0]
    if not header:
        raise CheckpointError(f"{file}: holds no tensors")
    return header
