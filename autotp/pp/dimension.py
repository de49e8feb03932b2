"""Pipeline parallelism as a `Dimension` (`autotp.runtime.dimension`): its refusals, its step (the stage cut), and its
part of the gradient sync (the tied embedding's two copies summed, as Megatron's embedding group does)."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..compat.hf import own_loss
from ..compat.peft import is_peft_module
from ..compat.torchao import is_torchao
from ..mesh import Group, group_size, named_failure, new_group
from ..options import WrapOptions
from ..planning.plan import Plan
from ..runtime.dimension import Dimension
from ..runtime.process_hooks import patch_attribute
from ..runtime.rollback import Removable
from ..runtime.rows import local_rows
from ..state import TPState, wrapped_model
from .chain import check_chain
from .cut import Cut, find_cut, skip_others
from .generate import PipelineGenerate
from .release import release, unowned
from .router import Balance, unsupported
from .schedule import LOOPED, SCHEDULES, Runner, stages_of

# what a pipeline does not compose with yet, refused before the model changes: option -> why
_NOT_YET = {
    "tp_group": "a user's tp_group",
}

# what a pipeline splits by rows (a VLM's pixel_values: one image a row, for the first stage's vision tower)
_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "labels", "pixel_values"})
_EVALUATED = _INPUTS | {"use_cache", "return_dict"}


class PipelineParallelism(Dimension):
    """Active at pp_size > 1, holding this rank's stages (`runner`) and the tied embedding's group."""

    name = "pp"
    allows_ddp = False  # the tied embedding's two copies are summed by `autotp.allreduce_gradients`

    cut: Cut
    stages: list[int]  # this rank's stages (two under a looped schedule)
    runner: Runner
    released: dict[str, nn.Module]  # what this rank's stages do not own, by path, with what replaces it
    tied: nn.Parameter | None = None
    tied_group: Group = None
    running = False  # inside `forward_backward`: the model's own forward is the stages'
    split_sequence = False  # context parallelism: a model(...) call's sequence is split before our forward
    adapters: frozenset[int] = frozenset()  # PEFT's LoRA layers the model held when wrapped (`autotp.api.wrap`)
    loss: Any = None  # the model's loss_function when wrapped (`refuse_replaced_loss`)

    def refuse(self, model: nn.Module, plan: Plan, options: WrapOptions) -> None:
        pp = options.pp_size
        if pp == 1:
            return
        for option, what in _NOT_YET.items():
            if getattr(options, option) not in (None, False, 1):
                raise NotImplementedError(f"pp_size={pp} with {option}: {what} under a pipeline is not built yet")
        if options.pp_schedule not in SCHEDULES:
            raise ValueError(
                f"pp_schedule={options.pp_schedule!r}: choose one of torch's schedules {SCHEDULES} (ZBVZeroBubble and "
                f"DualPipeV split the backward, which HF stages' non-tensor inputs do not allow yet)"
            )
        microbatches = options.pp_microbatches or pp
        if microbatches < 1:
            raise ValueError(f"pp_microbatches={options.pp_microbatches} must be at least 1")
        if options.pp_schedule == "1F1B" and microbatches < pp:
            raise ValueError(
                f"pp_microbatches={microbatches} with pp_schedule='1F1B' at pp_size={pp}: torch's 1F1B runs at least "
                f"one micro-batch per stage; give pp_microbatches >= {pp}, or pp_schedule='GPipe'"
            )
        if options.pp_schedule in LOOPED and microbatches % max(1, microbatches // pp):
            raise ValueError(
                f"pp_microbatches={microbatches} with pp_schedule={options.pp_schedule!r} at pp_size={pp}: torch's "
                f"looped schedule runs the micro-batches in rounds of {pp}, so give a multiple of {pp} (or fewer)"
            )
        float8 = next((n for n, m in model.named_modules() if is_torchao(type(m))), None)
        if float8 is not None:
            raise NotImplementedError(
                f"pp_size={pp} with torchao's float8 ({float8}): each micro-batch of a pipeline would take its own "
                f"scales, where one process scales the whole batch; wrap without the conversion or without pp_size"
            )
        dropout = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        dropout += [k for k in ("attention_dropout", "hidden_dropout") if getattr(model.config, k, 0) or 0]
        if dropout:
            raise NotImplementedError(
                f"pp_size={pp} with dropout ({dropout[0]}): each micro-batch would draw other masks than one process "
                f"draws; set the dropout to 0"
            )
        loss = own_loss(model)
        if loss is not None:
            raise NotImplementedError(
                f"pp_size={pp}: the model's loss_function is {loss}, not transformers' causal-LM loss; a pipeline adds "
                f"up each micro-batch's loss as that loss's token sums over the whole batch's label count, which "
                f"another function's need not be; use pp_size=1 for a loss_function of your own"
            )
        why = unsupported(model) if getattr(model.config, "output_router_logits", False) else None
        if why is not None:
            raise NotImplementedError(
                f"pp_size={pp} with output_router_logits: the MoE load-balancing loss is added across stages only "
                f"in transformers' Switch form, and {why}; set output_router_logits=False"
            )
        check_chain(model, self._cut(model, options), pp)  # a model that cannot be cut, or split points that do not fit

    def split_plan(self, model: nn.Module, plan: Plan, options: WrapOptions) -> tuple[Plan, tuple[str, ...]]:
        """Tensor parallelism shards only this rank's stages' layers."""
        if options.pp_size == 1:
            return plan, ()
        self.cut = self._cut(model, options)
        self.stages = stages_of(
            dist.get_rank() // (dist.get_world_size() // options.pp_size),
            options.pp_size,
            self.cut.stages // options.pp_size,
        )
        self.released = unowned(model, self.cut, self.stages)
        return without(plan, self.cut.prefixes(self.stages) + tuple(f"{p}." for p in self.released)), ()

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        options = state.options
        if options.pp_size == 1:
            return []
        group = state.mesh.group("pp")
        skip_others(model, self.cut, self.stages)
        balance = Balance(model, group) if getattr(model.config, "output_router_logits", False) else None
        microbatches = options.pp_microbatches or options.pp_size
        self.runner = Runner(model, self.cut, self.stages, group, options.pp_schedule, microbatches, balance)
        self.runner.sequence_length = lambda length: sequence_length(state, length)
        self.split_sequence = options.cp_size > 1  # by the model's forward pre-hook, around ours
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        ends = 0 in self.stages or self.cut.stages - 1 in self.stages  # a middle stage holds no part of it
        if head.weight is embedding.weight:  # the tied group: every pipeline's first and last rank
            self.tied, self.tied_group = head.weight if ends else None, group if options.pp_size == 2 else None
            for ranks in state.mesh.rank_groups("pp") if options.pp_size > 2 else []:  # collective over the world
                made = new_group([ranks[0], ranks[-1]], state.timeout, "PP embedding group")
                self.tied_group = made if dist.get_rank() in (ranks[0], ranks[-1]) else self.tied_group
        release(model, self.released)
        self.loss = model.loss_function  # transformers' or a dimension's stand-in for it: what the stages compute
        patch_attribute(model, "forward", PipelineForward(self, model.forward))
        if callable(getattr(model, "generate", None)):
            patch_attribute(model, "generate", PipelineGenerate(model.generate))
        state.dims[self.name] = self
        return []

    def forward_backward(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        batch = dict(batch)
        if "labels" not in batch or "input_ids" not in batch:
            raise ValueError("autotp.forward_backward at pp_size > 1 needs input_ids and labels (the pipeline's loss)")
        num_items = batch.pop("num_items_in_batch", None)  # the Trainer's, over its accumulation window
        other = sorted(set(batch) - _INPUTS)
        if other:  # the schedule splits every input by rows: one that is not per row would be cut wrongly
            raise NotImplementedError(
                f"autotp.forward_backward at pp_size > 1 with {other}: a pipeline takes input_ids, attention_mask, "
                f"position_ids, labels and a VLM's pixel_values (one image a row), each split by rows into the "
                f"micro-batches"
            )
        refuse_peft(model, self.cut.stages // len(self.stages), self.adapters)  # added after wrap: before any step
        self.refuse_replaced_loss()
        self.running = True
        try:
            return self.runner.step(dict(batch), num_items)
        finally:
            self.running = False

    def refuse_replaced_loss(self) -> None:
        """A `loss_function` the user set after wrap: refused as `refuse` refuses one set before (see there)."""
        model = self.runner.model
        if model.loss_function is not self.loss:
            raise NotImplementedError(
                f"pp_size={group_size(self.runner.group)}: {type(model).__name__}.loss_function was replaced after "
                f"autotp.wrap (by {own_loss(model) or 'transformers causal-LM loss'}); a pipeline adds up each "
                f"micro-batch's loss as transformers' causal-LM token sums, which another function's need not be; use "
                f"pp_size=1 for a loss_function of your own"
            )

    def sync_gradients(self, model: nn.Module, state: TPState, replicas: int, average: bool) -> None:
        """The tied embedding: the first stage's gradient (from the embedding) and the last's (from the head) summed
        between them, so the two copies take the same step, as one process's one weight does."""
        tied = self.tied_weight()
        if tied is None or self.tied_group is None or not tied.requires_grad:  # frozen (under LoRA): no step
            return
        if tied.grad is None:
            tied.grad = torch.zeros_like(tied)
        with named_failure(self.tied_group, "the tied embedding's gradient sum over the first and last stage"):
            dist.all_reduce(local_rows(tied.grad)[0], group=self.tied_group)  # under FSDP: both hold the same rows

    def norm(
        self, params: list[nn.Parameter], norm_type: float, state: TPState
    ) -> tuple[list[nn.Parameter], torch.Tensor | None]:
        """The tied embedding once: the last stage leaves its copy to the first's (their gradients are summed)."""
        tied = self.tied_weight()
        if tied is None or self.cut.stages - 1 not in self.stages or 0 in self.stages:
            return params, None
        return [p for p in params if p is not tied], None

    def tied_weight(self) -> nn.Parameter | None:
        """The tied embedding's weight now (`autotp.fully_shard` replaces the parameter with FSDP's), or None."""
        return None if self.tied is None else self.runner.model.get_output_embeddings().weight

    def reduce_norm(self, total: torch.Tensor, norm_type: float, state: TPState) -> torch.Tensor:
        """Each stage's own layers' part, added (or maxed) over the pipeline."""
        group = self.runner.group
        op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
        with named_failure(group, "autotp.clip_grad_norm_'s all-reduce of the gradient norm over PP"):
            dist.all_reduce(total, op=op, group=group)
        return total

    def split_group(self) -> Group:
        """Each stage holds its own tensors: saving and exporting gather each on its stage and send it on over PP
        (`autotp.io.hf.stages`), with every rank taking part."""
        return self.runner.group

    def layout(self) -> dict[str, Any]:
        """A record: the stage cut saved at (each rank saves its stages' tensors under their full names, so a
        checkpoint loads at any cut: `autotp.io.checkpoint.stages`)."""
        return {"pp_bounds": list(self.cut.bounds)}

    def _cut(self, model: nn.Module, options: WrapOptions) -> Cut:
        looped = options.pp_schedule in LOOPED
        per_rank = options.pp_stages_per_rank or (2 if looped else 1)
        if per_rank < 1 or (per_rank > 1 and not looped):
            raise ValueError(
                f"pp_stages_per_rank={per_rank} with pp_schedule={options.pp_schedule!r}: more than one stage per "
                f"rank needs a looped schedule ({', '.join(LOOPED)}), and at least one"
            )
        return find_cut(model, options.pp_size * per_rank, options.pp_split_points)


def refuse_peft(model: nn.Module, pp: int, adapters: frozenset[int]) -> None:
    """PEFT added after wrap under a pipeline: each stage would draw only its own layers' adapters, other values than
    one process draws for the whole model. LoRA put on before wrap (`adapters`) is drawn whole and trains."""
    holder = wrapped_model(model)
    inside = holder.named_modules() if holder is not None else ()
    peft = next((n for n, m in inside if is_peft_module(m) and id(m) not in adapters), None)
    if peft is not None:
        raise NotImplementedError(
            f"pp_size={pp} with PEFT added after wrap ({peft}): each stage would draw its own layers' adapters, not "
            f"the values one process draws; call get_peft_model before autotp.wrap(peft_model.base_model.model, ...)"
        )


def sequence_length(state: TPState, length: int) -> int:
    """The sequence length of the hidden states a stage sends for a `length`-token batch: what CP, then SP, leave each
    rank (the dimensions in the reverse of their order: the model's split first, the layers' within it)."""
    for dimension in reversed(state.dims.values()):
        length = dimension.sequence_length(length)
    return length


def without(plan: Plan, prefixes: tuple[str, ...]) -> Plan:
    """`plan` without its entries under `prefixes` (the layers other stages run)."""

    def kept(entry: Any) -> bool:
        path = entry if isinstance(entry, str) else entry[0] if isinstance(entry, tuple) else entry.path
        return not f"{path}.".startswith(prefixes)

    changes: dict[str, Any] = {
        f.name: tuple(e for e in getattr(plan, f.name) if kept(e))
        for f in dataclasses.fields(plan)
        if isinstance(getattr(plan, f.name), tuple)
    }
    return dataclasses.replace(plan, **changes)


class PipelineForward:
    """The wrapped model's `forward` at pp > 1. Inside the schedule it is the model's own; a training forward is
    refused, naming `forward_backward`; under `torch.no_grad()` it runs the forward-only schedule and returns the
    whole batch's loss and logits on every rank, as one process's forward does."""

    def __init__(self, pipeline: PipelineParallelism, forward: Any):
        self.pipeline, self.forward = pipeline, forward
        self.__signature__ = inspect.signature(forward)  # what the Trainer reads for the columns a batch keeps

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.pipeline.running:
            return self.forward(*args, **kwargs)
        size = group_size(self.pipeline.runner.group)
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"model(...) for training at pp_size={size}: each rank holds only its stages' layers, so a step is "
                f"out = autotp.forward_backward(model, **batch), which runs the pipeline's schedule (evaluate under "
                f"torch.no_grad())"
            )
        if self.pipeline.split_sequence:
            raise NotImplementedError(
                f"model(...) for evaluation at pp_size={size} with cp_size > 1 is not built yet: context parallelism "
                f"splits the batch's sequence before the pipeline could split its rows; train with "
                f"autotp.forward_backward (its loss is the whole batch's), evaluate at cp_size=1"
            )
        kwargs = {k: v for k, v in kwargs.items() if v is not None}  # a default (PEFT's forward passes them on)
        keep = kwargs.pop("logits_to_keep", 0)  # generate passes it, reading the model's signature (`__signature__`)
        other = sorted(set(kwargs) - _EVALUATED) + (["positional arguments"] if args else [])
        if other or kwargs.get("use_cache"):
            raise NotImplementedError(
                f"model(...) at pp_size={size} with {other or ['use_cache=True']}: evaluation under a pipeline takes "
                f"input_ids, attention_mask, position_ids and labels by keyword (model.generate runs without a KV cache)"
            )
        batch = {k: v for k, v in kwargs.items() if k not in ("use_cache", "return_dict")}
        if "labels" in batch:
            self.pipeline.refuse_replaced_loss()
        self.pipeline.running = True
        try:
            loss, logits = self.pipeline.runner.evaluate(batch)
        finally:
            self.pipeline.running = False
        if not isinstance(keep, int) or keep:
            logits = logits[:, slice(-keep, None) if isinstance(keep, int) else keep]
        return CausalLMOutputWithPast(loss=loss, logits=logits)
