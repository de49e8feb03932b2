"""The reads behind `autotp.from_pretrained`: only this rank's slices of an HF safetensors checkpoint.

No rank ever materialises the full model: every sharded parameter is read as the runs of rows its
partition names, fused tensors included, with plain file reads (no mmap), straight to its device.
Every header is validated before a byte of data is read, and the TP ranks agree on the outcome
before any parameter is replaced, so a failure on one rank is raised on all of them.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn
from tqdm.auto import tqdm

from ...compat.hf_conversion import ConvertedSource, checkpoint_sources, initialised_if_missing
from ...planning.placement import window
from ...runtime.rows import local_rows
from ...runtime.shards import held_part
from ...state import find_state
from ..errors import CheckpointError, describe, failures
from .safetensors import read_header, read_rows

log = logging.getLogger("autotp")

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
_LISTED = 5  # unused checkpoint tensors named in the warning


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it, from the index or the single file.

    Every file's header is read and validated, and every tensor the index lists must be in its file.
    """
    index = path / _INDEX
    if index.is_file():
        files = _read_index(index)
    elif (path / _SINGLE).is_file():
        single = path / _SINGLE
        return {name: single for name in read_header(single)[0]}
    else:
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f"; it holds {pickles}, and autotp loads only safetensors (no pickle)" if pickles else ""
        raise CheckpointError(f"{path}: no {_INDEX} or {_SINGLE}{hint}")
    for file in sorted(set(files.values())):
        if not file.is_file():
            raise CheckpointError(f"{file}: listed in {index.name} but missing")
        held = read_header(file)[0]
        absent = [name for name, where in files.items() if where == file and name not in held]
        if absent:
            raise CheckpointError(
                f"{index}: maps tensor {absent[0]} to {file.name}, which does not contain it "
                f"({len(absent)} such tensors)"
            )
    return files


def _read_index(index: Path) -> dict[str, Path]:
    try:
        content = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
    if not isinstance(content, dict) or "weight_map" not in content:
        raise CheckpointError(f"{index}: not a valid safetensors index (no weight_map object)")
    weight_map = content["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(
            f"{index}: weight_map is a JSON {type(weight_map).__name__}, not an object of tensor name -> file name"
        )
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index}: weight_map maps tensor {name} to {file!r}, not a file name")
    return {name: index.parent / file for name, file in weight_map.items()}


def load_params(
    model: nn.Module,
    files: Mapping[str, Path],
    device: torch.device,
    dtype: torch.dtype,
    show: bool,
    in_place: bool = False,
    unread: tuple[str, ...] = (),
) -> None:
    """Replace every meta parameter by its loaded rows (tied parameters stay one object).

    Everything is read first; then the TP group agrees (a collective when the model has one), and
    only if every rank succeeded does any parameter change. Checkpoint tensors the model does not
    use are listed in a warning, as transformers does. `in_place` copies into a wrapped model's
    existing parameters instead, which keeps the optimizer's and the gradient hooks' references. `unread`: prefixes
    of checkpoint tensors left out on purpose (other pipeline stages' layers), not warned about.
    """
    state = find_state(model)
    error = None
    sources: dict = {}
    try:
        sources = checkpoint_sources(model, files)
        loaded, buffers = _read_all(model, files, sources, device, dtype, show)
    except Exception as err:  # every rank must still reach the agreement below
        error = err
    failed = failures(error, None if state is None else state.tp_group)
    if error is not None:
        raise error
    if failed:
        raise CheckpointError(f"loading the checkpoint failed on {describe(failed)}")
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and id(param) in loaded:
                if in_place:  # under FSDP, this rank's rows of its TP shard
                    target, first = local_rows(param.data)
                    with torch.no_grad():
                        target.copy_(loaded[id(param)].narrow(0, first, target.shape[0]))
                else:
                    module._parameters[name] = loaded[id(param)]
    for module_path, name, tensor in buffers:  # replaced, not written: one built from a meta weight is on meta
        model.get_submodule(module_path)._buffers[name] = tensor
    if show:
        _warn_unused(model, {n: f for n, f in files.items() if not n.startswith(unread)}, sources)


def _read_all(
    model: nn.Module,
    files: Mapping[str, Path],
    sources: Mapping[str, str | ConvertedSource],
    device: torch.device,
    dtype: torch.dtype,
    show: bool,
) -> tuple[dict[int, nn.Parameter], list[tuple[str, str, torch.Tensor]]]:
    """Every parameter's new tensor, by the id of the meta parameter it replaces, and every persistent buffer's.

    `sources` names the checkpoint key of each model tensor (transformers may rename on save), or the
    per-expert tensors a fused expert tensor is built from.
    """
    aliases: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(param), []).append(name)
        params[id(param)] = param
    loaded: dict[int, nn.Parameter] = {}
    persistent = set(model.state_dict(keep_vars=True))
    wanted = [
        (saved_as, n, b)
        for n, b in model.named_buffers()
        if n in persistent and isinstance(saved_as := sources.get(n), str)
    ]
    by_file: dict[Path, list] = {}
    experts: list[tuple[str, ConvertedSource, nn.Parameter]] = []
    bar = tqdm(total=len(params) + len(wanted), desc="autotp load", unit="tensor", disable=not show)
    for key, param in params.items():
        name = next((n for n in aliases[key] if n in sources), None)
        if name is None:
            loaded[key] = _replacing(
                param, _initialised(model, aliases[key][0], param), device, dtype, trainable=param.requires_grad
            )
            bar.update()
            continue
        source = sources[name]
        if isinstance(source, ConvertedSource):
            experts.append((name, source, param))
        else:
            by_file.setdefault(files[source], []).append((source, param))
    for name, source, param in experts:
        loaded[id(param)] = _replacing(param, _read_converted(name, source, param, files), device, dtype)
        bar.update()
    for file, entries in by_file.items():
        header, data_start = read_header(file)
        with file.open("rb") as f:
            for name, param in entries:
                _check_shape(file, name, header[name]["shape"], param)
                shard = held_part(param)
                tensor = read_rows(
                    f,
                    header[name],
                    data_start,
                    None if shard is None else shard.partition,
                    0 if shard is None else shard.rank,
                )
                loaded[id(param)] = _replacing(param, tensor, device, dtype)
                bar.update()
    buffers = []
    for name, target, buffer in wanted:
        header, data_start = read_header(files[name])
        with files[name].open("rb") as f:
            tensor = read_rows(f, header[name], data_start, None, 0)
        module_path, _, leaf = target.rpartition(".")
        buffers.append((module_path, leaf, tensor.to(device=device, dtype=buffer.dtype)))
        bar.update()
    bar.close()
    return loaded, buffers


def _replacing(
    param: nn.Parameter, tensor: torch.Tensor, device: torch.device, dtype: torch.dtype, trainable: bool = True
) -> nn.Parameter:
    """The parameter that replaces meta `param`: `tensor` on `device` in `dtype`, with `param`'s Shard metadata.

    Read parameters are trainable, whatever the model set before (Whisper's encoder positions), because
    transformers' loading makes them so, and equal to it means the same; frozen parameters are the user's
    to freeze after loading.
    """
    new = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=trainable)
    new.__dict__.update(param.__dict__)
    return new


def _initialised(model: nn.Module, name: str, param: nn.Parameter) -> torch.Tensor:
    """This rank's rows of a parameter the checkpoint lacks: made as transformers makes it if left out on purpose
    (trainable or not as transformers' own load leaves it), else an error."""
    shard = held_part(param)
    full = initialised_if_missing(model, name, param, param.shape if shard is None else shard.full_shape(param.shape))
    if full is None:
        raise CheckpointError(f"{name}: not found in the checkpoint")
    return full if shard is None else shard.partition.shard(full, shard.rank)


def _read_converted(name: str, source: ConvertedSource, param: nn.Parameter, files: Mapping[str, Path]) -> torch.Tensor:
    """This rank's part of a tensor transformers builds from several checkpoint tensors while loading.

    Stacked experts are read by slices: the target is (experts, rows, cols) with rows the parts
    (gate | up) one after another; autotp splits it along dim 1 or 2, which is dim 0 or 1 of each
    expert's tensor, or by expert (dim 0, expert parallelism): then only this rank's experts are read.
    Other conversions read the whole tensors, run transformers' operations on them, and keep this rank's rows.
    """
    if source.run is not None:
        return _run_conversion(name, source, source.run, param, files)
    shard = held_part(param)
    full = list(param.shape if shard is None else shard.full_shape(param.shape))
    counts = [len(keys) for keys in source.parts]
    if any(count != full[0] for count in counts):
        raise CheckpointError(
            f"{name}: the checkpoint holds {counts} per-expert tensors, the config implies {full[0]} experts"
        )
    headers = {file: read_header(file) for file in {files[key] for keys in source.parts for key in keys}}
    rows = [headers[files[keys[0]]][0][keys[0]]["shape"][0] for keys in source.parts]
    for keys, part_rows in zip(source.parts, rows):
        for key in keys:
            stored = headers[files[key]][0][key]["shape"]
            if list(stored) != [part_rows, *full[2:]] or sum(rows) != full[1]:
                raise CheckpointError(
                    f"{files[key].name}: tensor {key} has shape {tuple(stored)}, which does not "
                    f"build {name} of shape {tuple(full)}"
                )
    partition, rank = (None, 0) if shard is None else (shard.partition, shard.rank)
    wanted: range | list[int] = range(full[0])
    if partition is not None and partition.dim == 0:  # split by expert (autotp.ep): this rank's experts, each whole
        wanted = [e for start, length in partition.runs[rank] for e in range(start, start + length)]
        partition = None
    offsets = [sum(rows[:j]) for j in range(len(rows))]
    per_part = [
        None
        if partition is None
        else window(partition, offset, count).with_dim(0)
        if partition.dim == 1
        else partition.with_dim(partition.dim - 1)
        for offset, count in zip(offsets, rows)
    ]
    experts = []
    for expert in wanted:
        pieces = []
        for keys, part in zip(source.parts, per_part):
            key = keys[expert]
            header, data_start = headers[files[key]]
            with files[key].open("rb") as f:
                pieces.append(read_rows(f, header[key], data_start, part, rank))
        experts.append(torch.cat(pieces))
    return torch.stack(experts)


def _run_conversion(
    name: str,
    source: ConvertedSource,
    run: Callable[[dict[str, list[torch.Tensor]]], torch.Tensor],
    param: nn.Parameter,
    files: Mapping[str, Path],
) -> torch.Tensor:
    """`name` in full from transformers' conversion (`run`: `source.run`) of its whole checkpoint tensors, then this
    rank's rows."""
    tensors: dict[str, list[torch.Tensor]] = {}
    for pattern, keys in zip(source.patterns, source.parts):
        if keys:
            tensors[pattern] = []
            for key in keys:
                header, data_start = read_header(files[key])
                with files[key].open("rb") as f:
                    tensors[pattern].append(read_rows(f, header[key], data_start, None, 0))
    try:
        full = run(tensors)
    except Exception as err:
        raise CheckpointError(
            f"{name}: transformers' conversion ({source.ops}) of {', '.join(sum(source.parts, ()))} "
            f"failed: {type(err).__name__}: {err}"
        ) from None
    shard = held_part(param)
    _check_shape(files[next(k for keys in source.parts for k in keys)], name, list(full.shape), param)
    return full if shard is None else shard.partition.shard(full, shard.rank)


def _warn_unused(model: nn.Module, files: Mapping[str, Path], sources: Mapping[str, str | ConvertedSource]) -> None:
    """Warn about checkpoint tensors the model has no place for (transformers' "unexpected keys")."""
    names = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    names.update(name for name, _ in model.named_buffers(remove_duplicate=False))
    known = set(names)
    for name in names & set(sources):  # the checkpoint keys the model's tensors were read from
        source = sources[name]
        known.update([source] if isinstance(source, str) else [key for keys in source.parts for key in keys])
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unused = sorted(n for n in files if n not in known and not any(p.search(n) for p in ignored))
    if unused:
        more = f" and {len(unused) - _LISTED} more" if len(unused) > _LISTED else ""
        log.warning(
            f"{len(unused)} tensors of the checkpoint are not used by {type(model).__name__}: "
            f"{', '.join(unused[:_LISTED])}{more}"
        )


def _check_shape(file: Path, name: str, stored: list[int], param: nn.Parameter) -> None:
    shard = held_part(param)
    expected = list(param.shape if shard is None else shard.full_shape(param.shape))
    if list(stored) != expected:
        raise CheckpointError(
            f"{file.name}: tensor {name} has shape {tuple(stored)}, the config implies {tuple(expected)}"
        )
