"""Column- and row-parallel linears that stand in for `nn.Linear` inside Hugging Face models.

Both subclass `nn.Linear` so HF code, PEFT and `isinstance` checks keep working: same `weight` and
`bias` names, a tensor returned, `in_features` / `out_features` describing the local shard. Each
sharded parameter carries a `Shard` (partition and rank) in its `autotp_shard` attribute.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .comm import Group, all_gather_full, copy_to_tp, group_rank, group_size, reduce_from_tp
from .sharding import Partition, Shard


class SharedInput:
    """Lets sibling column layers reading the same tensor share one backward all-reduce.

    q/k/v (or gate/up) all read the block input; summing their input gradients locally and then
    all-reducing once is what keeps a block at one backward all-reduce. Layers given a different
    tensor get their own copy, so sharing is an optimisation that can never change the result.
    The owning block clears it after each call so no activation outlives the forward.
    """

    def __init__(self, group: Group):
        self.group = group
        self._source: torch.Tensor | None = None
        self._copy: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x is not self._source:
            self._source, self._copy = x, copy_to_tp(x, self.group)
        return self._copy

    def clear(self, *_) -> None:
        self._source = self._copy = None


class _ParallelLinear(nn.Linear):
    """Shared mechanics: holding a shard, and swapping it for the full weight and back."""

    style = ""

    def __init__(self, linear: nn.Linear, partition: Partition, group: Group):
        nn.Module.__init__(self)
        self.group = group
        self.tp_rank, self.tp_size = group_rank(group), group_size(group)
        if partition.tp_size != self.tp_size:
            raise ValueError(f"partition is for tp_size={partition.tp_size}, the group has {self.tp_size} ranks")
        self.partition = partition
        self.gathered = False
        self.full_in, self.full_out = linear.in_features, linear.out_features
        self.weight = nn.Parameter(
            partition.shard(linear.weight.detach(), self.tp_rank), requires_grad=linear.weight.requires_grad
        )
        self.weight.autotp_shard = Shard(partition, self.tp_rank)
        self.bias = None if linear.bias is None else self._make_bias(linear.bias)
        self._set_features()

    def _make_bias(self, bias: nn.Parameter) -> nn.Parameter:
        raise NotImplementedError

    def _set_features(self) -> None:
        self.out_features, self.in_features = self.weight.shape

    def gather_(self) -> None:
        """Hold the full weight (same Parameter objects) and compute like a plain `nn.Linear`."""
        for param in self._sharded_params():
            param.autotp_stashed_grad, param.grad = param.grad, None
            param.data = all_gather_full(param.data, param.autotp_shard.partition, self.group)
        self.gathered = True
        self._set_features()

    def partition_(self) -> None:
        """Back to this rank's shard, keeping whatever the full weight became meanwhile.

        A gradient computed on the full weight is sliced and added to the one held before.
        """
        for param in self._sharded_params():
            partition, full_grad, param.grad = param.autotp_shard.partition, param.grad, None
            param.data = partition.shard(param.data, self.tp_rank)
            grad, param.autotp_stashed_grad = param.autotp_stashed_grad, None
            if full_grad is not None:
                sliced = partition.shard(full_grad, self.tp_rank)
                grad = sliced if grad is None else grad + sliced
            param.grad = grad
        self.gathered = False
        self._set_features()

    def _sharded_params(self) -> list[nn.Parameter]:
        return [p for p in (self.weight, self.bias) if p is not None and hasattr(p, "autotp_shard")]

    def extra_repr(self) -> str:
        state = "gathered" if self.gathered else f"tp_rank={self.tp_rank}, tp_size={self.tp_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"full=({self.full_out}, {self.full_in}), {state}, {self.partition.describe()}"
        )


class LinearLayer(_ParallelLinear):
    """Column-parallel linear: weight split on the output dim, output left sharded, dL/dX all-reduced."""

    style = "column"

    def __init__(self, linear: nn.Linear, partition: Partition, group: Group, shared_input: SharedInput | None = None):
        if partition.dim != 0:
            raise ValueError("a column-parallel weight is split on dim 0 (output features)")
        super().__init__(linear, partition, group)
        self._shared_input = shared_input or SharedInput(group)

    def _make_bias(self, bias: nn.Parameter) -> nn.Parameter:
        part = Partition(0, self.partition.parts)
        sharded = nn.Parameter(part.shard(bias.detach(), self.tp_rank), requires_grad=bias.requires_grad)
        sharded.autotp_shard = Shard(part, self.tp_rank)
        return sharded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gathered:
            x = self._shared_input(x)
        return F.linear(x, self.weight, self.bias)


class LinearAllreduce(_ParallelLinear):
    """Row-parallel linear: weight split on the input dim, partial outputs all-reduced, bias added once after."""

    style = "row"

    def __init__(self, linear: nn.Linear, partition: Partition, group: Group):
        if partition.dim != 1:
            raise ValueError("a row-parallel weight is split on dim 1 (input features)")
        super().__init__(linear, partition, group)

    def _make_bias(self, bias: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gathered:
            return F.linear(x, self.weight, self.bias)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias
