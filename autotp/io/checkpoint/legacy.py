"""Per-rank training checkpoints of the first format (`autotp-checkpoint/1`), from autotp before DCP checkpoints.

    directory/
      autotp_checkpoint.json    tp / world sizes, step and user state, each sharded tensor's partition
      config.json               the model config, so `consolidate` needs no model code
      rank-00000/model.safetensors, optimizer.safetensors, rng.safetensors, state.json

They still load at the tp and world size they were saved at, and `python -m autotp consolidate`
turns them into a full HF checkpoint that loads at any tp. Nothing writes this format any more.
"""

from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ...mesh import global_rank
from ...planning.placement import Placement
from ...planning.sharding import Partition
from ...runtime.rows import local_rows
from ..errors import CheckpointError
from ..hf.safetensors import NAMES, open_tensors, read_header, read_tensors
from . import rng_state
from .save import layout


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own data of a tensor: under FSDP (`autotp.fully_shard`), its DP rows of its TP shard."""
    return local_rows(tensor)[0]


def _rank_dir(directory: Path, rank: int) -> Path:
    return directory / f"rank-{rank:05d}"


class Reader:
    """This rank's files, read and checked before anything changes; `restore` applies them and cannot fail on bad files.

    A checkpoint of this format loads only at the layout it was saved at: another layout is refused
    with the command that converts it (`consolidate`, then `autotp.from_pretrained`)."""

    def __init__(
        self,
        directory: Path,
        meta: dict[str, Any],
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
    ):
        here = layout(model)
        if meta.get("fsdp", False) != here["fsdp"]:
            saved, now = ("with", "without") if meta.get("fsdp", False) else ("without", "with")
            raise CheckpointError(
                f"{directory} was saved {saved} autotp.fully_shard and this model is {now} it; "
                f"per-rank files of this older format hold different rows then. Apply the same "
                f"sharding before loading, or run `python -m autotp consolidate {directory} "
                f"FULL_DIR` and load that"
            )
        if (meta["tp_size"], meta["world_size"]) != (here["tp_size"], here["world_size"]):
            raise CheckpointError(
                f"{directory} was saved at tp={meta['tp_size']} on {meta['world_size']} ranks; this run has "
                f"tp={here['tp_size']} on {here['world_size']} ranks. Per-rank checkpoints of this older format load "
                f"only at the same sizes: run `python -m autotp consolidate {directory} FULL_DIR`, then "
                f"autotp.from_pretrained(FULL_DIR, tp_size={here['tp_size']})."
            )
        self.meta, self.model, self.optimizer, self.scheduler = meta, model, optimizer, scheduler
        mine = _rank_dir(directory, global_rank())
        self.saved = read_tensors(mine / "model.safetensors")
        self.current = {name: _local(t) for name, t in model.state_dict().items()}
        for name, tensor in self.current.items():
            if name not in self.saved:
                raise CheckpointError(f"{mine / 'model.safetensors'}: tensor {name} is missing")
            if tuple(self.saved[name].shape) != tuple(tensor.shape):
                raise CheckpointError(
                    f"{mine / 'model.safetensors'}: tensor {name} has shape "
                    f"{tuple(self.saved[name].shape)}, the model holds {tuple(tensor.shape)}"
                )
        self.rank_state = _read_json(mine / "state.json", ("optimizer", "rng", "scheduler"))
        self.optimizer_state = None
        if optimizer is not None:
            self.optimizer_state = _join_optimizer(
                read_tensors(mine / "optimizer.safetensors"), self.rank_state["optimizer"]
            )
            groups = [len(g["params"]) for g in self.optimizer_state["param_groups"]]
            if groups != [len(g["params"]) for g in optimizer.param_groups]:
                raise CheckpointError(
                    f"{mine / 'state.json'}: the saved optimizer has parameter groups of {groups} "
                    f"parameters, this one {[len(g['params']) for g in optimizer.param_groups]}"
                )
        self.rng = read_tensors(mine / "rng.safetensors")
        if "torch" not in self.rng or "python" not in self.rank_state["rng"]:
            raise CheckpointError(
                f"{mine}: the RNG state is incomplete (rng.safetensors holds {sorted(self.rng)}, "
                f"state.json {sorted(self.rank_state['rng'])})"
            )

    def restore(self) -> dict[str, Any]:
        with torch.no_grad():
            for name, tensor in self.current.items():
                tensor.copy_(self.saved[name])
        if self.optimizer is not None and self.optimizer_state is not None:  # read only with an optimizer
            self.optimizer.load_state_dict(as_params(self.optimizer_state, self.optimizer))
        if self.scheduler is not None and self.rank_state["scheduler"] is not None:
            self.scheduler.load_state_dict(self.rank_state["scheduler"])
        _set_rng_state(self.rng, self.rank_state["rng"])
        return self.meta["state"]


def check_files(directory: Path, meta: dict[str, Any]) -> None:
    """Raise a `CheckpointError` naming the first file a rank's `Reader` needs that is missing."""
    for rank in range(meta["world_size"]):
        for name in ("model.safetensors", "rng.safetensors", "state.json"):
            if not (_rank_dir(directory, rank) / name).is_file():
                raise CheckpointError(f"{_rank_dir(directory, rank) / name}: missing")


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


def local_optimizer_state(state: dict) -> dict:
    """An optimizer `state_dict()` with this rank's own data in place of DTensors (FSDP), for torch.save."""
    return {
        **state,
        "state": {
            index: {key: _local(value) if torch.is_tensor(value) else value for key, value in entry.items()}
            for index, entry in state["state"].items()
        },
    }


def as_params(state: dict, optimizer: torch.optim.Optimizer) -> dict:
    """Saved per-parameter states held as their parameter is: FSDP's DTensors again, from this rank's rows."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, entry in state["state"].items():
        param = params[index]
        if isinstance(param, DTensor):
            for key, value in entry.items():
                if torch.is_tensor(value) and value.shape == param.to_local().shape and value.dim() > 0:
                    entry[key] = DTensor.from_local(
                        value.to(param.device),
                        param.device_mesh,
                        param.placements,
                        run_check=False,
                        shape=param.shape,
                        stride=param.stride(),
                    )
    return state


def _join_optimizer(tensors: dict[str, torch.Tensor], rest: dict) -> dict:
    state: dict[int, dict] = {int(i): dict(entry) for i, entry in rest["state"].items()}
    for name, tensor in tensors.items():
        index, key = name.split(".", 1)
        state.setdefault(int(index), {})[key] = tensor
    return {"state": state, "param_groups": rest["param_groups"]}


def _set_rng_state(tensors: dict[str, torch.Tensor], rest: dict) -> None:
    version, internal, gauss = rest["python"]
    state: dict[str, Any] = {
        "torch": tensors["torch"],
        "python": (version, tuple(internal), gauss),
        "cuda": [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda.")), key=lambda k: int(k[5:]))],
    }
    if "numpy" in rest:
        import numpy as np

        name, keys, pos, has_gauss, cached = rest["numpy"]
        state["numpy"] = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    rng_state.restore(state)


@contextmanager
def full_tensors(checkpoint: Path, meta: dict[str, Any], params: dict[str, torch.Tensor]) -> Iterator[Callable]:
    """`fetch(name)`: a full tensor reassembled from the ranks' files, one at a time, after every rank's model file
    is checked (present, complete, and holding every tensor of `params` with its rank's shape)."""
    tp, world_size = meta["tp_size"], meta["world_size"]
    files = [_rank_dir(checkpoint, r) / "model.safetensors" for r in range(world_size)]
    headers = [_model_header(file) for file in files]
    partitions = {name: Partition.from_json(p) for name, p in meta["partitions"].items()}
    dp_rows, dp = set(meta.get("dp_rows", ())), world_size // tp  # FSDP: each rank saved its DP rows of its TP shard
    for rank, (file, header) in enumerate(zip(files, headers)):
        for name, tensor in params.items():
            expected = list(
                Placement.fsdp(
                    tuple(tensor.shape), partitions.get(name), rank % tp, dp if name in dp_rows else 1, rank // tp
                ).local_shape
            )
            if name not in header:
                raise CheckpointError(f"{file}: tensor {name} is missing")
            if header[name]["shape"] != expected:
                raise CheckpointError(
                    f"{file}: tensor {name} has shape {tuple(header[name]['shape'])}, rank {rank} "
                    f"of this config holds {tuple(expected)}"
                )
    with ExitStack() as stack:  # one open file per rank that holds a part; tensors are read one at a time
        handles = [stack.enter_context(open_tensors(file)) for file in files[: tp * dp if dp_rows else tp]]

        def tp_shard(name: str, tp_rank: int) -> torch.Tensor:
            if name in dp_rows:
                return torch.cat([handles[d * tp + tp_rank].get_tensor(name) for d in range(dp)])
            return handles[tp_rank].get_tensor(name)

        def fetch(name: str) -> torch.Tensor:
            if name in partitions:
                return partitions[name].unshard([tp_shard(name, t) for t in range(tp)])
            return tp_shard(name, 0)

        yield fetch


def dtype(checkpoint: Path) -> torch.dtype:
    """The dtype of the model's tensors, from rank 0's model file."""
    return NAMES[next(iter(_model_header(_rank_dir(checkpoint, 0) / "model.safetensors").values()))["dtype"]]


def _model_header(file: Path) -> dict[str, dict]:
    """A rank's model file's validated header (tensors only)."""
    if not file.is_file():
        raise CheckpointError(f"{file}: missing")
    header = read_header(file)[0]
    if not header:
        raise CheckpointError(f"{file}: holds no tensors")
    return header
