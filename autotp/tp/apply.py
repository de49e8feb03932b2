"""Applying a plan: swap linears for their parallel versions and fix what HF code reads.

The plan has already checked everything, so this step cannot fail halfway on bad input.
"""

from __future__ import annotations

import copy
import functools
from typing import Iterable

import torch
from torch import nn
from transformers import PreTrainedModel

from ..compat.hf import avoid_grouped_mm
from ..mesh import build_subgroups
from ..options import WrapOptions
from ..planning.plan import AttrPlan, HeadInputPlan
from ..planning.sharding import Partition
from ..runtime.collectives import gather_from_tp
from ..runtime.forward_end import after_every_forward
from ..runtime.grad_hooks import GradHook, grad_allreduce_hook, replica_grad_hook
from ..runtime.rng import sync_replicated_stream
from ..state import TPState, attach
from .block_entry import BlockEntry
from .heads import AttentionWeights, tag_heads
from .inplace import InPlaceParams
from .layers import LinearAllreduce, LinearLayer, ParallelLinear, ShardedRegion
from .mixer import GroupStatNorm, reenter, slice_buffer
from .mixer_state import StateChannels
from .params import ShardedNorm
from .streams import install_sharded_streams


def apply_plan(model: nn.Module, state: TPState) -> None:
    """Rewrite `model` in place to follow `state.plan` on this rank (on the meta device too), with `state.options`
    fixed in every layer and block entry it builds (`options.timeout` is the resolved one); attaches `state`.

    The gradient hooks come later (`register_grad_hooks`), once loading has replaced any meta
    parameters: a hook belongs to one Parameter object.
    """
    plan, options, tp_group, rank = state.plan, state.options, state.tp_group, state.tp_rank
    for path, source in plan.shared:  # a block tied whole to another becomes it (`autotp.planning.ties`)
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, model.get_submodule(source))
    modules = dict(model.named_modules())
    entries: dict[str, BlockEntry] = {}
    head = plan.vocab.head if plan.vocab is not None else None
    for layer in plan.layers:  # column layers first: a row layer reads its block's entry (autotp.tp.glu)
        if layer.style == "column" and layer.path != head:  # the head: autotp.vocab.apply
            parent_path, _, name = layer.path.rpartition(".")
            parent = modules[parent_path]
            if parent_path not in entries:
                entries[parent_path] = BlockEntry(
                    tp_group, overlap=options.overlap, sequence_parallel=_sequence_parallel(options, layer.block)
                )
                parent.register_forward_hook(entries[parent_path].clear)
                after_every_forward(model, parent_path, entries[parent_path].clear)  # a forward that raised too
            setattr(parent, name, LinearLayer(getattr(parent, name), layer.partition, tp_group, entries[parent_path]))
    for layer in plan.layers:
        if layer.style != "column":
            parent_path, _, name = layer.path.rpartition(".")
            parent = modules[parent_path]
            setattr(
                parent,
                name,
                LinearAllreduce(
                    getattr(parent, name),
                    layer.partition,
                    tp_group,
                    entry=entries.get(parent_path),
                    sequence_parallel=_sequence_parallel(options, layer.block),
                    recompute_glu=options.recompute_glu,
                ),
            )
    for region in plan.regions:
        partitions = {name: partition for name, _, partition in region.partitions}
        state.regions.append(
            ShardedRegion(modules[region.path], partitions, tp_group, state, region.bias_once, region.side)
        )
        _experts_path(modules[region.path], partitions.values())
    _mixers(model, state)
    for norm in plan.norms:
        ShardedNorm(modules[norm.path], norm.stat, norm.width, tp_group, state)
    for path in {attr.path for attr in plan.attrs if attr.name.startswith("config.")}:
        modules[path].config = copy.copy(modules[path].config)  # the block's own head counts
    _set_attrs(modules, plan.attrs, rank, gathered=False)
    for head_input in plan.head_inputs:
        modules[head_input.path].register_forward_pre_hook(
            state.sharded_only(_head_slicer(head_input, state)), with_kwargs=True
        )
    for heads in plan.attention:
        tag = functools.partial(tag_heads, heads, heads.local[rank][1] * heads.repeats)
        modules[heads.path].register_forward_hook(state.sharded_only(tag))
    if plan.attention:
        weights = AttentionWeights(tp_group)
        for module in model.modules():
            if isinstance(module, PreTrainedModel):  # the model, and any inside it a user may call alone
                module.register_forward_hook(state.sharded_only(weights))
    model.register_forward_pre_hook(state.entered, with_kwargs=True, prepend=True)
    model.register_forward_hook(state.left, with_kwargs=True, always_call=True)
    sync_replicated_stream(tp_group)
    blocks = sorted({layer.block for layer in plan.layers if layer.block} - {plan.vocab.head if plan.vocab else ""})
    install_sharded_streams(model, blocks, [r.path for r in plan.regions], tp_group, state)
    attach(model, state)


def _mixers(model: nn.Module, state: TPState) -> None:
    """Token mixers' parts besides their linears: in-place parameters (`autotp.tp.inplace`), constant buffers sliced
    per forward, gathered outputs, recurrent states read by channel (`autotp.tp.mixer_state`), group norms and
    re-entries (`autotp.tp.mixer`)."""
    plan, group, rank = state.plan, state.tp_group, state.tp_rank
    params = tuple(param for param in plan.params if not param.buffer)
    if params:
        state.regions.append(InPlaceParams(model, params, group, rank))
    for buffer in (param for param in plan.params if param.buffer):
        slice_buffer(model.get_submodule(buffer.module), buffer, rank, state)
    for layer in (layer for layer in plan.layers if layer.path in plan.gathered_outputs):
        gather = functools.partial(_gathered_output, layer.partition, group)
        model.get_submodule(layer.path).register_forward_hook(state.sharded_only(gather))
    for mixer_state in plan.states:
        StateChannels(model.get_submodule(mixer_state.path), mixer_state, group, rank, state)
    state.regions.extend(GroupStatNorm(model.get_submodule(norm.path), norm, group) for norm in plan.group_norms)
    for path in plan.reentries:
        model.get_submodule(path).register_forward_hook(state.sharded_only(reenter(group)))


def _gathered_output(partition: Partition, group, module, args, output: torch.Tensor) -> torch.Tensor:
    """A column layer's output gathered whole (the plan's `gathered`: a gate on a row layer's sum)."""
    return gather_from_tp(output, partition.with_dim(output.dim() - 1), group)


def _experts_path(module: nn.Module, partitions: Iterable[Partition]) -> None:
    """An experts forward that runs on every rank's shard widths (transformers' grouped_mm needs 16-byte strides)."""
    widths = {p.local_size(rank) for p in partitions for rank in range(p.tp_size)}
    dtype = next(module.parameters()).dtype
    avoid_grouped_mm(module, widths, dtype)


def _sequence_parallel(options: WrapOptions, block: str) -> bool:
    """Whether a layer of `block` runs sequence-parallel: every layer of a sharded block does under the option (the
    LM head, in no block, does not); `autotp.sp.sequence` installs the split around them."""
    return options.sequence_parallel and bool(block)


def register_grad_hooks(model: nn.Module, state: TPState, rank_sets: set[tuple[int, ...]]) -> list[GradHook]:
    """Gradient sums for replicated KV rows (over the ranks sharing them) and per-head norms (over TP).

    Collective (it creates the replica process groups): every rank calls it once, after the
    parameters are final, with the same `rank_sets` (the whole model's plan's: a pipeline stage's own plan may lack a
    set another stage's needs, and the groups are created by every rank). Frozen parameters get their hook when they
    are unfrozen.
    """
    replicas = state.replica_groups = build_subgroups(rank_sets, state.mesh, state.timeout)
    hooks, seen = [], set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            shard = getattr(param, "autotp_shard", None)
            if shard is not None and shard.partition.replicas(shard.rank) and id(param) not in seen:
                seen.add(id(param))
                hooks.append(
                    GradHook(
                        module, param, state.sharded_only(replica_grad_hook(shard.partition, shard.rank, replicas))
                    )
                )
    for path in state.plan.head_norms:
        norm = model.get_submodule(path)
        hooks += [
            GradHook(
                norm.get_submodule(name.rpartition(".")[0]),
                param,
                state.sharded_only(grad_allreduce_hook(state.tp_group)),
            )
            for name, param in norm.named_parameters()
        ]
    return hooks


def _set_attrs(modules: dict[str, nn.Module], attrs: tuple[AttrPlan, ...], rank: int, gathered: bool) -> None:
    for attr in attrs:
        attr.assign(modules[attr.path], attr.full if gathered else attr.local[rank])


def _head_slicer(plan: HeadInputPlan, state: TPState):
    """Forward pre-hook keeping this rank's heads of a (batch*heads, ...) input such as ALiBi."""
    first, count = plan.local[state.tp_rank]

    def hook(module, args, kwargs):
        tensor = kwargs.get(plan.name)
        if not torch.is_tensor(tensor):
            return None
        by_head = tensor.reshape(-1, plan.heads, *tensor.shape[1:])
        kwargs[plan.name] = by_head[:, first : first + count].reshape(-1, *tensor.shape[1:])
        return args, kwargs

    return hook


def parallel_layers(model: nn.Module) -> list[ParallelLinear]:
    """Every replaced linear in `model`."""
    return [m for m in model.modules() if isinstance(m, ParallelLinear)]


def set_gathered(model: nn.Module, state: TPState, gathered: bool) -> None:
    """Switch every replaced layer, sharded region and adjusted attribute between full weights and shards."""
    for part in [*parallel_layers(model), *state.regions]:
        part.gather_() if gathered else part.partition_()
    _set_attrs(dict(model.named_modules()), state.plan.attrs, state.tp_rank, gathered)
    state.gathered = gathered
