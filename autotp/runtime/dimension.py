"""A parallel dimension as one unit: its axis, its refusals, its pipeline step, and its part of each operation that
spans the dimensions, the training step (`forward_backward`) among them.

Each dimension package (`autotp.tp`, `autotp.vocab`, `autotp.sp`, `autotp.cp`, `autotp.ep`) defines one `Dimension`;
`autotp.parallelize` lists them in order, and each one's `apply` records it in `TPState.dims` when it is active. The
gradient sync and norm (`autotp.dp.ddp`), FSDP (`autotp.dp.fsdp`), the DDP guard, the saved and exported layouts and
the Trainer loop over `TPState.dims` instead of branching on one dimension. Every hook does nothing by default (`step`:
the model's own forward and backward), so a dimension implements only the parts it has.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from ..mesh import Group
from ..options import WrapOptions
from ..planning.plan import Plan
from ..state import TPState, find_state
from .rollback import Removable


class Step(Protocol):
    """One step of `autotp.parallelize`: it changes the model and returns what only it can undo (hooks on tensors the
    model keeps); `runtime.rollback.Snapshot` puts back the rest."""

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]: ...


class Dimension:
    """A parallelism: `name` is its mesh axis (its key in `TPState.dims`). `plan` is always the full plan; the part
    tensor parallelism applies is `state.plan` (`base_plan`)."""

    name: str = ""
    allows_ddp: bool = True  # whether DDP may sync its gradients (else `autotp.allreduce_gradients` must, each step)
    owns_step: bool = False  # whether its `step` runs a training step's forward and backward itself (a schedule)

    def refuse(self, model: nn.Module, plan: Plan, options: WrapOptions) -> None:
        """Raise, naming the reason, for options this model cannot take: at planning time, with no process group."""

    def split_plan(self, model: nn.Module, plan: Plan, options: WrapOptions) -> tuple[Plan, tuple[str, ...]]:
        """The plan left to tensor parallelism, and the modules this dimension keeps whole and splits itself."""
        return plan, ()

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        """Its pipeline step; records itself in `state.dims` when active."""
        return []

    def step(self, model: nn.Module, batch: dict[str, Any]) -> Any:
        """A training step's forward and backward of the whole `batch` (`forward_backward`), returning the model's
        output: the model's own forward and a backward of its loss, unless the dimension `owns_step` (a pipeline runs
        its schedule)."""
        out = model(**batch)
        out.loss.backward()
        return out

    def sync_gradients(self, model: nn.Module, state: TPState, replicas: int, average: bool) -> None:
        """Its part of `autotp.allreduce_gradients` (`replicas`: the DP x CP size the dense gradients average over)."""

    def norm(
        self, params: list[nn.Parameter], norm_type: float, state: TPState
    ) -> tuple[list[nn.Parameter], torch.Tensor | None]:
        """Its part of `autotp.clip_grad_norm_`: the parameters it leaves to the dense norm, and its own part (None:
        none), complete over every rank."""
        return params, None

    def reduce_norm(self, total: torch.Tensor, norm_type: float, state: TPState) -> torch.Tensor:
        """Its part of `autotp.clip_grad_norm_` once every other part is complete over this rank's model: the total
        (a sum of squares, or a max) combined over the ranks holding other parts of the model (a pipeline's stages)."""
        return total

    def fully_shard(self, options: dict[str, Any], state: TPState) -> dict[int, Any]:
        """Its part of `autotp.fully_shard` (`options`: torch's `fully_shard` keywords over DP x CP), before the
        decoder layers: the parameters it sharded itself, by id, with the tag they keep."""
        return {}

    def sequence_length(self, length: int) -> int:
        """The length of the sequence each rank's decoder layers hold of a `length`-token batch, given the length the
        outer dimensions leave (a pipeline's stages send hidden states of this length): CP's chunk, then SP's."""
        return length

    def check_ddp(self, group: Group, state: TPState) -> None:
        """Refuse `DistributedDataParallel` over `group` when it would mix what this dimension splits."""

    def broadcast_replicas(self, model: nn.Module, state: TPState) -> None:
        """Its part of the last step: make the copies it holds on several ranks equal."""

    def split_group(self) -> Group:
        """The group its own tensors are split over besides TP, which saving and exporting gather over (None: none)."""
        return None

    def layout(self) -> dict[str, int]:
        """What a training checkpoint records of it (`autotp.io.checkpoint.save.layout`)."""
        return {}

    def refuse_export(self, target: Any) -> None:
        """Raise if `autotp.export_weights` cannot send its tensors to the engine layout `target`."""


def base_plan(
    dimensions: list[Dimension], model: nn.Module, plan: Plan, options: WrapOptions
) -> tuple[Plan, tuple[str, ...]]:
    """The plan tensor parallelism applies, and the modules the dimensions keep whole (each one's `split_plan`)."""
    whole: tuple[str, ...] = ()
    for dimension in dimensions:
        plan, kept = dimension.split_plan(model, plan, options)
        whole += kept
    return plan, whole


def stepping(model: nn.Module) -> Dimension | None:
    """The active dimension that runs a training step itself (`owns_step`), or None: the step is then the model's own
    forward and backward. Seen through `torch.compile(model)` too, whose step that dimension runs or refuses."""
    state = find_state(model)
    compiled = getattr(model, "_orig_mod", None) if state is None else None  # torch.compile(model)'s module
    if isinstance(compiled, nn.Module):
        state = find_state(compiled)
    return None if state is None else next((d for d in state.dims.values() if d.owns_step), None)


def forward_backward(model: nn.Module, **batch: Any) -> Any:
    """Run the forward and the backward of the whole `batch`; return the model's output, whose `.loss` is, on every
    rank, the loss one process computes on the whole batch.

    Where no dimension runs the step itself (`owns_step`), and on a model autotp did not wrap, this is
    `out = model(**batch); out.loss.backward()`. Under a pipeline it is the pipeline's `step`: torch's schedule
    (`pp_schedule`) over `pp_microbatches` micro-batches, the batch's rows split evenly; the output then holds the loss
    only. Every rank is given the same whole batch. Then, as at every layout: `autotp.allreduce_gradients(model)` (it
    also sums a tied embedding's two copies) and `optimizer.step()`.
    """
    return (stepping(model) or Dimension()).step(model, batch)  # no dimension's own: the model's forward, backward
