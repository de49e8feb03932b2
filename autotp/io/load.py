"""The reads behind `autotp.from_pretrained`: only this rank's slices of an HF safetensors checkpoint.

No rank ever materialises the full model: every sharded parameter is read as the runs of rows its
partition names, fused tensors included, with plain file reads (no mmap), straight to its device.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from .errors import CheckpointError
from .safetensors import read_header, read_rows

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


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
        return {name: single for name in read_header(single)[0]}
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in {index.name} but missing")
    return files


def load_params(model: nn.Module, files: Mapping[str, Path], device: torch.device, dtype: torch.dtype,
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
        header, data_start = read_header(file)
        with file.open("rb") as f:
            for name, param in entries:
                _check_shape(file, name, header[name]["shape"], param)
                shard = getattr(param, "autotp_shard", None)
                tensor = read_rows(f, header[name], data_start, None if shard is None else shard.partition,
                                   0 if shard is None else shard.rank)
                new = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=param.requires_grad)
                new.__dict__.update(param.__dict__)  # the Shard metadata
                loaded[id(param)] = new
                bar.update()
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in loaded:
                module._parameters[name] = loaded[id(param)]
    for name, buffer in buffers:
        header, data_start = read_header(files[name])
        with files[name].open("rb") as f:
            buffer.data = read_rows(f, header[name], data_start, None, 0).to(device=device, dtype=buffer.dtype)
        bar.update()
    bar.close()


def _check_shape(file: Path, name: str, stored: list[int], param: nn.Parameter) -> None:
    shard = getattr(param, "autotp_shard", None)
    expected = list(param.shape if shard is None else shard.full_shape(param.shape))
    if list(stored) != expected:
        raise CheckpointError(f"{file.name}: tensor {name} has shape {tuple(stored)}, the config implies {tuple(expected)}")
