"""TRL's SFTTrainer, DPOTrainer and GRPOTrainer under a pipeline (`AutoTPTrainer` at pp_size > 1).

Their `compute_loss` runs on the last stage once per micro-batch against a stand-in model (`autotp.pp.own_loss`). The
micro-batches' losses must add up to one process's loss of the whole batch: SFT divides its token sums by the
accumulation window's label tokens (`num_items_in_batch`), so each micro-batch's loss counts as it is; DPO averages
over its pairs, so each micro-batch's loss is weighted by its share of the pairs, and each micro-batch holds whole
pairs (its chosen rows, then the same pairs' rejected rows, as DPO's batch does); GRPO's weight follows its
`loss_type` (`GRPO_WEIGHTS`). Trainer's `training_step` (and TRL's around it: GRPO generates there) runs as at pp 1;
its call of `compute_loss` runs the schedule (`pipeline_step`). What TRL logs is computed once more
for the whole batch on the last stage from the micro-batches' outputs (`Replay`: the metrics one process computes,
and the loss, checked against the micro-batches' sum), then sent to every rank of the pipeline. Options whose loss
does not add up over micro-batches, or that call the model outside the training step, are refused by name.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from transformers import Trainer

from ..accessors import dp_group
from ..mesh import group_size, named_failure
from ..pp.own_loss import (
    SCHEDULED,
    Replay,
    StandIn,
    from_last_stage,
    guard,
    holds_last_stage,
    pipeline_group,
    pipeline_size,
    run_own_loss,
)
from ..runtime.collectives import all_gather
from ..runtime.rng import sync_replicated_stream
from ..state import state_of, wrapped_model
from .batch_rows import row_multiple

Layout = tuple[torch.Tensor, list[dict[str, Any]], list[float]]  # row order, micro-batches' inputs, loss weights
UNSPLIT_DPO_LOSSES = {
    "aot": "sorts the batch's log-ratios",
    "aot_unpaired": "sorts the batch's log-ratios",
    "sft": "is a mean over the batch's chosen tokens",
}


def trl_kind(trainer: Trainer) -> str | None:
    """`"SFTTrainer"`, `"DPOTrainer"` or `"GRPOTrainer"` when `trainer` is one of them (TRL's own), else None."""
    names = {c.__name__ for c in type(trainer).__mro__ if c.__module__.startswith("trl.")}
    return next((kind for kind in LAYOUTS if kind in names), None)


def check_pipeline_trainer(trainer: Trainer, own: list[type]) -> None:
    """At construction, pp_size > 1, a trainer with its own `compute_loss` (`own`: the classes defining it): TRL's SFT
    and DPO with options whose loss adds up over micro-batches; anything else refused, naming the class or option."""
    pp, name, kind = pipeline_size(trainer.model), type(trainer).__name__, trl_kind(trainer)
    foreign = [c.__name__ for c in own if not c.__module__.startswith("trl.")]
    if kind is None or foreign:
        raise NotImplementedError(
            f"{name} at pp_size={pp}: {(foreign or [own[0].__name__])[0]}.compute_loss computes the loss itself; under "
            f"a pipeline autotp runs only TRL's SFTTrainer's, DPOTrainer's and GRPOTrainer's compute_loss on the last "
            f"stage (it knows how their losses add up over micro-batches): use AutoTPTrainer, one of those, or "
            f"pp_size=1"
        )
    why = _refused_option(trainer, kind)
    if why is None and any(d.batch_group() is not None for d in state_of(trainer.model).dims.values()):
        why = "cp_size > 1 (context parallelism splits the sequence before the pipeline splits the rows)"
    if why is not None:
        raise NotImplementedError(f"{name} at pp_size={pp} with {why}: use pp_size=1 for it")
    guard(wrapped_model(trainer.model), name)
    trainer._autotp_pipelined, trainer._autotp_inside = True, False
    sync_generators(trainer)


def sync_generators(trainer: Trainer) -> None:
    """Every rank of the pipeline samples GRPO's completions alike: the pipeline's first rank's generator state (at
    construction, and after a resume reads each process's own)."""
    if getattr(trainer, "_autotp_pipelined", False) and trl_kind(trainer) == "GRPOTrainer":
        sync_replicated_stream(pipeline_group(wrapped_model(trainer.model)))


def _refused_option(trainer: Trainer, kind: str) -> str | None:
    if trainer.args.fp16:
        return "fp16 (its gradient scaler scales the loss Trainer back-propagates, not the pipeline's)"
    if getattr(trainer, "aux_loss_enabled", False):
        return "the MoE load-balancing loss (router_aux_loss_coef; the pipeline adds it per stage itself)"
    if kind == "SFTTrainer":
        if getattr(trainer, "padding_free", False):
            return (
                "padding_free (packing_strategy='bfd' sets it): it puts the whole batch in one row, which a pipeline "
                "cannot split into micro-batches; pack with packing_strategy='wrapped' instead"
            )
        if trainer.compute_loss_func is not None or trainer.label_smoother is not None:
            return "compute_loss_func or label smoothing (they call the model twice per batch)"
        return None
    if kind == "GRPOTrainer":
        return _refused_grpo_option(trainer)
    unsplit = [f"loss_type={t!r} ({UNSPLIT_DPO_LOSSES[t]})" for t in trainer.loss_types if t in UNSPLIT_DPO_LOSSES]
    if unsplit:
        return f"{unsplit[0]}, which does not add up over micro-batches"
    if getattr(trainer, "precompute_ref_logps", False):
        return "precompute_ref_log_probs=True (the reference runs outside the training step)"
    ref = getattr(trainer, "ref_model", None)
    if ref is None:
        return "no ref_model (the reference would be the policy's own layers with its adapters off)"
    if pipeline_size(ref) > 1:
        return (
            "a ref_model wrapped with pp_size > 1 (compute_loss runs it on the last stage only); give an unwrapped "
            "reference model"
        )
    return None


def _refused_grpo_option(trainer: Trainer) -> str | None:
    """GRPO: what computes log-probs outside the training step (the reference's, the old policy's), or a loss that
    does not add up over micro-batches."""
    args = trainer.args
    if trainer.beta != 0.0:
        return f"beta={trainer.beta} (the reference's log-probs are computed at generation, outside the training step)"
    if args.gradient_accumulation_steps % (args.steps_per_generation * trainer.num_iterations) or args.use_vllm:
        return "old-policy log-probs computed at generation (num_iterations > 1, steps_per_generation, or use_vllm)"
    if trainer.top_entropy_quantile < 1.0:
        return f"top_entropy_quantile={trainer.top_entropy_quantile} (a quantile over the batch's entropies)"
    if trainer.loss_type not in GRPO_WEIGHTS:
        return f"loss_type={trainer.loss_type!r}, whose sum over micro-batches autotp does not know"
    return None


def runs_pipeline(trainer: Trainer) -> bool:
    """Whether `compute_loss` is Trainer's training step's call at pp > 1 (not a micro-batch's, not evaluation's)."""
    return trainer.model.training and getattr(trainer, "_autotp_pipelined", False) and not trainer._autotp_inside


def pipeline_step(trainer: Trainer, inputs: dict[str, Any], num_items: Any, outputs: bool = False) -> torch.Tensor:
    """One accumulation step's forward and backward of `inputs` through the pipeline, the trainer's loss per
    micro-batch on the last stage, and the trainer's logged metrics left as one process's on every rank of the
    pipeline. Returns, for Trainer's `training_step` (which divides it for gradient accumulation where the trainer
    did not, and back-propagates it), the loss as the trainer's `compute_loss` returns it, a leaf: the gradients are
    in already."""
    kind = trl_kind(trainer)
    assert kind is not None  # `check_pipeline_trainer` refused any other trainer
    if outputs:
        raise NotImplementedError(f"{type(trainer).__name__}.compute_loss(return_outputs=True) at pp_size > 1")
    trainer._autotp_inside = True
    try:
        total, scale = _step(trainer, kind, inputs, num_items)
    finally:
        trainer._autotp_inside = False
    return (total / scale).requires_grad_()


def _step(trainer: Trainer, kind: str, inputs: dict[str, Any], num_items: Any) -> tuple[torch.Tensor, float]:
    order, micro, weights = LAYOUTS[kind](trainer, inputs, row_multiple(trainer)[0])
    model_inputs = _grpo_model_inputs(inputs) if kind == "GRPOTrainer" else inputs
    batch = {k: model_inputs[k][order] for k in SCHEDULED if torch.is_tensor(model_inputs.get(k))}
    labels = model_inputs.get("labels")  # the pipeline's; the trainer computes its own loss
    batch["labels"] = labels[order] if isinstance(labels, torch.Tensor) else batch["input_ids"]
    scale = 1.0 if _scaled_for_accumulation(trainer, num_items) else 1.0 / trainer.current_gradient_accumulation_steps
    kept = _logged_state(trainer)

    def loss(stand: StandIn, k: int) -> torch.Tensor:
        with metric_gathers(trainer, None):  # this micro-batch's metrics are dropped: the replay logs the batch's
            return trainer.compute_loss(stand, micro[k], num_items_in_batch=num_items) * (weights[k] * scale)

    loss.who = f"{type(trainer).__name__}.compute_loss"  # type: ignore[attr-defined]
    model = wrapped_model(trainer.model)
    with trainer.compute_loss_context_manager():
        total, outputs = run_own_loss(model, trainer.model, batch, loss)
    _restore(trainer, kept)
    verdict, last = None, holds_last_stage(model)
    if last:
        verdict = _replay(trainer, inputs, num_items, outputs, order, batch, total, scale)
    logged = from_last_stage(pipeline_group(model), (verdict, _logged_state(trainer)), last)
    _restore(trainer, logged[1])
    if logged[0] is not None:
        raise RuntimeError(logged[0])
    return total, scale


def _replay(
    trainer: Trainer,
    inputs: dict[str, Any],
    num_items: Any,
    outputs: list[Any],
    order: torch.Tensor,
    batch: dict[str, torch.Tensor],
    total: torch.Tensor,
    scale: float,
) -> str | None:
    """The last stage: the trainer's `compute_loss` of the whole batch from the micro-batches' outputs, for its
    metrics (gathered over DP only, each sample counted once) and to check that the micro-batches' losses add up to
    its loss. Returns what went wrong, or None."""
    who = f"{type(trainer).__name__}.compute_loss"
    scheduled = {k: v for k, v in batch.items() if k != "labels"}
    tp_size = getattr(trainer, "_tp_size", None)
    if tp_size is not None:
        trainer._tp_size = 1  # TRL divides its token count by it: here each replica's tokens are gathered once
    try:
        with torch.no_grad(), metric_gathers(trainer, dp_group(trainer.model)), trainer.compute_loss_context_manager():
            whole = trainer.compute_loss(
                Replay(outputs, order, _ordered(scheduled, order), who), inputs, num_items_in_batch=num_items
            )
    finally:
        if tp_size is not None:
            trainer._tp_size = tp_size
    whole = float(whole) * scale
    summed = float(total)
    half = trainer.args.bf16 or trainer.args.fp16
    if abs(whole - summed) > (3e-2 if half else 1e-3) * max(1.0, abs(whole)):
        return (
            f"{who} under a pipeline: the micro-batches' losses add up to {summed:.6g}, but the whole batch's loss is "
            f"{whole:.6g}: this trainer's loss does not add up over micro-batches as autotp weighs them; use pp_size=1"
        )
    return None


def _ordered(scheduled: dict[str, torch.Tensor], order: torch.Tensor) -> dict[str, torch.Tensor]:
    """The scheduled inputs back in the batch's row order (what the whole batch's model call passes)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return {k: v[inverse.to(v.device)] for k, v in scheduled.items()}


def _scaled_for_accumulation(trainer: Trainer, num_items: Any) -> bool:
    """Whether the trainer's loss is already divided for gradient accumulation (Trainer's `training_step` reads)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is not None:
        return bool(scaled)
    return bool(trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None


def _logged_state(trainer: Trainer) -> dict[str, Any]:
    """What TRL's `compute_loss` changes of the trainer: its metric lists and its token count."""
    return {k: copy.deepcopy(getattr(trainer, k)) for k in ("_metrics", "_total_train_tokens") if hasattr(trainer, k)}


def _restore(trainer: Trainer, state: dict[str, Any]) -> None:
    for key, value in state.items():
        setattr(trainer, key, copy.deepcopy(value))


@contextmanager
def metric_gathers(trainer: Trainer, group: Any) -> Iterator[None]:
    """The accelerator's gathers and reduces (TRL's metrics), over `group` (None: this rank's values alone), not every
    process: only the last stage's ranks run `compute_loss` under a pipeline, and a replica's ranks repeat its values
    (GRPO's generation metrics, `replica_metrics`)."""
    accelerator = trainer.accelerator

    def gather(value: Any, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_tensor(value):
            return value
        value = value.reshape(1) if value.dim() == 0 else value
        if group is None or group_size(group) == 1:
            return value
        parts = [torch.empty_like(value) for _ in range(group_size(group))]
        with named_failure(group, "the gather of TRL's metrics over DP"):
            all_gather(parts, value.contiguous(), group)
        return torch.cat(parts)

    def reduce(value: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        if not torch.is_tensor(value) or group is None or group_size(group) == 1:
            return value * scale if torch.is_tensor(value) else value
        total = value.clone()
        with named_failure(group, "the reduce of TRL's metrics over DP"):
            dist.all_reduce(total, group=group)
        return total * scale / (group_size(group) if reduction == "mean" else 1)

    saved = {k: vars(accelerator).get(k) for k in ("gather", "gather_for_metrics", "reduce")}
    accelerator.gather = accelerator.gather_for_metrics = gather
    accelerator.reduce = reduce
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                delattr(accelerator, key)
            else:
                setattr(accelerator, key, value)


def _rows(inputs: dict[str, Any], rows: torch.Tensor, count: int) -> dict[str, Any]:
    """`inputs` with its tensors of `count` rows taken at `rows`; other values as they are."""
    return {
        k: v[rows.to(v.device)] if torch.is_tensor(v) and v.dim() and v.shape[0] == count else v
        for k, v in inputs.items()
    }


def _sft(trainer: Trainer, inputs: dict[str, Any], micro: int) -> Layout:
    """SFT: consecutive rows; each micro-batch's token sum is divided by the window's label tokens (weight 1)."""
    rows = inputs["input_ids"].shape[0]
    order = torch.arange(rows)
    parts = order.chunk(micro)
    return order, [_rows(inputs, part, rows) for part in parts], [1.0] * micro


def _dpo(trainer: Trainer, inputs: dict[str, Any], micro: int) -> Layout:
    """DPO: the batch's rows are its pairs' chosen rows, then their rejected rows; each micro-batch takes whole pairs
    (its chosen rows, then theirs rejected) and weighs its mean over pairs by its share of them."""
    rows = inputs["input_ids"].shape[0]
    pairs = rows // 2
    if pairs % micro:
        raise ValueError(
            f"{type(trainer).__name__} at pp_size={pipeline_size(trainer.model)}: a batch of {pairs} pairs does not "
            f"split into pp_microbatches={micro} micro-batches of whole pairs; give a multiple of {micro} pairs"
        )
    per = pairs // micro
    parts = [
        torch.cat([torch.arange(k * per, (k + 1) * per), pairs + torch.arange(k * per, (k + 1) * per)])
        for k in range(micro)
    ]
    order = torch.cat(parts)
    return order, [_rows(inputs, part, rows) for part in parts], [per / pairs] * micro


def _grpo(trainer: Trainer, inputs: dict[str, Any], micro: int) -> Layout:
    """GRPO: consecutive completions, the model's input its prompt and completion side by side; each micro-batch's
    loss weighed as its loss type averages (over sequences: its share of them; over tokens: its share of the scored
    tokens; over the generation batch's tokens, `num_items_in_batch`: as it is)."""
    rows = inputs["completion_ids"].shape[0]
    order = torch.arange(rows)
    parts = order.chunk(micro)
    mask = inputs["completion_mask"] * inputs["tool_mask"] if "tool_mask" in inputs else inputs["completion_mask"]
    over = GRPO_WEIGHTS[trainer.loss_type]
    tokens = mask.sum().clamp(min=1)
    weights = [
        1.0 if over == "items" else len(p) / rows if over == "rows" else float(mask[p].sum() / tokens) for p in parts
    ]
    return order, [_rows(inputs, part, rows) for part in parts], weights


def _grpo_model_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """What GRPO's `compute_loss` passes the model: the prompt and the completion, side by side."""
    return {
        "input_ids": torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
        "attention_mask": torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
    }


GRPO_WEIGHTS = {
    "grpo": "rows",
    "sapo": "rows",
    "luspo": "rows",
    "dr_grpo": "rows",
    "bnpo": "tokens",
    "dapo": "items",
    "cispo": "items",
    "vespo": "items",
}
LAYOUTS: dict[str, Callable[[Trainer, dict[str, Any], int], Layout]] = {
    "SFTTrainer": _sft,
    "DPOTrainer": _dpo,
    "GRPOTrainer": _grpo,
}
