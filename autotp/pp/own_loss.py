"""A trainer's own loss under a pipeline: its `compute_loss` runs on the last stage, once per micro-batch, against a
stand-in for the model.

A trainer that computes its loss itself (TRL's) calls the model inside `compute_loss` and computes the loss from the
output. Under a pipeline no rank holds the whole model, so the last stage runs that `compute_loss` per micro-batch
with a stand-in (`StandIn`): a call runs the model's forward as the last stage runs it (the hidden states the stage
received enter its first layer), after checking that the call's inputs are the micro-batch's that the earlier stages
ran. The stand-in keeps each micro-batch's output, so the trainer can then compute the whole batch's loss and metrics
once more from those outputs (`Replay`) without running the model again, as one process computes them.

Any other call of a fused-head forward (TRL's `fused_lm_head=True`, which runs the decoder model directly, past the
schedule) at pp > 1 would run only this rank's layers, so `guard` refuses it by name.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import Group, named_failure
from ..runtime.input_agreement import check_same_batch
from ..runtime.process_hooks import patch_attribute
from ..state import find_state
from .dimension import PipelineParallelism

SCHEDULED = ("input_ids", "attention_mask", "position_ids")  # what the earlier stages read of a micro-batch
LAST_ONLY = {"labels", "shift_labels", "num_items_in_batch", "use_cache", "fused_lm_head", "return_dict"}
_INSIDE: ContextVar[bool] = ContextVar("autotp_own_loss_inside", default=False)


class StandIn:
    """The model a trainer's `compute_loss` is handed on the last stage for one micro-batch: one call, with the
    micro-batch's inputs, runs `target` (the trainer's model) there and keeps its output."""

    def __init__(self, target: nn.Module, scheduled: dict[str, torch.Tensor], who: str):
        self.target, self.scheduled, self.who = target, scheduled, who
        self.out: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.out is not None or args:
            raise NotImplementedError(
                f"{self.who} called the model {'with positional arguments' if args else 'twice'} for one "
                f"micro-batch: under a pipeline the last stage runs compute_loss against one forward per micro-batch "
                f"(the earlier stages ran it once), with its inputs by keyword; use pp_size=1"
            )
        check_inputs(kwargs, self.scheduled, self.who)
        inside = _INSIDE.set(True)
        try:
            self.out = self.target(**kwargs)
        finally:
            _INSIDE.reset(inside)
        return self.out


class Replay:
    """The model handed to `compute_loss` for the whole batch after the schedule: a call returns the micro-batches'
    outputs joined by rows in the batch's order (`order`: the batch row of each scheduled row), without gradients."""

    def __init__(self, outputs: list[Any], order: torch.Tensor, scheduled: dict[str, torch.Tensor], who: str):
        self.outputs, self.scheduled, self.who = outputs, scheduled, who
        self.inverse = torch.empty_like(order)
        self.inverse[order] = torch.arange(order.numel(), device=order.device)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        check_inputs(kwargs, self.scheduled, self.who)
        first = self.outputs[0]
        joined: dict[str, Any] = {}
        for key in first.keys():
            values = [out[key] for out in self.outputs]
            if torch.is_tensor(values[0]) and values[0].dim() == 0:
                joined[key] = torch.stack([v.detach() for v in values]).sum()
            elif torch.is_tensor(values[0]):
                joined[key] = torch.cat([v.detach() for v in values])[self.inverse.to(values[0].device)]
            else:
                joined[key] = values[0]
        return type(first)(**joined)


def check_inputs(kwargs: dict[str, Any], scheduled: dict[str, torch.Tensor], who: str) -> None:
    """The model call's inputs are those the earlier stages ran (else their hidden states belong to other tokens)."""
    other = sorted(k for k, v in kwargs.items() if v is not None and k not in LAST_ONLY and k not in SCHEDULED)
    if other:
        raise NotImplementedError(
            f"{who} called the model with {other}: under a pipeline the earlier stages read only "
            f"{', '.join(SCHEDULED)} of a micro-batch; use pp_size=1"
        )
    for key in SCHEDULED:
        given, ran = kwargs.get(key), scheduled.get(key)
        same = given is None and ran is None
        if given is not None and ran is not None and given.shape == ran.shape:
            same = bool(torch.equal(given.to(ran.device), ran))
        if not same:
            raise RuntimeError(
                f"{who} called the model with another {key} than the pipeline's earlier stages ran for this "
                f"micro-batch: autotp's split of the trainer's batch does not match the trainer's own model inputs"
            )


def run_own_loss(
    model: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor], loss: Callable[[StandIn, int], torch.Tensor]
) -> tuple[torch.Tensor, list[Any]]:
    """One step of the pipeline over `batch` (`input_ids`, `attention_mask`, `position_ids`, `labels`, rows in
    micro-batch order) where the last stage's loss of micro-batch k is `loss(stand_in, k)`. Returns the sum of the
    micro-batches' losses (on every rank of the pipeline) and, on the last stage, each micro-batch's model output."""
    state = find_state(model)
    pipeline = None if state is None else state.dim(PipelineParallelism)
    assert pipeline is not None  # the caller runs this at pp > 1 only
    last = _last_stage(pipeline)
    outputs: list[Any] = []

    def run(tokens: torch.Tensor, micro: dict[str, Any]) -> torch.Tensor:
        scheduled = {"input_ids": tokens, **{k: v for k, v in micro.items() if k in SCHEDULED}}
        stand = StandIn(target, scheduled, getattr(loss, "who", "compute_loss"))
        value = loss(stand, len(outputs))
        if stand.out is None:
            raise NotImplementedError(f"{stand.who} never called the model: a pipeline's last stage has nothing to run")
        outputs.append(stand.out)
        return value

    # the trainer's batch (GRPO's completions, sampled on every rank) must be the same on every stage
    check_same_batch(pipeline.runner.group, [(f"{k}=", batch[k]) for k in sorted(batch)], "PP")
    if last is not None:
        last.own_loss = run
    try:
        total = pipeline.step(model, batch).loss
    finally:
        if last is not None:
            last.own_loss = None
    return total, outputs


def _last_stage(pipeline: PipelineParallelism) -> Any:
    """This rank's module of the pipeline's last stage, or None (a looped or V schedule puts it on any rank)."""
    return next((module for module in pipeline.runner.modules if module.last), None)


def holds_last_stage(model: nn.Module) -> bool:
    state = find_state(model)
    pipeline = None if state is None else state.dim(PipelineParallelism)
    return pipeline is not None and _last_stage(pipeline) is not None


def pipeline_size(model: nn.Module) -> int:
    """The ranks of `model`'s pipeline (1 without one): what an integration asks instead of reading the options."""
    state = find_state(model)
    pipeline = None if state is None else state.dim(PipelineParallelism)
    return 1 if pipeline is None else dist.get_world_size(pipeline.runner.group)


def pipeline_group(model: nn.Module) -> Group:
    state = find_state(model)
    pipeline = None if state is None else state.dim(PipelineParallelism)
    assert pipeline is not None
    return pipeline.runner.group


def from_last_stage(group: Group, value: Any, holds_last: bool) -> Any:
    """`value` as the rank holding the pipeline's last stage (`holds_last`: this one) has it, on every rank of the
    pipeline (any picklable object; the schedule decides which rank that is, so each says)."""
    everyone: list[Any] = [None] * dist.get_world_size(group)
    with named_failure(group, "the pipeline's gather of the trainer's logged metrics from the last stage"):
        dist.all_gather_object(everyone, (holds_last, value if holds_last else None), group=group)
    return next(held for holds, held in everyone if holds)


class Guarded:
    """A model's forward at pp > 1 that refuses a fused-head call (`fused_lm_head=True`) outside a stand-in: it runs
    the decoder model directly, past the pipeline's schedule, so only this rank's layers would run."""

    def __init__(self, forward: Any, who: str):
        self.forward, self.who = forward, who
        self.__wrapped__ = forward  # `autotp.integrations.trl.fused_head` looks through it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _INSIDE.get() or not kwargs.get("fused_lm_head"):
            return self.forward(*args, **kwargs)
        raise NotImplementedError(
            f"{self.who} called the model's fused LM head outside a training step at pp_size > 1 (evaluation, "
            f"precomputed reference log-probs, generation-time log-probs, or a reference through the policy's own "
            f"layers): under a pipeline only the training step's compute_loss runs on the last stage; use pp_size=1 "
            f"for it"
        )


def guard(model: nn.Module, who: str) -> None:
    """Put `Guarded` around `model`'s forward (once)."""
    if not isinstance(vars(model).get("forward"), Guarded):
        patch_attribute(model, "forward", Guarded(model.forward, who))
