"""`from_pretrained`: build on the meta device, plan, then read only this rank's slices from safetensors.

No rank ever materialises the full model: every sharded parameter is read as the runs of rows its
partition names, fused tensors included, with plain file reads (no mmap), straight to its device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
from accelerate import init_empty_weights
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from .api import PolicyArg, _groups, _validate_tp_size, finish
from .plan import build_plan
from .sequence import apply_sequence_parallel, sequence_layout
from .st_format import FormatError, read_header, read_rows
from .walker import apply_plan, register_grad_hooks

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file or tensor and the numbers."""


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file."""
    index = path / _INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
        files = {name: path / file for name, file in weight_map.items()}
    elif (path / _SINGLE).is_file():
        files = None
    else:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f"; it holds {pickles}, and autotp loads only safetensors (no pickle)" if pickles else ""
        raise CheckpointError(f"{path}: no {_INDEX} or {_SINGLE}{hint}")
    if files is None:
        single = path / _SINGLE
        return {name: single for name in _read_header(single)[0]}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in {index.name} but missing")
    return files


def _read_header(file: Path) -> tuple[dict[str, dict], int]:
    try:
        return read_header(file)
    except FormatError as err:
        raise CheckpointError(str(err)) from None


def from_pretrained(
    path: str | Path,
    tp_size: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    tp_group: dist.ProcessGroup | None = None,
    policy: PolicyArg = None,
    vocab_parallel: bool = True,
    sequence_parallel: bool = False,
    **hf_kwargs: Any,
) -> nn.Module:
    """A tensor-parallel causal LM read straight into shards; equal to `wrap(from_pretrained(path))`.

    The model is built on the meta device, planned like `wrap` plans it, and each rank reads only
    its rows of every sharded tensor (including its parts of fused ones). Only safetensors load.
    """
    _validate_tp_size(tp_size)
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    files = checkpoint_files(path)
    config = AutoConfig.from_pretrained(path, **hf_kwargs)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # tied parameters become one object, loaded once under whichever name the file has
    plan = build_plan(model, tp_size, policy, vocab_parallel)
    if sequence_parallel:
        sequence_layout(model, plan)
    groups = _groups(tp_size, tp_group)
    state = apply_plan(model, plan, *groups, hooks=False)
    if sequence_parallel:
        apply_sequence_parallel(model, plan, state.tp_group, state)
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if (
            state.tp_group is not None and dist.get_backend(state.tp_group) == "nccl") else torch.device("cpu")
    _load_params(model, files, torch.device(device), dtype, show=not dist.is_initialized() or dist.get_rank() == 0)
    model.to(device)  # buffers built at init
    register_grad_hooks(model, state)
    finish(model, check_inputs=False)
    if (path / "generation_config.json").is_file() and model.can_generate():
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()  # as transformers' from_pretrained leaves it
    return model


def _load_params(model: nn.Module, files: Mapping[str, Path], device: torch.device, dtype: torch.dtype,
                 show: bool) -> None:
    """Replace every meta parameter by its loaded rows (tied parameters stay one object)."""
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params[id(param)] = param
    loaded: dict[int, nn.Parameter] = {}
    persistent = {name for name, _ in model.state_dict(keep_vars=True).items()}
    buffers = [(n, b) for n, b in model.named_buffers() if n in persistent and n in files]
    by_file: dict[Path, list] = {}
    for key, param in params.items():
        name = next((n for n in aliases[key] if n in files), None)
        if name is None:
            raise CheckpointError(f"{aliases[key][0]}: not found in the checkpoint")
        by_file.setdefault(files[name], []).append((name, param))
    bar = tqdm(total=len(params) + len(buffers), desc="autotp load", unit="tensor", disable=not show)
    for file, entries in by_file.items():
        header, data_start = _read_header(file)
        with file.open("rb") as f:
            for name, param in entries:
                _check_shape(file, name, header[name]["shape"], param)
                shard = getattr(param, "autotp_shard", None)
                try:
                    tensor = read_rows(f, header[name], data_start, None if shard is None else shard.partition,
                                       0 if shard is None else shard.rank)
                except FormatError as err:
                    raise CheckpointError(str(err)) from None
                new = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)  # the Shard metadata
                loaded[id(param)] = new
                bar.update()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in loaded:
                module._parameters[name] = loaded[id(param)]
    for name, buffer in buffers:
        header, data_start = _read_header(files[name])
        with files[name].open("rb") as f:
            buffer.data = read_rows(f, header[name], data_start, None, 0).to(device=device, dtype=buffer.dtype)
        bar.update()
    bar.close()


def _check_shape(file: Path, name: str, stored: list[int], param: nn.Parameter) -> None:
    shard = getattr(param, "autotp_shard", None)
    expected = list(param.shape if shard is None else shard.full_shape(param.shape))
    if list(stored) != expected:
        raise CheckpointError(f"{file.name}: tensor {name} has shape {tuple(stored)}, the config implies {tuple(expected)}")
