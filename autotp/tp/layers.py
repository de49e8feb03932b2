"""Column- and row-parallel linears that stand in for `nn.Linear` (or GPT-2's `Conv1D`) in HF models.

Both subclass `nn.Linear` so HF code, PEFT and `isinstance` checks keep working: same `weight` and
`bias` names, a tensor returned, `in_features` / `out_features` describing the local shard. A
replaced `Conv1D` keeps its transposed [in, out] weight, so `state_dict` shapes never change.
Each sharded parameter carries a `Shard` (partition and rank) in its `autotp_shard` attribute.

`ShardedRegion` covers modules that are not linears but whose parameters shard the same way (MoE
experts stored as 3-D tensors): its float inputs enter a TP span and its output is reduced.

Gathered (`gather_`), a layer holds its full weight and its `forward` is the original layer's, with
no collective, until `partition_`: the mode is which forward runs, not a flag every path checks.
"""

from __future__ import annotations

import copy
from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ..compat.hf import is_conv1d
from ..mesh import Group, group_rank, group_size
from ..planning.sharding import Partition
from ..runtime.collectives import all_gather_full, copy_to_tp, reduce_from_tp
from ..runtime.seq_collectives import reduce_scatter_seq_from_tp, seq_parallel_column_linear
from ..runtime.shards import gather_parameter_, held_shard, partition_parameter_, shard_parameter
from .block_entry import BlockEntry
from .float8 import SHARDED_OPERANDS, float8_matmul
from .glu import glu_linear, match
from .params import routed_bias


class ParallelLinear(nn.Linear):
    """Shared mechanics: holding a shard, and swapping it for the full weight and back.

    A torchao `Float8Linear` replaced keeps its float8 matmul (`float8`, `autotp.tp.float8`): `local_linear` runs it,
    the `style`'s sharded operands scaled over the group; the fused paths (overlap, glu) then step aside.
    """

    style = ""  # "column" or "row": which operands are shards (`autotp.tp.float8.SHARDED_OPERANDS`)

    def __init__(self, linear: nn.Module, partition: Partition, group: Group):
        nn.Module.__init__(self)
        self.group = group
        self.tp_rank, self.tp_size = group_rank(group), group_size(group)
        if partition.tp_size != self.tp_size:
            raise ValueError(f"partition is for tp_size={partition.tp_size}, the group has {self.tp_size} ranks")
        self.transposed = is_conv1d(linear)  # weight stored [in, out]
        self.partition = partition
        self.float8 = float8_matmul(linear, group)
        out_dim = 1 if self.transposed else 0
        self.full_out, self.full_in = linear.weight.shape[out_dim], linear.weight.shape[1 - out_dim]
        self.weight = shard_parameter(linear.weight, partition, self.tp_rank)
        self.bias = None
        if linear.bias is not None:
            bias_partition = self._bias_partition()
            self.bias = (  # a whole bias (a row layer's) is the layer's own: an optimizer made before wrap trains it
                linear.bias if bias_partition is None else shard_parameter(linear.bias, bias_partition, self.tp_rank)
            )
        self._set_features()

    def _bias_partition(self) -> Partition | None:
        raise NotImplementedError

    def __deepcopy__(self, memo: dict) -> ParallelLinear:
        """A copy of the shard that shares the process group (a handle, not data), as PEFT's modules_to_save makes."""
        memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        self._deepcopy_entries(new, memo)
        new.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()})
        for name, param in self._parameters.items():  # Parameter's own deepcopy drops the shard metadata
            if param is not None and hasattr(param, "autotp_shard"):
                new._parameters[name].autotp_shard = param.autotp_shard
        return new

    def _deepcopy_entries(self, new: ParallelLinear, memo: dict) -> None:
        """What a copy must not share with the original's block (see the subclasses)."""

    def _set_features(self) -> None:
        rows, cols = self.weight.shape
        self.out_features, self.in_features = (cols, rows) if self.transposed else (rows, cols)
        if self.transposed:  # Conv1D's own names
            self.nf, self.nx = self.out_features, self.in_features

    def local_linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The plain matmul on the weight held now (the shard, or the full weight when gathered)."""
        if self.float8 is not None:
            sharded = {} if self.is_gathered() or self.tp_size == 1 else SHARDED_OPERANDS[self.style]
            return self.float8(x, self.weight if self.transposed else self.weight.t(), bias, sharded)
        return F.linear(x, self.weight.t() if self.transposed else self.weight, bias)

    def _full_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The original layer's forward, on the full weight (gathered)."""
        return self.local_linear(x, self.bias)

    def gather_(self) -> None:
        """Hold the full weight (same Parameter objects) and compute like the original layer."""
        for param in self._sharded_params():
            gather_parameter_(param, self.group)
        self.forward = self._full_forward
        self._set_features()

    def partition_(self) -> None:
        """Back to this rank's shard, keeping whatever the full weight became meanwhile."""
        for param in self._sharded_params():
            partition_parameter_(param)
        self.__dict__.pop("forward", None)  # the instance's own forward; vars() is typed read-only
        self._set_features()

    def is_gathered(self) -> bool:
        """Whether the layer holds its full weight now (after `gather_`, until `partition_`), not this rank's shard."""
        return "forward" in vars(self)

    def full_tensor(self, name: str = "weight", grad: bool = False) -> torch.Tensor | None:
        """The whole parameter `name` ("weight" or "bias"), as one process holds it, or its whole gradient (`grad`;
        None where the parameter has none): each rank's shard gathered over the group, the layer left as it is.

        Collective over the layer's group: every rank calls it, and with `grad` every rank holds a gradient or none
        does. A new tensor, not autograd-tracked; a bias that is not sharded (a row layer's) is copied as held.
        """
        if name not in ("weight", "bias"):
            raise ValueError(f"full_tensor takes 'weight' or 'bias', got {name!r}")
        param = getattr(self, name)
        if param is None:
            raise ValueError(f"{type(self).__name__} has no {name}")
        tensor = param.grad if grad else param.detach()
        if tensor is None:
            return None
        shard = held_shard(param)  # None: not sharded, or gathered whole
        if shard is None or self.tp_size == 1:
            return tensor.clone()
        return all_gather_full(tensor, shard.partition, self.group)

    def _sharded_params(self) -> list[nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None and hasattr(p, "autotp_shard")]

    def extra_repr(self) -> str:
        state = "gathered" if self.is_gathered() else f"tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        kind = ", conv1d" if self.transposed else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"full=({self.full_out}, {self.full_in}){kind}, {state}, {self.partition.describe()}"
        )


class LinearLayer(ParallelLinear):
    """Column-parallel linear: weight split on the output dim, output left sharded, dL/dX all-reduced.

    `overlap` (default: the entry's, else on) computes the weight gradient while dL/dX's all-reduce runs
    (Megatron's overlap, `wrap(overlap=...)`); `entry` is shared by sibling layers reading the same input.
    """

    style = "column"

    def __init__(
        self,
        linear: nn.Module,
        partition: Partition,
        group: Group,
        entry: BlockEntry | None = None,
        *,
        overlap: bool | None = None,
    ):
        super().__init__(linear, partition, group)
        expected = 1 if self.transposed else 0
        if partition.dim != expected:
            raise ValueError(f"a column-parallel weight is split on its output dim ({expected})")
        if entry is not None and overlap is not None and overlap != entry.overlap:
            raise ValueError(f"overlap={overlap} but the entry given has overlap={entry.overlap}; pass one of them")
        # shared with the sibling layers reading the same block input
        self.entry = entry or BlockEntry(group, overlap=True if overlap is None else overlap)
        self.entry.add_reader(self)

    @property
    def overlap(self) -> bool:
        """Whether the weight gradient is computed during dL/dX's all-reduce; set it to turn overlap off or on, for
        every layer sharing this layer's entry (they read one input, whose gradient is all-reduced once)."""
        return self.entry.overlap

    @overlap.setter
    def overlap(self, value: bool) -> None:
        self.entry.overlap = value

    def _bias_partition(self) -> Partition:
        return self.partition.with_dim(0)

    @property
    def sequence_parallel(self) -> bool:
        """Whether it reads a sequence-gathered input and keeps only its chunk (its entry's option)."""
        return self.entry.sequence_parallel

    def _deepcopy_entries(self, new: ParallelLinear, memo: dict) -> None:
        """A copy of the layer alone reads its input alone: a fresh entry (not the siblings', nor their LoRA). In a
        copy of its block (of the model) it shares the block's copied entry with its copied siblings, which the
        block's copied hook clears after each forward."""
        if id(self.entry) not in memo:
            memo[id(self.entry)] = self.entry.fresh(new)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        entry = self.entry
        if entry.sequence_parallel:
            weight = self.weight.t() if self.transposed else self.weight
            return entry.record(seq_parallel_column_linear(x, weight, self.bias, entry.saved_chunk(x)))
        return entry.record(entry.linear(entry(x), self))


class LinearAllreduce(ParallelLinear):
    """Row-parallel linear: weight split on the input dim, partial outputs all-reduced, bias added once after."""

    style = "row"

    def __init__(
        self,
        linear: nn.Module,
        partition: Partition,
        group: Group,
        *,
        entry: BlockEntry | None = None,
        sequence_parallel: bool = False,
        recompute_glu: bool = True,
        block_entry: BlockEntry | None = None,
    ):
        super().__init__(linear, partition, group)
        self.sequence_parallel = sequence_parallel  # reduce-scatter the output along the sequence, not all-reduce
        # its block's column entry, as `LinearLayer.entry` (autotp.tp.glu; gathered again early, SP);
        # `block_entry=` is its name before it was `entry=` like the column layer's
        self.entry = entry or block_entry
        self.recompute_glu = recompute_glu  # keep act(gate) * up's inputs, not it (autotp.tp.glu)
        self.reduce_output = True  # False: its owner reduces the partial output (autotp.tp.lora)
        expected = 0 if self.transposed else 1
        if partition.dim != expected:
            raise ValueError(f"a row-parallel weight is split on its input dim ({expected})")

    def _bias_partition(self) -> None:
        return None

    def _deepcopy_entries(self, new: ParallelLinear, memo: dict) -> None:
        """A copied row layer alone has no column outputs to recognise (autotp.tp.glu)."""
        if self.entry is not None:
            memo.setdefault(id(self.entry), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._product_matmul(x)
        if not self.reduce_output:
            return y
        if self.sequence_parallel:
            saved = self.entry.current_chunk() if self.entry is not None else None
            y = reduce_scatter_seq_from_tp(y, self.group, prefetch=saved)
        else:
            y = reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def _product_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The matmul, recomputing a gated MLP's product `x` in backward rather than keeping it where it is one."""
        if (
            self.float8 is None
            and self.recompute_glu
            and self.entry is not None
            and torch.is_grad_enabled()
            and (x.requires_grad)
        ):
            found = match(x, self.entry.column_output)
            if found is not None:
                return glu_linear(x, self.weight, self.transposed, found)
        return self.local_linear(x, None)


class ShardedRegion:
    """A module computed on sharded parameters (MoE experts): float inputs enter a TP span, the output is reduced.

    The module keeps its class, forward and parameter names; hooks add the two collectives, and do nothing while the
    model is gathered (`state.sharded_only`). `side`: a parallel-experts linear (`autotp.planning.expert_linears`)
    gets only the entry ("column") or only the sum ("row").
    """

    def __init__(
        self,
        module: nn.Module,
        partitions: Mapping[str, Partition],
        group: Group,
        state,
        bias_once: tuple = (),
        side: str = "",
    ):
        self.module, self.group = module, group
        self.rank = group_rank(group)
        for name, partition in partitions.items():
            setattr(module, name, shard_parameter(getattr(module, name), partition, self.rank))
        self.names, self.bias_once = list(partitions), bias_once
        if side != "row":
            module.register_forward_pre_hook(state.sharded_only(self._enter), with_kwargs=True)
        if side != "column":
            module.register_forward_hook(state.sharded_only(self._leave), with_kwargs=True)
        module.autotp_region = self

    def _enter(self, module, args, kwargs):
        copy = lambda t: copy_to_tp(t, self.group) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}

    def _leave(self, module, args, kwargs, output):
        if self.rank:  # the experts' output biases are counted on rank 0 (`autotp.tp.params`)
            for name in self.bias_once:
                output = output - routed_bias(module, name, args, kwargs).to(output.dtype)
        return reduce_from_tp(output, self.group)

    def gather_(self) -> None:
        for name in self.names:
            gather_parameter_(getattr(self.module, name), self.group)

    def partition_(self) -> None:
        for name in self.names:
            partition_parameter_(getattr(self.module, name))
