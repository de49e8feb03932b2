"""Pipeline parallelism as a `Dimension` (`autotp.runtime.dimension`): its refusals, its step (the stage cut), and its
part of the gradient sync (the copies of a parameter several stages train summed, as Megatron's embedding group sums
the tied embedding's: `autotp.pp.shared`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..compat.hf import own_loss
from ..compat.peft import is_peft_module
from ..compat.torchao import is_torchao
from ..mesh import Group, group_size, named_failure
from ..options import WrapOptions
from ..planning.plan import Plan
from ..planning.ties import unshared
from ..runtime.dimension import Dimension
from ..runtime.input_agreement import check_same_batch
from ..runtime.process_hooks import patch_attribute, watch_optimizer_steps
from ..runtime.rollback import Removable
from ..state import TPState, wrapped_model
from .chain import check_chain
from .cut import Cut, find_cut, skip_others
from .generate import PipelineGenerate
from .release import release, unowned
from .router import Balance, unsupported
from .schedule import LOOPED, SCHEDULES, Runner, StageForward
from .shared import SharedGroup, shared_groups, sync_shared, tied_names, uncounted
from .stage_names import StageNames
from .stage_tensors import StageTensors, stage_tensors
from .zero_bubble import ZERO_BUBBLE, rank_stages, refuse_fully_shard, refuse_options, stage_rank

# what a pipeline does not compose with yet, refused before the model changes: option -> why
_NOT_YET = {
    "tp_group": "a user's tp_group",
}

# what a pipeline splits by rows (a VLM's pixel_values: one image a row, for the first stage's vision tower)
_INPUTS = frozenset({"input_ids", "attention_mask", "position_ids", "labels", "pixel_values"})
_EVALUATED = _INPUTS | {"use_cache", "return_dict"}


@dataclasses.dataclass(frozen=True)
class Split:
    """What `split_plan` finds, kept in `TPState.found` for the step and `before_load`: the cut, this rank's
    stages, and what they do not own (by path)."""

    cut: Cut
    stages: list[int]
    released: dict[str, nn.Module]


class PipelineParallelism(Dimension):
    """Active at pp_size > 1, holding this rank's stages (`runner`) and the groups of the parameters it shares with
    other stages (`shared`)."""

    name = "pp"
    owns_step = True  # `autotp.forward_backward` runs the schedule (`step`)
    allows_ddp = False  # the copies of a parameter several stages train are summed by `autotp.allreduce_gradients`

    cut: Cut
    stages: list[int]  # this rank's stages (two under a looped schedule)
    runner: Runner
    released: dict[str, nn.Module]  # what this rank's stages do not own, by path, with what replaces it
    shared: list[SharedGroup]
    ties: list[tuple[str, ...]]  # the names of each parameter held under several, over the whole model
    split_sequence = False  # context parallelism: a model(...) call's sequence is split before our forward
    adapters: frozenset[int] = frozenset()  # PEFT's LoRA layers the model held when wrapped (`autotp.api.wrap`)
    checks_inputs = False  # `wrap(..., check_inputs=True)`: the pipeline's ranks compare their batches (`check_inputs`)
    loss: Any = None  # the model's loss_function when wrapped (`refuse_replaced_loss`)
    unsynced = False  # a step's gradients of parameters several stages train are not summed yet (`before_step`)

    def refuse(self, model: nn.Module, plan: Plan, options: WrapOptions) -> None:
        pp = options.pp_size
        if pp == 1:
            return
        for option, what in _NOT_YET.items():
            if getattr(options, option) not in (None, False, 1):
                raise NotImplementedError(f"pp_size={pp} with {option}: {what} under a pipeline is not built yet")
        if options.pp_schedule not in SCHEDULES + ZERO_BUBBLE:
            raise ValueError(
                f"pp_schedule={options.pp_schedule!r}: choose one of torch's schedules {SCHEDULES + ZERO_BUBBLE}"
            )
        microbatches = options.pp_microbatches or pp
        if microbatches < 1:
            raise ValueError(f"pp_microbatches={options.pp_microbatches} must be at least 1")
        if options.pp_schedule in ZERO_BUBBLE:
            refuse_options(model, options, microbatches)
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

    def split_plan(self, model: nn.Module, plan: Plan, options: WrapOptions) -> tuple[Plan, tuple[str, ...], Any]:
        """Tensor parallelism shards only this rank's stages' layers; the cut and this rank's stages (`Split`)."""
        if options.pp_size == 1:
            return plan, (), None
        cut = self._cut(model, options)
        pp = options.pp_size
        stages = rank_stages(
            options.pp_schedule, pp, cut.stages // pp, dist.get_rank() // (dist.get_world_size() // pp)
        )
        released = unowned(model, cut, stages)
        kept = without(unshared(plan), cut.prefixes(stages) + tuple(f"{p}." for p in released))
        return kept, (), Split(cut, stages, released)

    def before_load(self, model: nn.Module, state: TPState) -> tuple[str, ...]:
        """`from_pretrained(..., pp_size=P)`: the layers other stages run become pass-throughs in the meta model
        before the read (which runs before this dimension's step), so each rank reads only its stages' layers; the
        prefixes of the checkpoint tensors it leaves out on purpose."""
        split = state.found.get(self.name)
        if split is None:
            return ()
        skip_others(model, split.cut, split.stages)
        return split.cut.prefixes(split.stages)

    def apply(self, model: nn.Module, plan: Plan, state: TPState) -> list[Removable]:
        options = state.options
        if options.pp_size == 1:
            return []
        found: Split = state.found[self.name]
        self.cut, self.stages, self.released = found.cut, found.stages, found.released
        group = state.mesh.group("pp")
        rank_of = lambda stage: stage_rank(options.pp_schedule, options.pp_size, stage)  # noqa: E731
        self.shared = shared_groups(model, self.cut, self.stages, state, rank_of)  # the whole model's, collective
        if self.shared:  # kept with this dimension, which the model's state keeps
            self.watch = watch_optimizer_steps(self, PipelineParallelism.before_step)
        self.ties = tied_names(model)
        skip_others(model, self.cut, self.stages)
        balance = Balance(model, group) if getattr(model.config, "output_router_logits", False) else None
        microbatches = options.pp_microbatches or options.pp_size
        forward = PipelineForward(self, model.forward)  # the model's forward: the stages' while they run
        self.runner = Runner(model, self.cut, self.stages, group, options.pp_schedule, microbatches, forward, balance)
        self.runner.sequence_length = lambda length: sequence_length(state, length)
        # a dimension whose ranks are given one whole batch splits its sequence by a forward pre-hook, around ours (CP)
        self.split_sequence = any(d.batch_group() is not None for d in state.dims.values())
        self.checks_inputs = options.check_inputs
        release(model, self.released)
        self.loss = model.loss_function  # transformers' or a dimension's stand-in for it: what the stages compute
        patch_attribute(model, "forward", forward)
        if callable(getattr(model, "generate", None)):
            patch_attribute(model, "generate", PipelineGenerate(model.generate))
        state.dims[self.name] = self
        return []

    def refuse_resize(self) -> None:
        raise NotImplementedError(
            f"resize_token_embeddings at pp_size={group_size(self.runner.group)} is not supported: the first pipeline "
            f"stage holds the embedding and the last the head, which transformers resizes together (and ties). "
            f"Resize before autotp.wrap (model.resize_token_embeddings(n), then wrap); nothing was changed"
        )

    def row_multiple(self) -> tuple[int, str, str]:
        """A batch is split by rows into `pp_microbatches` micro-batches (AutoTPTrainer refuses one that does not
        split evenly, naming the Trainer's settings that fix it)."""
        return self.runner.microbatches, "pp_microbatches", f"pp_size={group_size(self.runner.group)}"

    def after_wrap(self, model: nn.Module, state: TPState, adapters: frozenset[int]) -> None:
        """LoRA added later would draw other values than one process draws: refused then (`refuse_peft`)."""
        self.adapters = adapters

    def step(self, model: nn.Module, batch: dict[str, Any]) -> CausalLMOutputWithPast:
        """The schedule's forward and backward of the whole batch; the output holds its loss only."""
        if isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile(model)
            raise NotImplementedError(
                f"autotp.forward_backward(torch.compile(model)) at pp_size={group_size(self.runner.group)}: a "
                f"pipeline runs the model's own forward on each stage through torch's schedule, so a compiled whole "
                f"model would never run; pass the wrapped model itself (autotp.forward_backward(model, **batch)) and "
                f"compile its decoder layers instead (for layer in model.model.layers: layer.compile())"
            )
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
        self.check_inputs(batch, num_items)
        self.refuse_replaced_loss()
        try:
            return CausalLMOutputWithPast(loss=self.runner.run(batch, "step", num_items))
        finally:
            self.unsynced = bool(self.shared)

    def check_inputs(self, batch: dict[str, Any], num_items: Any) -> None:
        """`wrap(..., check_inputs=True)`: every rank of the pipeline was given the same whole batch (each stage takes
        its micro-batches' rows from it), else every rank raises naming the first tensor that differs. The TP and CP
        ranks of each stage compare their micro-batches in the model's forward (`autotp.integrations.guards`)."""
        if self.checks_inputs:
            named = {**batch, "num_items_in_batch": num_items}
            tensors = [(f"{k}=", named[k]) for k in sorted(named) if torch.is_tensor(named[k])]  # in any call order
            check_same_batch(self.runner.group, tensors, "PP")

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
        """A parameter several stages train (the tied embedding: the first stage's gradient from the embedding, the
        last's from the head): the stages' parts summed between them, so the copies take the same step, as one
        process's one weight does."""
        sync_shared(self.runner.model, self.shared)
        self.unsynced = False

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer step after `forward_backward` without `autotp.allreduce_gradients`: each stage's copy of a
        parameter several stages train holds only its own stages' part of the gradient, so the copies would step
        apart, silently; refused, naming the parameter."""
        if not self.unsynced:
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        model = self.runner.model
        for shared in self.shared:
            name = next((n for n in shared.names if id(model.get_parameter(n)) in held), None)
            if name is not None and model.get_parameter(name).grad is not None:
                raise RuntimeError(
                    f"autotp: {type(optimizer).__name__}.step() after autotp.forward_backward at "
                    f"pp_size={group_size(self.runner.group)} without autotp.allreduce_gradients(model): {name} is "
                    f"trained by stages on PP ranks {shared.ranks}, each holding its own copy with only its stages' "
                    f"part of the gradient, so the copies would step apart. Call autotp.allreduce_gradients(model) "
                    f"after the last forward_backward of the step, before optimizer.step()"
                )

    def norm(
        self, params: list[nn.Parameter], norm_type: float, state: TPState
    ) -> tuple[list[nn.Parameter], torch.Tensor | None]:
        """A parameter several stages train, once: the first of their ranks counts it (their gradients are summed)."""
        others = uncounted(self.runner.model, self.shared)
        return [p for p in params if id(p) not in others], None

    def reduce_norm(self, total: torch.Tensor, norm_type: float, state: TPState) -> torch.Tensor:
        """Each stage's own layers' part, added (or maxed) over the pipeline."""
        group = self.runner.group
        op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
        with named_failure(group, "autotp.clip_grad_norm_'s all-reduce of the gradient norm over PP"):
            dist.all_reduce(total, op=op, group=group)
        return total

    def stage_rank(self, stage: int) -> int:
        """The PP rank that runs `stage` (a loop, or the zero-bubble schedules' V: `autotp.pp.zero_bubble`)."""
        return stage_rank(self.runner.schedule_name, group_size(self.runner.group), stage)

    def fully_shard(self, options: dict[str, Any], state: TPState) -> dict[int, Any]:
        """FSDP within each stage (`autotp.pp.sharded`), but not under a split backward (`refuse_fully_shard`)."""
        refuse_fully_shard(state.options.pp_schedule, state.options.pp_size)
        return {}

    def split_group(self) -> Group:
        """Each stage holds its own tensors: saving and exporting gather each on its stage and send it on over PP
        (`autotp.pp.stage_tensors`), with every rank taking part."""
        return self.runner.group

    def layout(self) -> dict[str, Any]:
        """A record: the pipeline's size and the stage cut saved at (each rank saves its stages' tensors under their
        full names, so a checkpoint loads at any cut: `autotp.pp.stage_names`)."""
        return {"pp_size": group_size(self.runner.group), "pp_bounds": list(self.cut.bounds)}

    def owned(self, model: nn.Module) -> StageNames:
        """A training checkpoint: this rank saves and loads what its stages own (`autotp.pp.stage_names`)."""
        return StageNames(model, self.cut, self.stages, group_size(self.runner.group))

    def collect(self, model: nn.Module, params: dict[str, torch.Tensor], state: TPState) -> StageTensors:
        """`save_pretrained` and `export_weights`: every stage's tensors as one model's (`autotp.pp.stage_tensors`)."""
        return stage_tensors(model, params, state, self.cut, self.stages, self.runner.group, self.ties, self.stage_rank)

    def _cut(self, model: nn.Module, options: WrapOptions) -> Cut:
        looped = options.pp_schedule in LOOPED + ZERO_BUBBLE  # the zero-bubble schedules: 2 (`refuse_options`)
        per_rank = options.pp_stages_per_rank or (2 if looped else 1)
        if per_rank < 1 or (per_rank > 1 and not looped):
            raise ValueError(
                f"pp_stages_per_rank={per_rank} with pp_schedule={options.pp_schedule!r}: more than one stage per "
                f"rank needs a looped schedule ({', '.join(LOOPED + ZERO_BUBBLE)}), and at least one"
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


class PipelineForward(StageForward):
    """The wrapped model's `forward` at pp > 1. Inside the schedule it is the running stage's; a training forward is
    refused, naming `forward_backward`; under `torch.no_grad()` it runs the forward-only schedule and returns the
    whole batch's loss and logits on every rank, as one process's forward does."""

    def __init__(self, pipeline: PipelineParallelism, forward: Any):
        super().__init__(forward)
        self.pipeline = pipeline

    def outside(self, *args: Any, **kwargs: Any) -> Any:
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
        num_items = kwargs.pop("num_items_in_batch", None)  # Trainer's evaluation: the batch's label tokens
        other = sorted(set(kwargs) - _EVALUATED) + (["positional arguments"] if args else [])
        if other or kwargs.get("use_cache"):
            raise NotImplementedError(
                f"model(...) at pp_size={size} with {other or ['use_cache=True']}: evaluation under a pipeline takes "
                f"input_ids, attention_mask, position_ids and labels by keyword (model.generate runs without a KV cache)"
            )
        batch = {k: v for k, v in kwargs.items() if k not in ("use_cache", "return_dict")}
        self.pipeline.check_inputs(batch, num_items)
        if "labels" in batch:
            self.pipeline.refuse_replaced_loss()
        loss, logits = self.pipeline.runner.evaluate(batch, num_items)
        if not isinstance(keep, int) or keep:
            logits = logits[:, slice(-keep, None) if isinstance(keep, int) else keep]
        out = CausalLMOutputWithPast(loss=loss, logits=logits)
        # transformers' `can_return_tuple`: return_dict=False (passed, or the config's) gives the output's tuple
        return out if kwargs.get("return_dict", self.pipeline.runner.model.config.return_dict) else out.to_tuple()
