"""Full Hugging Face checkpoints from a tensor-parallel model, streamed one tensor at a time.

Every file's header is known before any weight is gathered (full shapes come from the partition
metadata), so rank 0 writes each safetensors file as a header followed by one tensor after
another: no rank ever holds more than its shards plus one full checkpoint tensor. A checkpoint
tensor that transformers cuts out of a model tensor (one expert of a fused experts tensor) is
gathered alone: each rank cuts its rows of it first. Everything is staged (see
`autotp.io.staging`), so a crash never leaves a directory that loads as an incomplete checkpoint.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.distributed as dist
from huggingface_hub.serialization import split_state_dict_into_shards_factory
from torch import nn
from tqdm.auto import tqdm

from ...compat.hf import adapter_module
from ...compat.hf_conversion import SavedPart, SavedTensor
from ...mesh import Group, global_rank, group_rank, is_global_rank0
from ...runtime.dimension import Collected, collected
from ...runtime.rows import dp_full
from ...runtime.shards import held_part, holders
from ...state import find_state, outside_module_holders
from ..staging import staged_directory
from ..streaming import gather_after_streams, stream_full_to
from .parts import full_shape, gather_part, saved_layout
from .safetensors import SafetensorsWriter, write_rows


def save_pretrained(
    model: nn.Module,
    save_directory: str | os.PathLike,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    into_existing: bool = False,
) -> None:
    """Write a full HF checkpoint (config, safetensors shards, index) that plain transformers loads.

    Call it on every rank: the TP group of global rank 0 streams one tensor at a time and rank 0
    writes (on a local filesystem the other ranks of its TP group write their own rows into its files);
    under expert parallelism the EP group of rank 0 streams the experts alike, each rank its own experts; under a
    pipeline each stage's TP group (in rank 0's replica) gathers the tensors its stage owns (`autotp.pp.cut.owner`),
    its experts over the EP group holding them (other replicas' ranks among it too), and sends each to rank 0
    (a dimension holding the model in parts collects them: `Dimension.collect`, `autotp.pp.stage_tensors`).
    `save_directory` must not exist or be empty, unless `overwrite=True` (it is replaced
    whole, once the new one is complete). `into_existing=True` instead keeps the directory's other
    files (a Trainer's output directory): the checkpoint is staged completely, then its files are
    moved in, replacing the model files of an earlier save. A failure on any rank (an unwritable
    target, a full disk) is raised on every rank.
    """
    model = outside_module_holders(model)
    found = adapter_module(model)
    if found is not None:
        raise TypeError(
            f"autotp.save_pretrained: {found[0]} is a {found[1]}; a full checkpoint would store its adapter "
            f"under names transformers does not load. Call merge_and_unload() first, or save the adapter "
            f"alone with the PEFT model's save_pretrained, on every rank (it writes the full-size adapter)"
        )
    state = find_state(model)
    tp_group = None if state is None else state.tp_group
    params = model.state_dict(keep_vars=True)
    fsdp = state is not None and state.fsdp  # then every rank gathers its DP group's rows: all take part
    parts: Collected | None = None  # held in parts: set in the staged directory (after every rank has entered)

    def writes(group: Group) -> bool:
        """Whether this rank takes part in gathering the tensors split over `group` (TP, or EP for experts); held in
        parts (a pipeline), every part of rank 0's replica gathers its own tensors, with the rest of an EP group."""
        if parts is not None:
            return fsdp or parts.gathers(group)
        return fsdp or global_rank() == 0 or (group is not None and 0 in dist.get_process_group_ranks(group))

    splits = [] if state is None else state.split_groups()

    def fetch(name: str, sent: bool = False) -> torch.Tensor | None:
        """`sent`: a full tensor sent on to where it is written (`Collected.fetching`), not a stream into a file."""
        group = holders(params[name], tp_group)
        if not writes(group):  # the EP group of rank 0 holds the experts, its TP group the rest
            return None
        tensor = dp_full(params[name].detach())
        shard = held_part(params[name])
        if shard is None:
            return tensor
        if sent:
            return gather_after_streams(tensor, shard.partition, group, dst=0)
        return stream_full_to(tensor, shard.partition, group, dst=0, write_rows=write_rows)

    def fetch_part(part: SavedPart) -> torch.Tensor | None:
        group = holders(params[part.source], tp_group)
        return gather_part(params[part.source], part, group) if writes(group) else None

    with staged_directory(save_directory, overwrite, into_existing=into_existing) as tmp:
        parts = collected(model, params, state)  # every part's tensors (collective over the parts' ranks)
        saved: Mapping[str, torch.Tensor] = params
        whole: Callable[[str], torch.Tensor | None] = fetch
        part: Callable[[SavedPart], torch.Tensor | None] = fetch_part
        if parts is not None:  # each tensor gathered where it is held, then sent on to rank 0
            lead = writes(tp_group) and group_rank(tp_group) == 0  # where a tensor is gathered to when held whole
            saved, (whole, part) = parts.params, parts.fetching(fetch, fetch_part, lead)
        if writes(tp_group) or any(writes(group) for group in splits):  # the experts: over EP
            write_hf_checkpoint(model, saved, whole, tmp, max_shard_size, part)


def write_hf_checkpoint(
    model: nn.Module,
    params: Mapping[str, torch.Tensor],
    fetch: Callable[[str], torch.Tensor | None],
    directory: Path,
    max_shard_size: int | str,
    fetch_part: Callable[[SavedPart], torch.Tensor | None] | None = None,
) -> None:
    """Stream a transformers-layout checkpoint of `model` into `directory`.

    `params` maps model keys to tensors whose shapes (or `autotp_shard`) give the full shapes;
    `fetch(key)` returns the full tensor, or a `FullStream` of it, where it is written and None elsewhere (it may
    be collective).
    `fetch_part(part)` does the same for a cut of one (one expert); without it, parts are cut from `fetch`.
    """
    layout = saved_layout(model, params)
    # as transformers splits its converted state dict: the views of one tensor (its experts) sized and placed together
    split = split_state_dict_into_shards_factory(
        layout,
        get_storage_size=lambda t: t.storage[1],
        get_storage_id=lambda t: t.storage[0],
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_shard_size,
    )
    fetch_part = fetch_part or _cutting(fetch)
    total = sum(t.nbytes for t in layout.values())
    writing = is_global_rank0()
    writes = _UntilFirstFailure()
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="autotp save", disable=not writing)
    for filename, tensor_names in split.filename_to_tensors.items():
        entries = [(n, layout[n].dtype, layout[n].shape) for n in tensor_names]
        writer = writes.run(SafetensorsWriter, directory / filename, entries, {"format": "pt"}) if writing else None
        for name in tensor_names:
            tensor = _assemble(layout[name], fetch, fetch_part)
            if writer is not None:
                writes.run(writer.write, name, tensor)
                bar.update(layout[name].nbytes)
        if writer is not None:
            writes.run(writer.close)
    bar.close()
    if writing:
        writes.run(_write_metadata, model, params, split, directory)
    if writes.error is not None:
        raise writes.error


class _UntilFirstFailure:
    """Runs the writer's file operations until one fails, then skips the rest.

    `fetch` may be collective: the other ranks of the writer's TP group are still gathering the
    remaining tensors, so the writer keeps gathering with them and raises the failure at the end,
    where `staged_directory` hands it to every rank.
    """

    def __init__(self) -> None:
        self.error: Exception | None = None

    def run(self, operation: Callable, *args):
        if self.error is not None:
            return None
        try:
            return operation(*args)
        except Exception as err:
            self.error = err
            return None


def _assemble(
    saved: SavedTensor,
    fetch: Callable[[str], torch.Tensor | None],
    fetch_part: Callable[[SavedPart], torch.Tensor | None],
) -> torch.Tensor | None:
    """One checkpoint tensor where it is written (None elsewhere): a whole model tensor, or its parts joined."""
    if len(saved.parts) == 1 and saved.parts[0].whole:
        return fetch(saved.parts[0].source)
    parts = [fetch_part(part) for part in saved.parts]
    if any(p is None for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=saved.dim)


def _cutting(fetch: Callable[[str], torch.Tensor | None]) -> Callable[[SavedPart], torch.Tensor | None]:
    """Parts cut from whole tensors `fetch` returns (one process: consolidation), keeping the last two, since
    transformers writes a layer's experts one by one, alternating between its fused tensors."""
    recent: OrderedDict[str, torch.Tensor | None] = OrderedDict()

    def fetch_part(part: SavedPart) -> torch.Tensor | None:
        if part.source not in recent:
            recent[part.source] = fetch(part.source)
            while len(recent) > 2:
                recent.popitem(last=False)
        recent.move_to_end(part.source)
        full = recent[part.source]
        return None if full is None else part.cut(full)

    return fetch_part


def _write_metadata(model: nn.Module, params: Mapping[str, torch.Tensor], split, tmp: Path) -> None:
    config = getattr(model, "config", None)
    if config is not None:
        from torch.distributed.fsdp import FSDPModule  # its class under fully_shard is FSDP<class>, not a model's name

        config.architectures = [next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule)).__name__]
        config.dtype = str(next(iter(params.values())).dtype).removeprefix("torch.")
        config.save_pretrained(tmp)
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None and getattr(model, "can_generate", lambda: False)():
        generation_config.save_pretrained(tmp)
    if split.is_sharded:
        unique = {id(p): p for p in params.values() if isinstance(p, nn.Parameter)}
        count = sum(torch.Size(full_shape(p)).numel() for p in unique.values())
        index = {"metadata": {"total_parameters": count, **split.metadata}, "weight_map": split.tensor_to_filename}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
