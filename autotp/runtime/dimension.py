"""A parallel dimension as one unit: its axis, its refusals, its step in `autotp.parallelize`, and its part of each
operation that spans the dimensions, the training step (`forward_backward`) among them.

Each dimension package (`autotp.tp`, `autotp.vocab`, `autotp.sp`, `autotp.cp`, `autotp.ep`) defines one `Dimension`;
`autotp.parallelize` lists them in order, and each one's `apply` records it in `TPState.dims` when it is active. The
gradient sync and norm (`autotp.dp.ddp`), FSDP (`autotp.dp.fsdp`), the DDP guard, the saved and exported layouts and
the Trainer loop over `TPState.dims` instead of branching on one dimension. Every hook does nothing by default, so a
dimension implements only the parts it has (`step`: the model's own forward and backward). A dimension that holds the model in parts over its ranks (a pipeline's
stages) says what this rank holds (`owned`, a `Part`) and how every part is collected as one model's (`collect`, a
`Collected`), so saving, loading and exporting need not know which dimension it is.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
from torch import nn

from ..mesh import Group
from ..options import WrapOptions
from ..planning.plan import Plan
from ..state import TPState, find_state
from .rollback import Removable

Like = list[tuple[tuple[int, ...], torch.dtype]]  # the shapes and dtypes of the tensors of one message


class Part(Protocol):
    """What this rank holds of a model split by names over ranks (a pipeline's stages), for a training checkpoint:
    each rank saves and loads its part under the full names (`Dimension.owned`)."""

    where: str  # how the model is held, for an error ("under a pipeline" and its size)
    whole: str  # the option that holds it whole, for an error (its size at 1)

    def holds(self, name: str) -> bool:
        """Whether this rank saves and loads the tensor of that state-dict name."""
        ...

    def elsewhere(self, name: str) -> bool:
        """Whether a saved name is another rank's part (a loader checks the rest against the model)."""
        ...

    def trained(self, names: list[list[str]]) -> list[list[str]]:
        """The parameters of each optimizer group (by name) whose state this rank saves and loads."""
        ...

    def optimizer_names(self, names: list[list[str]], group: Group) -> list[list[str]]:
        """The optimizer's parameter names as one process's optimizer holds them, each rank's part gathered over
        `group` (the world); collective."""
        ...


class Collected(Protocol):
    """Every rank's part as one model's tensors, for `save_pretrained` and `export_weights` (`Dimension.collect`):
    `params` holds every name in one process's order (another part's tensors as stand-ins of their full shape)."""

    params: dict[str, torch.Tensor]

    def gathers(self, group: Group) -> bool:
        """Whether this rank takes part in gathering a tensor split over `group` (TP, or a dimension's own)."""
        ...

    def key(self, name: str) -> tuple[int, int]:
        """Which tensors may travel in one export bucket: alike on every rank."""
        ...

    def forward(self, name: str, fetch: Callable[[bool], Any], like: Callable[[], Like], lead: bool) -> Any:
        """What `fetch` returns for `name`'s tensors where they are gathered, sent on to where they are written."""
        ...

    def fetching(
        self,
        fetch: Callable[[str, bool], torch.Tensor | None],
        fetch_part: Callable[[Any], torch.Tensor | None],
        lead: bool,
    ) -> tuple[Callable[[str], torch.Tensor | None], Callable[[Any], torch.Tensor | None]]:
        """`save_pretrained`'s fetches of a whole tensor and of a part of one, run where each is held."""
        ...


class Step(Protocol):
    """One step of `autotp.parallelize`: it changes the model and returns what only it can undo (hooks on tensors the
    model keeps); `runtime.rollback.Snapshot` puts back the rest."""

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]: ...


class Dimension:
    """A parallelism: `name` is its mesh axis (its key in `TPState.dims`). `plan` is always the full plan; the part
    tensor parallelism applies is `state.plan` (`base_plan`)."""

    name: str = ""
    allows_ddp: bool = True  # whether DDP may sync its gradients (else `autotp.allreduce_gradients` must, each step)
    splits_sequence: bool = False  # whether each of its ranks holds part of the sequence (no whole-sequence head)
    owns_step: bool = False  # whether its `step` runs a training step's forward and backward itself (a schedule)

    def refuse(self, model: nn.Module, plan: Plan, options: WrapOptions) -> None:
        """Raise, naming the reason, for options this model cannot take: at planning time, with no process group."""

    def split_plan(self, model: nn.Module, plan: Plan, options: WrapOptions) -> tuple[Plan, tuple[str, ...], Any]:
        """The plan left to tensor parallelism, the modules this dimension keeps whole and splits itself, and what it
        found in splitting (None: nothing), which `autotp.parallelize` keeps in `TPState.found` under its name for
        its later hooks (a pipeline's cut and this rank's stages)."""
        return plan, (), None

    def before_load(self, model: nn.Module, state: TPState) -> tuple[str, ...]:
        """Before `from_pretrained` reads the checkpoint into the meta model (`autotp.parallelize`'s materialize
        step, before this dimension's own step): drop what this rank will not hold; returns the name prefixes of the
        checkpoint tensors it need not read."""
        return ()

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        """Its step in `autotp.parallelize.steps`; records itself in `state.dims` when active."""
        return []

    def after_wrap(self, model: nn.Module, state: TPState, adapters: frozenset[int]) -> None:
        """Once `autotp.wrap` has put PEFT's LoRA layers back (`adapters`: their ids), which it lifts out around the
        steps."""

    def step(self, model: nn.Module, batch: dict[str, Any]) -> Any:
        """A training step's forward and backward of the whole `batch` (`forward_backward`), returning the model's
        output: the model's own forward and a backward of its loss, unless the dimension `owns_step` (a pipeline runs
        its schedule)."""
        out = model(**batch)
        out.loss.backward()
        return out

    def row_multiple(self) -> tuple[int, str, str]:
        """What a training batch's rows must be a multiple of (a pipeline's micro-batches), the option that sets it,
        and where the model is held (for the Trainer's refusal): `(1, "", "")`, any rows."""
        return 1, "", ""

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

    def batch_group(self) -> Group:
        """The group besides TP whose ranks are each given the same whole batch, which `check_inputs` compares and
        TRL's token counts divide by (None: none)."""
        return None

    def split_group(self) -> Group:
        """The group its own tensors are split over besides TP, which saving and exporting gather over (None: none)."""
        return None

    def layout(self) -> dict[str, int]:
        """What a training checkpoint records of it (`autotp.io.checkpoint.save.layout`)."""
        return {}

    def refuse_resize(self) -> None:
        """Raise if `resize_token_embeddings` cannot resize the model as this dimension holds it (nothing changed)."""

    def refuse_export(self, target: Any) -> None:
        """Raise if `autotp.export_weights` cannot send its tensors to the engine layout `target`."""

    def owned(self, model: nn.Module) -> Part | None:
        """What this rank saves and loads of a training checkpoint when it holds the model's names in part (None:
        every name)."""
        return None

    def collect(self, model: nn.Module, params: dict[str, torch.Tensor], state: TPState) -> Collected | None:
        """Every rank's part of `params` (this rank's state dict, keep_vars) as one model's tensors, for saving and
        exporting (None: this rank holds every name); collective over the ranks holding the other parts."""
        return None


def base_plan(
    dimensions: list[Dimension], model: nn.Module, plan: Plan, options: WrapOptions
) -> tuple[Plan, tuple[str, ...], dict[str, Any]]:
    """The plan tensor parallelism applies, the modules the dimensions keep whole, and what each found in splitting,
    by axis (each one's `split_plan`)."""
    whole: tuple[str, ...] = ()
    found: dict[str, Any] = {}
    for dimension in dimensions:
        plan, kept, own = dimension.split_plan(model, plan, options)
        whole += kept
        if own is not None:
            found[dimension.name] = own
    return plan, whole, found


def owned_part(model: nn.Module) -> Part | None:
    """What this rank saves and loads of `model`'s names (`Dimension.owned`); None: every name."""
    state = find_state(model)
    parts = [] if state is None else [d.owned(model) for d in state.dims.values()]
    return next((part for part in parts if part is not None), None)


def collected(model: nn.Module, params: dict[str, torch.Tensor], state: TPState | None) -> Collected | None:
    """Every rank's part of `params` as one model's (`Dimension.collect`); None where this rank holds every name."""
    for dimension in [] if state is None else state.dims.values():
        found = dimension.collect(model, params, state)
        if found is not None:
            return found
    return None


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
