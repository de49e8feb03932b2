"""The plan: which module gets which style, as data.

A `Plan` says, for one tp size, every linear's style and partition, the expert tensors sharded in
place, the attention attributes to adjust, and the parameters whose gradients need a TP sum. It
touches no process group, so it can be printed and tested anywhere. `Plan.origin` records where
its decisions came from, and is what later decisions read (`autotp.planning.planner` builds plans).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import nn

from .policy import Origin
from .sharding import Partition

VOCAB_OFF = "vocab_parallel=False"  # a plan's `vocab_reason` when vocab parallelism was not asked for: no warning


class Replicated(enum.Enum):
    """Why a linear stays replicated; the value is the display text (with the detail where it has one)."""

    NOT_COVERED = "not covered by the plan; replicated, which is always correct"
    NOT_VERIFIED = "not verified: {detail}; replicated"
    OUTSIDE_COMPONENTS = "outside the sub-models planned (a projector or head); replicated"


@dataclass(frozen=True)
class Why:
    """A replicated linear's reason: the kind, which decisions read, and the detail people read (`str`)."""

    reason: Replicated
    detail: str = ""

    def __str__(self) -> str:
        return self.reason.value.format(detail=self.detail)


@dataclass(frozen=True)
class LayerPlan:
    """One linear to replace: style, full weight shape as stored, and weight partition."""

    path: str
    style: str  # "column" or "row"
    shape: tuple[int, ...]
    partition: Partition
    reason: str
    block: str = ""  # the attention / MLP block it belongs to


@dataclass(frozen=True)
class RegionPlan:
    """A module whose parameters shard in place (MoE experts): inputs enter TP, the output is reduced."""

    path: str
    partitions: tuple[tuple[str, tuple[int, ...], Partition], ...]  # (param name, full shape, partition)
    reason: str
    bias_once: tuple[str, ...] = ()  # per-expert output biases: whole on every rank, added to the sum once
    side: str = ""  # "column"/"row": one parallel-experts linear: its input enters TP / its output is summed; "": both


@dataclass(frozen=True)
class NormPlan:
    """A norm over a width TP splits (BitNet's attn_sub_norm, before the row projection): each rank normalises its
    columns by the whole row's statistic, the `stat` ("mean" or "sum") of x^2 over `width` columns, all-reduced."""

    path: str
    stat: str
    width: int


@dataclass(frozen=True)
class ParamPlan:
    """A parameter of a sharded mixer split in place with the mixer's heads or channels (a depthwise convolution's
    weight, `A_log`, `D`, `dt_bias`, a gated norm's weight, a gate's per-head matrices): its input is already this
    rank's channels, so it needs no collective and its gradient is local. `path` is the parameter's full name, `block`
    the mixer holding it. `in_span`: its mixer mixes tokens only after its column projections, on the whole sequence
    sequence parallelism gathers there (Mamba's convolution and scan), so SP composes with it."""

    path: str
    shape: tuple[int, ...]
    partition: Partition
    block: str
    reason: str = ""
    buffer: bool = False  # a non-persistent buffer (Falcon-H1's mup_vector): sliced per forward, never saved
    in_span: bool = False

    @property
    def module(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


@dataclass(frozen=True)
class MixerState:
    """A recurrent state a sharded mixer receives as the keyword `arg` (RWKV's list of tensors, batch x channels x
    layers, held whole by the model): the mixer reads and writes the channels `partition` gives this rank of the items
    `items`, and its layer's slice (the mixer's attribute `layer` indexes the last dim) is gathered back whole after
    it, so the state the model returns is one process's."""

    path: str
    arg: str
    items: tuple[int, ...]
    layer: str
    partition: Partition


@dataclass(frozen=True)
class AttrPlan:
    """An integer a block reads as a head count or width (`config.x` for a config field): full and per rank."""

    path: str
    name: str
    full: int
    local: tuple[int, ...]

    def assign(self, module: nn.Module, value: int) -> None:
        """Set the attribute on the module at `path` (or on its config, for `config.x`)."""
        target, name = module, self.name
        if name.startswith("config."):
            target, name = module.config, name.removeprefix("config.")
        setattr(target, name, value)


@dataclass(frozen=True)
class HeadInputPlan:
    """A tensor passed to an attention block with all heads folded into dim 0 (ALiBi): sliced per rank."""

    path: str
    name: str
    heads: int
    local: tuple[tuple[int, int], ...]  # (first head, head count) per rank


@dataclass(frozen=True)
class HeadsPlan:
    """An attention block whose query heads are split: each rank's (first head, count). What it returns per head
    (its attention weights, for `output_attentions=True`) is gathered back into every head, in order. `repeats`: its
    per-head tensors hold the heads that many times over (JetMoE: each of a token's top-k attention experts' queries
    over every kv head), each time split the same way."""

    path: str
    heads: int
    local: tuple[tuple[int, int], ...]
    repeats: int = 1

    def partition(self, dim: int) -> Partition:
        """The split of the heads (each of their repeats) along `dim` of a per-head tensor."""
        runs = tuple(tuple((k * self.heads + first, count) for k in range(self.repeats)) for first, count in self.local)
        return Partition(dim, self.heads * self.repeats, runs)


@dataclass(frozen=True)
class GroupNormPlan:
    """A gated RMS norm over groups of channels a shard cuts (Mamba-2 with fewer groups than ranks): each rank's
    channels lie in group `group[rank]` of `groups`, whose statistics are summed over TP (`group_size` channels)."""

    path: str
    groups: int
    group_size: int
    group: tuple[int, ...]


@dataclass(frozen=True)
class VocabPlan:
    """Vocab parallelism: the LM head (a column layer in `layers`) and the embedding share this row split."""

    head: str
    embedding: str | None  # None: the embedding stays replicated
    tied: bool
    partition: Partition


@dataclass(frozen=True)
class Plan:
    """Every sharding decision for one model at one tp size; `origin` says where they came from."""

    tp_size: int
    origin: Origin
    source: str  # for people: the policy's name and description
    layers: tuple[LayerPlan, ...] = ()
    regions: tuple[RegionPlan, ...] = ()
    attrs: tuple[AttrPlan, ...] = ()
    head_norms: tuple[str, ...] = ()
    head_inputs: tuple[HeadInputPlan, ...] = ()
    attention: tuple[HeadsPlan, ...] = ()  # the attention blocks whose heads are split
    replicated: tuple[tuple[str, Why], ...] = ()  # (linear path, why it stays replicated)
    vocab: VocabPlan | None = None
    vocab_reason: str = ""
    params: tuple[ParamPlan, ...] = ()  # mixer parameters sharded in place (a policy's mixer rule, `planning.mixers`)
    states: tuple[MixerState, ...] = ()  # mixer states passed in whole, read and written by channel
    whole: tuple[str, ...] = ()  # inside sharded mixers: computed whole on the replicated input, gradients whole
    gathered_outputs: tuple[str, ...] = ()  # column layers whose output is gathered whole (a gate on a row layer's sum)
    group_norms: tuple[GroupNormPlan, ...] = ()
    mixers: tuple[tuple[str, str], ...] = ()  # (state-space mixer path, why it stays replicated)
    reentries: tuple[str, ...] = ()  # row layers whose summed output sharded compute reads (Mamba's x_proj)
    norms: tuple[NormPlan, ...] = ()  # norms over a split width: their statistics all-reduced
    shared: tuple[tuple[str, str], ...] = ()  # (block, the block it is tied to whole): made that module (`ties`)

    def partitions(self) -> list[Partition]:
        return (
            [layer.partition for layer in self.layers]
            + [p for r in self.regions for _, _, p in r.partitions]
            + [param.partition for param in self.params]
        )

    def replica_groups(self) -> set[tuple[int, ...]]:
        """Sets of TP ranks that hold the same rows of some tensor (replicated KV heads)."""
        return set().union(*(p.replica_groups() for p in self.partitions()))

    def sharded_params(self, model: nn.Module) -> dict[str, Partition]:
        """Parameter name -> partition, for every parameter the plan shards."""
        out = {}
        for layer in self.layers:
            out[f"{layer.path}.weight"] = layer.partition
            if layer.style == "column" and getattr(model.get_submodule(layer.path), "bias", None) is not None:
                out[f"{layer.path}.bias"] = layer.partition.with_dim(0)
        for region in self.regions:
            out.update({f"{region.path}.{name}": partition for name, _, partition in region.partitions})
        out.update({param.path: param.partition for param in self.params if not param.buffer})
        if self.vocab is not None and self.vocab.embedding is not None:
            out[f"{self.vocab.embedding}.weight"] = self.vocab.partition
        return out

    def param_bytes(self, model: nn.Module) -> list[int]:
        """Parameter bytes each rank will hold after `wrap` (tied parameters counted once)."""
        sharded = self.sharded_params(model)
        totals = [0] * self.tp_size
        for name, p in model.named_parameters():
            part = sharded.get(name)
            for rank in range(self.tp_size):
                numel = p.numel() if part is None else p.numel() // p.shape[part.dim] * part.local_size(rank)
                totals[rank] += numel * p.element_size()
        return totals

    def summary(self) -> str:
        """One line for a log: what was sharded and from where."""
        blocks = len({layer.block for layer in self.layers if self.vocab is None or layer.path != self.vocab.head})
        vocab = "vocab-parallel" if self.vocab is not None else "vocab replicated"
        return (
            f"autotp: tp_size={self.tp_size}, {self.origin.value} {self.source}: {len(self.layers)} linears in "
            f"{blocks} blocks sharded, {len(self.regions)} expert regions, {len(self.replicated)} linears "
            f"replicated, {vocab}"
        )

    def warnings(self) -> list[str]:
        """What a user should hear about: nothing sharded, blocks left replicated, vocab parallelism off (unless asked
        for: `VOCAB_OFF`)."""
        out = []
        if self.tp_size > 1 and not self.layers and not self.regions:
            out.append(f"autotp: nothing is sharded at tp_size={self.tp_size}; every rank holds the whole model")
        rejected: dict[str, Why] = {}
        for path, why in self.replicated:
            if why.reason is Replicated.NOT_VERIFIED:
                rejected.setdefault(path.rpartition(".")[0], why)
        if rejected:
            shown = "; ".join(f"{block} ({why})" for block, why in list(rejected.items())[:3])
            out.append(
                f"autotp: {len(rejected)} attention/MLP blocks stay replicated: {shown}"
                + (" ..." if len(rejected) > 3 else "")
            )
        if self.tp_size > 1 and self.vocab is None and self.vocab_reason != VOCAB_OFF:
            out.append(f"autotp: vocab parallelism is off: {self.vocab_reason}")
        return out

    def _beside_linears(self) -> list[str]:
        """The lines of what a sharded block holds besides its linears: sharded norms, parameters split in place, a
        mixer's state, what it keeps whole, group norms, re-entries, and mixers kept replicated."""
        lines: list[str] = []
        for norm in self.norms:
            lines.append(
                f"  {'norm':<10} {norm.path}  on each rank's columns, {norm.stat} of x^2 over {norm.width} summed"
            )
        for param in self.params:
            said = param.reason or f"with {param.block}'s channels"
            lines.append(
                f"  {'in place':<10} {param.path}  {param.shape} -> {_local_shapes(param.shape, param.partition)}"
                f"  ({said})"
            )
        for mixer_state in self.states:
            lines.append(
                f"  {'state':<10} {mixer_state.path}({mixer_state.arg}=...)  items {list(mixer_state.items)} read "
                f"and written by channel (dim {mixer_state.partition.dim}), the layer's slice gathered back"
            )
        for path in self.whole:
            lines.append(
                f"  {'whole':<10} {path}  replicated inside its sharded block, on the block's replicated input"
            )
        for group_norm in self.group_norms:
            lines.append(
                f"  {'group-norm':<10} {group_norm.path}  statistics of its {group_norm.groups} groups of "
                f"{group_norm.group_size} summed over TP (a group spans ranks)"
            )
        for path in self.reentries:
            lines.append(f"  {'re-enter':<10} {path}  its summed output enters the TP span again")
        for path, reason in self.mixers:
            lines.append(f"  {'mixer':<10} {path}  replicated: {reason}")
        for path, source in self.shared:
            lines.append(f"  {'shared':<10} {path}  tied whole to {source}: made that module, sharded with it")
        return lines

    def describe(self, model: nn.Module | None = None) -> str:
        """A table of every decision, for people; with the model, also each rank's parameter bytes."""
        lines = [f"autotp plan: tp_size={self.tp_size}, from {self.origin.value} {self.source}"]
        for layer in self.layers:
            style = "gathered" if layer.path in self.gathered_outputs else layer.style
            lines.append(
                f"  {style:<10} {layer.path}  {layer.shape} -> {_local_shapes(layer.shape, layer.partition)}"
                f"  ({layer.reason})"
            )
        for region in self.regions:
            for name, shape, partition in region.partitions:
                lines.append(
                    f"  {'experts':<10} {region.path}.{name}  {shape} -> {_local_shapes(shape, partition)}"
                    f"  ({region.reason})"
                )
            for name in region.bias_once:
                lines.append(f"  {'experts':<10} {region.path}.{name}  replicated, added to the sum on TP rank 0")
        lines += self._beside_linears()
        for path in self.head_norms:
            lines.append(f"  {'head-norm':<10} {path}  replicated, gradient summed over TP (acts on sharded heads)")
        for attr in self.attrs:
            lines.append(f"  {'attribute':<10} {attr.path}.{attr.name}  {attr.full} -> {list(attr.local)}")
        for head_input in self.head_inputs:
            lines.append(f"  {'head-input':<10} {head_input.path}({head_input.name}=...)  sliced to each rank's heads")
        for path, why in self.replicated:
            lines.append(f"  {'replicated':<10} {path}  ({why})")
        if self.vocab is not None:
            embedding = (
                f"embedding {self.vocab.embedding} split the same way" + (" (tied)" if self.vocab.tied else "")
                if self.vocab.embedding
                else "embedding replicated"
            )
            lines.append(
                f"  {'vocab':<10} {self.vocab.head}: logits stay sharded, cross-entropy on the shards; {embedding}"
            )
        elif self.vocab_reason:
            lines.append(f"  {'vocab':<10} not vocab-parallel: {self.vocab_reason}")
        if model is not None:
            full = sum(p.numel() * p.element_size() for p in model.parameters())
            per_rank = self.param_bytes(model)
            lines.append(
                f"  parameter bytes per rank: {' / '.join(f'{b / 2**20:.2f} MiB' for b in per_rank)}"
                f" (unsharded {full / 2**20:.2f} MiB)"
            )
        return "\n".join(lines)


def _local_shapes(shape: tuple[int, ...], partition: Partition) -> str:
    shapes = []
    for rank in range(partition.tp_size):
        local = list(shape)
        local[partition.dim] = partition.local_size(rank)
        shapes.append(tuple(local))
    return f"{shapes[0]} each" if len(set(shapes)) == 1 else " / ".join(map(str, shapes))
