"""`consolidate`: a full HF checkpoint from a training checkpoint, in one process, one tensor at a time.

It reads both formats: DCP checkpoints (`autotp.io.checkpoint.save`), whose tensors are stored at full
shape, and the older per-rank files (`autotp.io.checkpoint.legacy`), reassembled from their partitions.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ...compat.hf import build_model
from ...compat.peft import is_peft_key
from ...mesh import global_rank
from ..errors import CheckpointError
from ..hf.save import write_hf_checkpoint
from ..staging import staged_directory
from . import legacy
from .save import FORMAT, read_index, read_meta, run_dcp


def consolidate(
    checkpoint: str | os.PathLike, out: str | os.PathLike, max_shard_size: int | str = "5GB", overwrite: bool = False
) -> None:
    """Write the full HF checkpoint (config, safetensors shards, index) of a training checkpoint's model.

    Every tensor is checked first (present, complete, at the shape the config gives), so that a
    damaged checkpoint raises `CheckpointError` before anything is written.

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
    config = AutoConfig.from_pretrained(checkpoint)
    if not getattr(config, "architectures", None) and meta.get("model_class"):
        config.architectures = [meta["model_class"]]  # a model built from a config: the class save_checkpoint saw
    reader = _full_tensors if meta["format"] == FORMAT else legacy.full_tensors
    dtype = _dtype(checkpoint) if meta["format"] == FORMAT else legacy.dtype(checkpoint)
    with init_empty_weights():  # the checkpoint's own class (config.architectures), as autotp.from_pretrained builds
        model = build_model(config, dtype=dtype)
    model.tie_weights()
    params = model.state_dict(keep_vars=True)
    with reader(checkpoint, meta, params) as fetch:
        with staged_directory(out, overwrite, what="autotp.consolidate") as tmp:
            write_hf_checkpoint(model, params, fetch, tmp, max_shard_size)


def _dtype(checkpoint: Path) -> torch.dtype:
    """The dtype of the model's first tensor in a DCP checkpoint."""
    tensors = read_index(checkpoint).state_dict_metadata
    first = next(
        md
        for name, md in tensors.items()
        if not name.startswith(("optimizer/", "rng/", "scheduler")) and not isinstance(md, BytesStorageMetadata)
    )
    return first.properties.dtype


@contextmanager
def _full_tensors(checkpoint: Path, meta: dict[str, Any], params: dict[str, torch.Tensor]) -> Iterator[Callable]:
    """`fetch(name)`: one full tensor read from a DCP checkpoint, after every tensor of `params` is checked."""
    tensors = read_index(checkpoint).state_dict_metadata
    _refuse_peft(checkpoint, tensors)
    for name, tensor in params.items():
        md = tensors.get(name)
        if md is None or isinstance(md, BytesStorageMetadata):
            raise CheckpointError(f"{checkpoint}: tensor {name} is missing")
        if tuple(md.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{checkpoint}: tensor {name} has shape {tuple(md.size)}, this config's model "
                f"holds {tuple(tensor.shape)}"
            )
    for name, tensor in params.items():  # a bf16 model may hold some in fp32 (transformers' _keep_in_fp32_modules)
        tensor.data = torch.empty_like(tensor, dtype=tensors[name].properties.dtype)  # written as saved, as HF does
    reader = dcp.FileSystemReader(checkpoint)

    def fetch(name: str) -> torch.Tensor:
        full = torch.empty(tensors[name].size, dtype=tensors[name].properties.dtype)
        run_dcp(dcp.load, {name: full}, storage_reader=reader)
        return full

    yield fetch


def _refuse_peft(checkpoint: Path, tensors: Iterable[str]) -> None:
    """A checkpoint of a model holding PEFT adapters has no plain transformers checkpoint: say so, and what to do."""
    found = next((name for name in tensors if is_peft_key(name)), None)
    if found is not None:
        raise CheckpointError(
            f"{checkpoint}: saved from a model holding PEFT adapters (tensor {found}); consolidate writes a plain "
            f"transformers checkpoint, which has no place for them. In a job (any tp and dp), build the PEFT model "
            f"as for training, autotp.load_checkpoint({str(checkpoint)!r}, peft_model), then on every rank either "
            f"peft_model.save_pretrained(DIR) (PEFT's full-size adapter) or "
            f"autotp.save_pretrained(peft_model.merge_and_unload(), DIR) (the merged model)"
        )


def _refuse_inside_a_job(checkpoint: str | os.PathLike, out: str | os.PathLike) -> None:
    """`consolidate` runs in one process: raise before anything is read when torch.distributed runs on several ranks."""
    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if ranks > 1:
        raise RuntimeError(
            f"autotp.consolidate runs in one process, and torch.distributed is running here on {ranks} "
            f"ranks (rank {global_rank()}), where writing {out} would wait for every rank. Run "
            f"`python -m autotp consolidate {checkpoint} {out}` after the job, or call "
            f"autotp.save_pretrained(model, {str(out)!r}) on every rank inside it"
        )
