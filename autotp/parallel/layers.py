"""Column- and row-parallel linears that stand in for `nn.Linear` (or GPT-2's `Conv1D`) in HF models.

Both subclass `nn.Linear` so HF code, PEFT and `isinstance` checks keep working: same `weight` and
`bias` names, a tensor returned, `in_features` / `out_features` describing the local shard. A
replaced `Conv1D` keeps its transposed [in, out] weight, so `state_dict` shapes never change.
Each sharded parameter carries a `Shard` (partition and rank) in its `autotp_shard` attribute.

`ShardedRegion` covers modules that are not linears but whose parameters shard the same way (MoE
experts stored as 3-D tensors): its float inputs enter the TP region and its output is reduced.
"""

from __future__ import annotations

import copy

from typing import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .collectives import all_gather_full, copy_to_tp, reduce_from_tp

from .overlap import DeferredWeights, copy_to_tp_joined, deferred_column_linear

from .seq_collectives import SavedChunk, reduce_scatter_seq_from_tp, seq_parallel_column_linear
from .glu import glu_linear, match
from .groups import Group, group_rank, group_size
from ..compat.hf import is_conv1d
from ..planning.sharding import Partition, Shard


class SharedInput:
    """Lets sibling column layers reading the same tensor share one backward all-reduce.

    q/k/v (or gate/up) all read the block input; summing their input gradients locally and then
    all-reducing once is what keeps a block at one backward all-reduce. Layers given a different
    tensor get their own copy, so sharing is an optimisation that can never change the result.
    The owning block clears it after each call so no activation outlives the forward.

    With `overlap` (the default), the reading layers' weights enter with the input too: each layer's
    backward returns dL/dX at once and leaves dL/dW to the entry, which computes it while the
    all-reduce of dL/dX runs (`overlap.DeferredWeights`), as Megatron-LM overlaps them.
    """

    def __init__(self, group: Group):
        self.group = group
        self.sequence_parallel = False  # then the column layers save only their sequence chunk (autotp.parallel.sequence)
        self.overlap = True  # weight gradients computed during the input gradient's all-reduce (wrap(overlap=...))
        self.joining: list[nn.Parameter] = []  # replicated LoRA weights of the layers reading it (autotp.parallel.lora)
        self.readers: list[LinearLayer] = []  # the column layers reading it, for overlap
        self._source: torch.Tensor | None = None
        self._copy: torch.Tensor | None = None
        self._joined: dict[int, torch.Tensor] = {}
        self._deferred: dict[int, tuple[torch.Tensor, int]] = {}
        self._pending: DeferredWeights | None = None
        self._saved: SavedChunk | None = None
        self._outputs: dict[int, torch.Tensor] = {}  # the readers' outputs in this call, by autograd node (autotp.parallel.glu)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x is self._copy:  # already inside (a LoRA wrapper entered for its base layer and adapter)
            return x
        if x is not self._source:
            grads = torch.is_grad_enabled()
            weights = [w for w in self.joining if w.requires_grad] if grads else []
            readers = [r for r in self.readers if r.weight.requires_grad and not r.gathered] if (
                grads and self.overlap and not torch.compiler.is_compiling()) else []
            entered, self._pending = copy_to_tp_joined(x, weights, self.group, [r.weight for r in readers],
                                                       [r.transposed for r in readers])
            self._source, self._copy = x, entered[0]
            self._clear_after_backward(x)
            self._joined = {id(w): view for w, view in zip(weights, entered[1:])}
            self._deferred = {} if self._pending is None else {  # tp 1: nothing to overlap
                id(r.weight): (view, i) for i, (r, view) in enumerate(zip(readers, entered[1 + len(weights):]))}
        return self._copy

    def linear(self, x: torch.Tensor, layer: LinearLayer) -> torch.Tensor:
        """`layer`'s matmul on the input entered last (`x`), its weight gradient deferred to the entry if it entered."""
        deferred = self._deferred.get(id(layer.weight)) if x is self._copy else None
        if deferred is None:
            return layer._matmul(x, layer.bias)
        view, index = deferred
        return deferred_column_linear(x, view, layer.bias, self._pending, index)

    def record(self, output: torch.Tensor) -> torch.Tensor:
        """Remember a reader's output until the block's forward ends, for the row layer to recognise (`column_output`)."""
        if not torch.compiler.is_compiling() and output.grad_fn is not None:
            self._outputs[id(output.grad_fn)] = output
        return output

    def column_output(self, node, output_nr: int) -> torch.Tensor | None:
        """The reader's output whose autograd edge is (`node`, `output_nr`), if one was recorded in this call."""
        output = self._outputs.get(id(node))
        return output if output is not None and output.grad_fn is node and output.output_nr == output_nr else None

    def saved_chunk(self, x: torch.Tensor) -> SavedChunk | None:
        """Under sequence parallelism, this rank's chunk of the gathered input `x`, one for every layer reading it."""
        if group_size(self.group) == 1 or not torch.is_grad_enabled():
            return None
        if self._saved is None or self._saved.source() is not x:
            self._saved = SavedChunk(x, self.group, 1)
            self._clear_after_backward(x)
        return self._saved

    def weight(self, weight: nn.Parameter) -> torch.Tensor:
        """A replicated weight as used inside the region entered last: its partial gradient is summed in the input
        gradient's all-reduce, or alone if it did not enter with the input."""
        joined = self._joined.get(id(weight))
        return joined if joined is not None else copy_to_tp(weight, self.group)

    def _clear_after_backward(self, x: torch.Tensor) -> None:
        """Clear once `x`'s gradient is complete (the block's backward is done): a checkpointed recomputation may stop
        before the block's forward hook clears, and would leave its input (and the graph behind it) held. Not under
        compile, where a hook on an intermediate tensor breaks the graph."""
        if torch.is_grad_enabled() and x.requires_grad and not torch.compiler.is_compiling():
            x.register_hook(lambda grad: self.clear())

    def clear(self, *_) -> None:
        if self._saved is not None:
            self._saved.release()  # the readers' saved copies remain
        self._source = self._copy = self._saved = self._pending = None
        self._joined, self._deferred, self._outputs = {}, {}, {}


def shard_parameter(param: nn.Parameter, partition: Partition, rank: int) -> nn.Parameter:
    """A new Parameter holding this rank's rows, tagged with its `Shard` (works on the meta device too)."""
    shard = nn.Parameter(partition.shard(param.detach(), rank), requires_grad=param.requires_grad)
    shard.autotp_shard = Shard(partition, rank)
    return shard


def forget_shard(param: nn.Parameter) -> None:
    """Drop the shard metadata `shard_parameter` and `gather_parameter_` put on a parameter that now holds a full tensor."""
    for key in ("autotp_shard", "autotp_full", "autotp_stashed_grad"):
        vars(param).pop(key, None)


def gather_parameter_(param: nn.Parameter, group: Group) -> None:
    """Swap the shard for the full tensor in place (same Parameter object), stashing the gradient.

    A parameter shared by two modules (tied embedding and LM head) is gathered once.
    """
    if getattr(param, "autotp_full", False):
        return
    param.autotp_full = True
    param.autotp_stashed_grad, param.grad = param.grad, None
    param.data = all_gather_full(param.data, param.autotp_shard.partition, group)


def partition_parameter_(param: nn.Parameter) -> None:
    """Back to this rank's rows of whatever the full tensor became; a full gradient is sliced and added."""
    if not getattr(param, "autotp_full", False):
        return
    param.autotp_full = False
    shard = param.autotp_shard
    full_grad, param.grad = param.grad, None
    param.data = shard.partition.shard(param.data, shard.rank)
    grad, param.autotp_stashed_grad = param.autotp_stashed_grad, None
    if full_grad is not None:
        sliced = shard.partition.shard(full_grad, shard.rank)
        grad = sliced if grad is None else grad + sliced
    param.grad = grad


class ParallelLinear(nn.Linear):
    """Shared mechanics: holding a shard, and swapping it for the full weight and back."""

    def __init__(self, linear: nn.Module, partition: Partition, group: Group):
        nn.Module.__init__(self)
        self.group = group
        self.tp_rank, self.tp_size = group_rank(group), group_size(group)
        if partition.tp_size != self.tp_size:
            raise ValueError(f"partition is for tp_size={partition.tp_size}, the group has {self.tp_size} ranks")
        self.transposed = is_conv1d(linear)  # weight stored [in, out]
        self.partition = partition
        self.gathered = False
        out_dim = 1 if self.transposed else 0
        self.full_out, self.full_in = linear.weight.shape[out_dim], linear.weight.shape[1 - out_dim]
        self.weight = shard_parameter(linear.weight, partition, self.tp_rank)
        self.bias = None
        if linear.bias is not None:
            bias_partition = self._bias_partition()
            self.bias = (nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
                         if bias_partition is None else shard_parameter(linear.bias, bias_partition, self.tp_rank))
        self._set_features()

    def _bias_partition(self) -> Partition | None:
        raise NotImplementedError

    def __deepcopy__(self, memo: dict) -> ParallelLinear:
        """A copy of the shard that shares the process group (a handle, not data), as PEFT's modules_to_save makes."""
        memo[id(self.group)] = self.group
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        shared = vars(self).get("_shared_input")
        if shared is not None:  # the copy reads its input alone: a fresh entry (not the siblings', nor their LoRA)
            fresh = memo[id(shared)] = SharedInput(self.group)
            fresh.sequence_parallel, fresh.overlap, fresh.readers = shared.sequence_parallel, shared.overlap, [new]
        block = vars(self).get("block_input")
        if block is not None:  # a copied row layer alone has no column outputs to recognise (autotp.parallel.glu)
            memo.setdefault(id(block), None)
        new.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()})
        for name, param in self._parameters.items():  # Parameter's own deepcopy drops the shard metadata
            if param is not None and hasattr(param, "autotp_shard"):
                new._parameters[name].autotp_shard = param.autotp_shard
        return new

    def _set_features(self) -> None:
        rows, cols = self.weight.shape
        self.out_features, self.in_features = (cols, rows) if self.transposed else (rows, cols)
        if self.transposed:  # Conv1D's own names
            self.nf, self.nx = self.out_features, self.in_features

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.weight.t() if self.transposed else self.weight, bias)

    def gather_(self) -> None:
        """Hold the full weight (same Parameter objects) and compute like the original layer."""
        for param in self._sharded_params():
            gather_parameter_(param, self.group)
        self.gathered = True
        self._set_features()

    def partition_(self) -> None:
        """Back to this rank's shard, keeping whatever the full weight became meanwhile."""
        for param in self._sharded_params():
            partition_parameter_(param)
        self.gathered = False
        self._set_features()

    def _sharded_params(self) -> list[nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None and hasattr(p, "autotp_shard")]

    def extra_repr(self) -> str:
        state = "gathered" if self.gathered else f"tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        kind = ", conv1d" if self.transposed else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"full=({self.full_out}, {self.full_in}){kind}, {state}, {self.partition.describe()}"
        )


class LinearLayer(ParallelLinear):
    """Column-parallel linear: weight split on the output dim, output left sharded, dL/dX all-reduced."""

    def __init__(self, linear: nn.Module, partition: Partition, group: Group, shared_input: SharedInput | None = None):
        super().__init__(linear, partition, group)
        expected = 1 if self.transposed else 0
        if partition.dim != expected:
            raise ValueError(f"a column-parallel weight is split on its output dim ({expected})")
        self._shared_input = shared_input or SharedInput(group)
        self._shared_input.readers.append(self)

    def _bias_partition(self) -> Partition:
        return self.partition.with_dim(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gathered:
            return self._matmul(x, self.bias)
        shared = self._shared_input
        if shared.sequence_parallel:
            weight = self.weight.t() if self.transposed else self.weight
            return shared.record(seq_parallel_column_linear(x, weight, self.bias, shared.saved_chunk(x)))
        return shared.record(shared.linear(shared(x), self))


class LinearAllreduce(ParallelLinear):
    """Row-parallel linear: weight split on the input dim, partial outputs all-reduced, bias added once after."""

    def __init__(self, linear: nn.Module, partition: Partition, group: Group):
        super().__init__(linear, partition, group)
        self.sequence_parallel = False  # reduce-scatter the output along the sequence instead of all-reducing
        self.block_input: SharedInput | None = None  # its block's column input (autotp.parallel.glu; gathered again early, SP)
        self.recompute_glu = True  # wrap(recompute_glu=...): keep act(gate) * up's inputs, not it (autotp.parallel.glu)
        self.reduce_output = True  # False: the partial output is returned and reduced by the owner (autotp.parallel.lora)
        expected = 0 if self.transposed else 1
        if partition.dim != expected:
            raise ValueError(f"a row-parallel weight is split on its input dim ({expected})")

    def _bias_partition(self) -> None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gathered:
            return self._matmul(x, self.bias)
        y = self._product_matmul(x)
        if not self.reduce_output:
            return y
        if self.sequence_parallel:
            saved = self.block_input._saved if self.block_input is not None else None
            y = reduce_scatter_seq_from_tp(y, self.group, prefetch=saved)
        else:
            y = reduce_from_tp(y, self.group)
        return y if self.bias is None else y + self.bias

    def _product_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """The matmul, recomputing a gated MLP's product `x` in backward rather than keeping it where it is one."""
        if self.recompute_glu and self.block_input is not None and torch.is_grad_enabled() and x.requires_grad:
            found = match(x, self.block_input.column_output)
            if found is not None:
                return glu_linear(x, self.weight, self.transposed, found)
        return self._matmul(x, None)


class ShardedRegion:
    """A module computed on sharded parameters (MoE experts): float inputs enter the TP region, the output is reduced.

    The module keeps its class, forward and parameter names; hooks add the two collectives.
    """

    def __init__(self, module: nn.Module, partitions: Mapping[str, Partition], group: Group):
        self.module, self.group, self.gathered = module, group, False
        rank = group_rank(group)
        for name, partition in partitions.items():
            setattr(module, name, shard_parameter(getattr(module, name), partition, rank))
        self.names = list(partitions)
        module.register_forward_pre_hook(self._enter, with_kwargs=True)
        module.register_forward_hook(self._leave)
        module.autotp_region = self

    def _enter(self, module, args, kwargs):
        if self.gathered:
            return None
        copy = lambda t: copy_to_tp(t, self.group) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        return tuple(copy(a) for a in args), {k: copy(v) for k, v in kwargs.items()}

    def _leave(self, module, args, output):
        return output if self.gathered else reduce_from_tp(output, self.group)

    def gather_(self) -> None:
        for name in self.names:
            gather_parameter_(getattr(self.module, name), self.group)
        self.gathered = True

    def partition_(self) -> None:
        for name in self.names:
            partition_parameter_(getattr(self.module, name))
        self.gathered = False
