"""Pipeline parallelism as a `Dimension` (`autotp.runtime.dimension`): its refusals, its step (the stage cut), and its
part of the gradient sync (the tied embedding's two copies summed, as Megatron's embedding group does)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..compat.peft import is_peft_module
from ..compat.torchao import is_torchao
from ..mesh import Group, group_size, named_failure, new_group
from ..options import WrapOptions
from ..planning.plan import Plan
from ..runtime.dimension import Dimension
from ..runtime.process_hooks import patch_attribute
from ..runtime.rollback import Removable
from ..state import TPState
from .chain import check_chain
from .cut import Cut, find_cut, skip_others
from .generate import PipelineGenerate
from .schedule import LOOPED, SCHEDULES, Runner, stages_of

# what a pipeline does not compose with yet, refused before the model changes: option -> why
_NOT_YET = {
    "cp_size": "context parallelism",
    "ep_size": "expert parallelism",
    "sequence_parallel": "sequence parallelism",
    "tp_group": "a user's tp_group",
}

_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "labels"})  # what a pipeline splits by rows
_EVALUATED = _INPUTS | {"use_cache", "return_dict"}


class PipelineParallelism(Dimension):
    """Active at pp_size > 1, holding this rank's stages (`runner`) and the tied embedding's group."""

    name = "pp"
    allows_ddp = False  # the tied embedding's two copies are summed by `autotp.allreduce_gradients`

    cut: Cut
    stages: list[int]  # this rank's stages (two under a looped schedule)
    runner: Runner
    tied: nn.Parameter | None = None
    tied_group: Group = None
    running = False  # inside `forward_backward`: the model's own forward is the stages'

    def refuse(self, model: nn.Module, plan: Plan, options: WrapOptions) -> None:
        pp = options.pp_size
        if pp == 1:
            return
        for option, what in _NOT_YET.items():
            if getattr(options, option) not in (None, False, 1):
                raise NotImplementedError(f"pp_size={pp} with {option}: {what} under a pipeline is not built yet")
        if any(p.is_meta for p in model.parameters()):
            raise NotImplementedError(
                f"from_pretrained(..., pp_size={pp}) is not built yet: load the model, then autotp.wrap(model, ...)"
            )
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
        if getattr(model.config, "output_router_logits", False):
            raise NotImplementedError(
                f"pp_size={pp} with output_router_logits: the MoE load-balancing loss is summed over every layer's "
                f"router in the last stage's forward, which sees only its own layers; set output_router_logits=False"
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
        return without(plan, self.cut.prefixes(self.stages)), ()

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        options = state.options
        if options.pp_size == 1:
            return []
        group = state.mesh.group("pp")
        skip_others(model, self.cut, self.stages)
        self.runner = Runner(
            model, self.cut, self.stages, group, options.pp_schedule, options.pp_microbatches or options.pp_size
        )
        head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
        if head.weight is embedding.weight:  # the tied group: every pipeline's first and last rank
            self.tied, self.tied_group = head.weight, group if options.pp_size == 2 else None
            for ranks in state.mesh.rank_groups("pp") if options.pp_size > 2 else []:  # collective over the world
                made = new_group([ranks[0], ranks[-1]], state.timeout, "PP embedding group")
                self.tied_group = made if dist.get_rank() in (ranks[0], ranks[-1]) else self.tied_group
        patch_attribute(model, "forward", PipelineForward(self, model.forward))
        if callable(getattr(model, "generate", None)):
            patch_attribute(model, "generate", PipelineGenerate(model.generate))
        state.dims[self.name] = self
        return []

    def forward_backward(self, model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
        if "labels" not in batch or "input_ids" not in batch:
            raise ValueError("autotp.forward_backward at pp_size > 1 needs input_ids and labels (the pipeline's loss)")
        other = sorted(set(batch) - _INPUTS)
        if other:  # the schedule splits every input by rows: one that is not per row would be cut wrongly
            raise NotImplementedError(
                f"autotp.forward_backward at pp_size > 1 with {other}: a pipeline takes input_ids, attention_mask, "
                f"position_ids and labels, each split by rows into the micro-batches"
            )
        refuse_peft(model, self.cut.stages // len(self.stages))  # LoRA added after wrap: before any step
        self.running = True
        try:
            return self.runner.step(dict(batch))
        finally:
            self.running = False

    def sync_gradients(self, model: nn.Module, state: TPState, replicas: int, average: bool) -> None:
        """The tied embedding: the first stage's gradient (from the embedding) and the last's (from the head) summed
        between them, so the two copies take the same step, as one process's one weight does."""
        if self.tied is None or self.tied_group is None:
            return
        if self.tied.grad is None:
            self.tied.grad = torch.zeros_like(self.tied)
        with named_failure(self.tied_group, "the tied embedding's gradient sum over the first and last stage"):
            dist.all_reduce(self.tied.grad, group=self.tied_group)

    def norm(
        self, params: list[nn.Parameter], norm_type: float, state: TPState
    ) -> tuple[list[nn.Parameter], torch.Tensor | None]:
        """The tied embedding once: the last stage leaves its copy to the first's (their gradients are summed)."""
        if self.tied is None or self.cut.stages - 1 not in self.stages or 0 in self.stages:
            return params, None
        return [p for p in params if p is not self.tied], None

    def reduce_norm(self, total: torch.Tensor, norm_type: float, state: TPState) -> torch.Tensor:
        """Each stage's own layers' part, added (or maxed) over the pipeline."""
        group = self.runner.group
        op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
        with named_failure(group, "autotp.clip_grad_norm_'s all-reduce of the gradient norm over PP"):
            dist.all_reduce(total, op=op, group=group)
        return total

    def fully_shard(self, options: dict[str, Any], state: TPState) -> dict[int, Any]:
        raise NotImplementedError(f"autotp.fully_shard at pp_size={state.options.pp_size} is not built yet")

    def split_group(self) -> Group:
        raise NotImplementedError(
            "saving or exporting a model at pp_size > 1 (autotp.save_pretrained, export_weights) is not built yet: "
            "each stage holds other layers"
        )

    def layout(self) -> dict[str, int]:
        raise NotImplementedError("autotp.save_checkpoint at pp_size > 1 is not built yet")

    def _cut(self, model: nn.Module, options: WrapOptions) -> Cut:
        looped = options.pp_schedule in LOOPED
        per_rank = options.pp_stages_per_rank or (2 if looped else 1)
        if per_rank < 1 or (per_rank > 1 and not looped):
            raise ValueError(
                f"pp_stages_per_rank={per_rank} with pp_schedule={options.pp_schedule!r}: more than one stage per "
                f"rank needs a looped schedule ({', '.join(LOOPED)}), and at least one"
            )
        return find_cut(model, options.pp_size * per_rank, options.pp_split_points)


def refuse_peft(model: nn.Module, pp: int) -> None:
    """PEFT (LoRA) under a pipeline is not built: autotp's LoRA lift and adapters do not know the stages' layers."""
    peft = next((name or type(m).__name__ for name, m in model.named_modules() if is_peft_module(m)), None)
    if peft is not None:
        raise NotImplementedError(
            f"pp_size={pp} with PEFT ({peft}): LoRA under a pipeline is not built yet; train LoRA at pp_size=1"
        )


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
        other = sorted(set(kwargs) - _EVALUATED) + (["positional arguments"] if args else [])
        if other or kwargs.get("use_cache"):
            raise NotImplementedError(
                f"model(...) at pp_size={size} with {other or ['use_cache=True']}: evaluation under a pipeline takes "
                f"input_ids, attention_mask, position_ids and labels by keyword (model.generate runs without a KV cache)"
            )
        batch = {k: v for k, v in kwargs.items() if k not in ("use_cache", "return_dict")}
        self.pipeline.running = True
        try:
            loss, logits = self.pipeline.runner.evaluate(batch)
        finally:
            self.pipeline.running = False
        return CausalLMOutputWithPast(loss=loss, logits=logits)
