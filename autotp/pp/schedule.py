"""One training step through torch.distributed.pipelining: this rank's stages and torch's schedule, the loss as one
process normalises it.

Every rank of a pipeline is given the same whole batch, so each stage takes its micro-batch's `input_ids`,
`attention_mask`, `position_ids` and `labels` from the schedule's keyword arguments, split by rows as the inputs are;
only the hidden states travel between stages. The last stage computes its micro-batch's loss with the model's own loss function,
summed over its label tokens and divided by the number of label tokens in the whole batch (`num_items_in_batch`, as
transformers' Trainer passes it), and the schedule runs with `scale_grads=False`: the micro-batches' losses and
gradients then add up to one process's mean over the whole batch, whatever each micro-batch's label count (a mean of
per-micro-batch means would weigh a micro-batch of few labels as much as one of many).

Receive buffers are sized from the batch's shape, so a new shape gets new stages and a new schedule (kept while the
shape repeats): no stage locks the sequence length of its first step.
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    ScheduleGPipe,
    ScheduleLoopedBFS,
    get_schedule_class,
)
from transformers.modeling_outputs import BaseModelOutputWithPast

from ..mesh import Group, device_of, named_failure
from .cut import Cut, after_layers, base_of, stage_view, swapped
from .draws import Draws, SeededStage
from .router import Balance
from .zero_bubble import ZERO_BUBBLE, VForwardOnly, refuse_compiled, stage_rank

IGNORE_INDEX = -100  # transformers' loss ignores these labels
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")  # torch's names
LOOPED = ("Interleaved1F1B",)  # several stages per rank (2 unless `pp_stages_per_rank` says otherwise)


class StageForward:
    """The model's forward under a pipeline, patched once (at wrap; for the chain check, on its twin): while one of
    this rank's stages runs (`stage`), that stage's part of the model's forward (all of it on the last stage, else
    `StageModule.until_last_layer`), else `outside`."""

    def __init__(self, forward: Callable[..., Any]):
        self.forward = forward
        self.stage: StageModule | None = None
        self.__signature__ = inspect.signature(forward)  # what the Trainer reads for the columns a batch keeps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.stage is None:
            return self.outside(*args, **kwargs)
        return self.forward(*args, **kwargs) if self.stage.last else self.stage.until_last_layer(kwargs)

    def outside(self, *args: Any, **kwargs: Any) -> Any:
        """A call outside the stages' runs: the model's own forward (`autotp.pp.dimension.PipelineForward` refuses a
        training forward and evaluates through the schedule)."""
        return self.forward(*args, **kwargs)


class Passed(nn.Module):
    """A module the decoder model runs after its layers, in the view of a stage before the last: its input passed on
    unchanged (the stage sends its last layer's output, taken there; what the decoder model computes after it is not
    used)."""

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return hidden


class StageModule(nn.Module):
    """One stage's forward, for torch's `PipelineStage`: the model's own forward from the micro-batch's `input_ids`
    (and a VLM's `pixel_values` on the first stage), with only this stage's layers. Everything the model computes
    before its layers (the embeddings, position embeddings, rotary tables, the mask) is computed on every stage as one
    process computes it; a stage after the first then hands its first layer the hidden states it received instead,
    and a stage before the last sends its last layer's output (the decoder model's modules after the layers passed
    over). The last returns its micro-batch's share of the whole batch's loss."""

    def __init__(self, model: nn.Module, cut: Cut, stage: int, forward: StageForward, balance: Balance | None = None):
        super().__init__()
        self.model = model
        self.cut, self.stage = cut, stage
        self.first, self.last = stage == 0, stage == cut.stages - 1
        view = stage_view(model, cut, stage)
        if not self.last:
            view.update((name, Passed()) for name in after_layers(model.get_submodule(cut.base), cut.layers))
        object.__setattr__(self, "view", view)  # not registered: the model holds them
        object.__setattr__(self, "patched", forward)  # the model's forward: this stage's part while it runs
        mine = cut.layer_range(stage)
        object.__setattr__(self, "entry", view[cut.layers][mine.start])
        object.__setattr__(self, "exit", view[cut.layers][mine.stop - 1])
        object.__setattr__(self, "balance", balance)  # the MoE load-balancing loss's share of its layers
        object.__setattr__(self, "layers", [view[cut.layers][i] for i in mine])
        self.num_items: torch.Tensor | None = None
        self.logits: list[torch.Tensor] | None = None  # the last stage's, kept while evaluating
        self.own_loss: Callable[..., torch.Tensor] | None = None  # a trainer's loss in place of the model's
        self._received: torch.Tensor | None = None
        self._sent: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, tokens: torch.Tensor, **batch: Any) -> torch.Tensor:
        self._received = None if self.first else x
        # first, so that a hook of the layer's own (FSDP's gradient hooks) sees the received hidden states
        hooks = (
            [] if self.first else [self.entry.register_forward_pre_hook(self._enter, with_kwargs=True, prepend=True)]
        )
        hooks += [] if self.last else [self.exit.register_forward_hook(self._leave)]
        if self.balance is not None:  # the stage adds its routers' share itself, not the model's forward
            hooks += self.balance.hooks(self.layers, batch.get("attention_mask"))
            batch["output_router_logits"] = False
        if not self.first:  # a VLM's images: the vision tower is the first stage's (`autotp.pp.release`)
            batch.pop("pixel_values", None)
        if self.last:
            batch["num_items_in_batch"] = self.num_items
        else:
            batch.pop("labels", None)
        self.patched.stage = self
        try:
            with swapped(self.model.get_submodule(self.cut.base), self.view):
                if self.last and self.own_loss is not None:  # a trainer's loss (`autotp.pp.own_loss`)
                    return self.own_loss(tokens, batch)
                return self._output(self.model(input_ids=tokens, **batch, use_cache=False))
        finally:
            self.patched.stage = None
            self._received = self._sent = None
            for hook in hooks:
                hook.remove()

    def until_last_layer(self, kwargs: dict[str, Any]) -> BaseModelOutputWithPast:
        """A stage before the last: its base model's forward, run inside the model's own call so that the model's
        hooks run around it as around one process's forward (FSDP's root gathers the embedding, CP splits the
        micro-batch's sequence); its output is this stage's last layer's, returned as the decoder model's (the hidden
        states, not a sequence's hidden-state tuple, which CP's hook leaves as they are)."""
        base = base_of(self.model)  # a VLM's: with its vision tower
        assert base is not None  # `autotp.pp.cut.find_cut` refused the model otherwise
        base(**kwargs)
        if self._sent is None:
            raise RuntimeError(
                f"pipeline stage {self.stage}: its last layer never ran in {type(base).__name__}.forward"
            )
        return BaseModelOutputWithPast(last_hidden_state=self._sent)

    def _output(self, out: Any) -> torch.Tensor:
        """What the stage sends: the hidden states before the last stage, its loss (and the MoE share) on it."""
        if not self.last:
            hidden = out.last_hidden_state
            return hidden if self.balance is None else self.balance.attach(hidden)
        if self.logits is not None:
            self.logits.append(out.logits.detach())
        share = self.balance.take() if self.balance is not None else None
        if out.loss is None:
            return out.logits.new_zeros(())
        return out.loss if share is None else out.loss + share.to(out.loss.dtype)

    def _enter(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args:
            return (self._received, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": self._received}

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._sent = (output[0] if isinstance(output, tuple) else output).contiguous()  # sent as one buffer


@contextmanager
def patched_forward(module: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """`module.forward` replaced for the duration: `module(...)` then runs its hooks around `forward`."""
    saved = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if saved is None:
            del module.forward
        else:
            module.forward = saved


class Runner:
    """This rank's stages and schedule, rebuilt when the batch's shape changes."""

    def __init__(
        self,
        model: nn.Module,
        cut: Cut,
        stages: list[int],
        group: Group,
        schedule: str,
        microbatches: int,
        forward: StageForward,
        balance: Balance | None = None,
    ):
        self.model, self.cut, self.stages, self.group = model, cut, stages, group
        self.schedule_name, self.microbatches, self.balance = schedule, microbatches, balance
        self.modules = [StageModule(model, cut, s, forward, balance) for s in stages]
        self.draws = Draws()  # dropout's and a router's jitter's seeds, per stage and micro-batch
        self.sequence_length: Callable[[int], int] = lambda length: length  # of the hidden states the stages send
        self._keys: dict[str, tuple] = {}  # "step" or "eval": the shapes its schedule was built for
        self._schedules: dict[str, Any] = {}

    def evaluate(self, batch: dict[str, Any], num_items: Any = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The forward only (torch's `eval` of the schedule): the loss (None without labels) and the logits of the
        whole batch, on every rank of the pipeline. `num_items`: as `run`'s (Trainer's evaluation passes it)."""
        last = self.modules[-1]
        last.logits = [] if last.last else None
        try:
            loss = self.run(batch, "eval", num_items)
            logits = self._shared(torch.cat(last.logits) if last.logits else None)
        finally:
            last.logits = None
        return (loss if "labels" in batch else None), logits

    def run(self, batch: dict[str, Any], how: str, num_items: Any = None) -> torch.Tensor:
        """The whole batch's loss on every rank of the pipeline, from its forward and backward (`how`: "step") or its
        forward only ("eval"). `num_items`: the label tokens the loss is divided by (the Trainer's count over its
        accumulation window), else the batch's."""
        ids = batch.pop("input_ids")
        microbatches = self.microbatches
        if how == "eval":  # any row count: as many micro-batches as divide it (generate's single row included)
            microbatches = math.gcd(ids.shape[0], microbatches)
        elif ids.shape[0] % microbatches:
            raise ValueError(
                f"a batch of {ids.shape[0]} rows at pp_microbatches={microbatches}: the rows are split evenly "
                f"into the micro-batches, so give a multiple of {microbatches}"
            )
        kwargs = {k: v for k, v in batch.items() if v is not None} | {"tokens": ids}  # every stage's input_ids
        uneven = next((k for k, v in kwargs.items() if torch.is_tensor(v) and v.shape[0] != ids.shape[0]), None)
        if uneven is not None:
            raise NotImplementedError(
                f"{uneven} of {kwargs[uneven].shape[0]} rows beside input_ids of {ids.shape[0]}: a pipeline splits "
                f"every input by rows into its micro-batches, so a VLM's pixel_values need one image a row (not "
                f"flattened patches with image_grid_thw)"
            )
        labels = kwargs.get("labels", ids)  # the schedule's target: the loss comes from the model's own forward
        if num_items is None:
            num_items = (labels[..., 1:] != IGNORE_INDEX).sum()
        for module in self.modules:
            module.num_items = num_items
        if how == "step" and self.schedule_name in ZERO_BUBBLE:
            refuse_compiled(self.model, self.schedule_name)
        schedule = self._schedule_for(ids, kwargs, how, microbatches)
        losses: list[torch.Tensor] = []
        args = (ids,) if 0 in self.stages else ()
        balance = self.balance
        if balance is not None:
            balance.start()
        self.draws.start(self.model.training)  # one seed for this run's passes: the counting pass routes alike
        with named_failure(
            self.group,
            f"the pipeline schedule {self.schedule_name}",
            "Every rank must call autotp.forward_backward (or the model, to evaluate) with the same whole batch.",
        ):
            if how == "step" and balance is not None:  # the whole batch's expert counts first (`autotp.pp.router`)
                with torch.no_grad():
                    schedule.eval(*args, target=labels, losses=[], return_outputs=False, **kwargs)
                balance.counted()
            if how == "step":
                schedule.step(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
            else:
                schedule.eval(*args, target=labels, losses=losses, return_outputs=False, **kwargs)
        self.draws.finish()
        loss = self._shared_loss(losses)
        if balance is None or "labels" not in kwargs:
            return loss
        aux = balance.sent_total() if how == "step" else balance.loss(balance.counted())
        return loss + aux.to(loss.device, loss.dtype)

    def _schedule_for(self, ids: torch.Tensor, kwargs: dict[str, Any], how: str, microbatches: int) -> Any:
        """The schedule for this batch's shapes, kept while they repeat (one for training, one for evaluation).
        Evaluation runs a fill-drain schedule (GPipe, or LoopedBFS for several stages a rank, `VForwardOnly` on the
        zero-bubble schedules' V): the forwards alone give the same outputs in any order, and they take fewer
        micro-batches than stages (1F1B does not)."""
        key = (tuple(ids.shape), tuple((k, tuple(v.shape)) for k, v in kwargs.items() if torch.is_tensor(v)))
        if self._keys.get(how) != key:
            stages = [self._stage(module, ids, microbatches) for module in self.modules]
            cls = get_schedule_class(self.schedule_name)
            single = issubclass(cls, PipelineScheduleSingle)
            if how == "eval":
                looped = VForwardOnly if self.schedule_name in ZERO_BUBBLE else ScheduleLoopedBFS
                cls = ScheduleGPipe if single else looped
            self._schedules[how] = cls(
                stages[0] if single else stages,
                n_microbatches=microbatches,
                loss_fn=lambda loss, target: loss,
                scale_grads=False,
            )
            self._keys[how] = key
        return self._schedules[how]

    def _stage(self, module: StageModule, ids: torch.Tensor, microbatches: int) -> SeededStage:
        rows, device = ids.shape[0] // microbatches, device_of(self.group)
        weight = self.model.get_input_embeddings().weight
        # the metadata torch's stage reads (shape, dtype, and requires_grad: whether gradients flow back)
        seq = self.sequence_length(ids.shape[1])  # CP's chunk, SP's part of it
        hidden = torch.empty(rows, seq, weight.shape[-1], dtype=weight.dtype, device=device).requires_grad_()
        loss = torch.empty((), dtype=weight.dtype, device=device).requires_grad_()
        return SeededStage(
            module,
            module.stage,
            self.cut.stages,
            device,
            input_args=ids[:rows].to(device) if module.first else hidden,
            output_args=loss if module.last else hidden,
            group=self.group,
            model=self.model,
            draws=self.draws,
        )

    def _shared_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The sum of the micro-batches' losses, sent from the last stage to every rank of the pipeline, in fp32 on
        every rank: a broadcast's size must agree, and the last stage's loss is fp32 (transformers' loss upcasts the
        logits) where another rank would otherwise hold the parameters' dtype (bf16)."""
        loss = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros(())
        loss = loss.to(device_of(self.group))
        last = self._last_rank()
        with named_failure(self.group, "the pipeline's loss broadcast from the last stage"):
            dist.broadcast(loss, src=last, group=self.group)
        return loss

    def _shared(self, tensor: torch.Tensor | None) -> torch.Tensor:
        """A tensor the last stage holds, sent to every rank of the pipeline (its shape first)."""
        last = self._last_rank()
        meta: list[Any] = [None if tensor is None else (tuple(tensor.shape), tensor.dtype)]
        with named_failure(self.group, "the pipeline's logits broadcast from the last stage"):
            dist.broadcast_object_list(meta, src=last, group=self.group, device=device_of(self.group))
            shape, dtype = meta[0]
            out = tensor if tensor is not None else torch.empty(shape, dtype=dtype, device=device_of(self.group))
            dist.broadcast(out, src=last, group=self.group)
        return out

    def _last_rank(self) -> int:
        """The global rank of the last stage's PP rank: the last under a loop, the first under a V."""
        pp = dist.get_world_size(self.group)
        return dist.get_global_rank(self.group, stage_rank(self.schedule_name, pp, self.cut.stages - 1))
