"""Parity between one process and tensor parallelism: the check behind the tests, the sweep and verify.

On each rank a reference model and a wrapped copy train side by side on the same batch; the
report holds the worst differences of the loss, of every gathered gradient and of every gathered
parameter after the optimizer steps.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..api import wrap
from ..dp.ddp import allreduce_gradients
from ..mesh import Group
from ..planning.probe import image_token, probe_inputs
from ..runtime.collectives import all_gather_full
from ..runtime.dimension import forward_backward, stepping
from ..runtime.rows import dp_full
from ..state import state_of

# fp32 tolerances: tensor parallelism changes only the order of sums. Loss: absolute. Gradients: relative to
# the tensor's largest reference entry (see grad_error). Parameters after a few AdamW steps at lr 1e-3: absolute.
LOSS_ATOL, GRAD_RTOL, PARAM_ATOL = 1e-5, 1e-5, 3e-5
GRAD_FLOOR = 1e-3


def full_tensor(tensor: torch.Tensor, param: nn.Parameter, group: Group) -> torch.Tensor:
    """The whole tensor behind a shard (a parameter or its gradient, FSDP's DTensors included); replicated ones as
    they are."""
    shard = getattr(param, "autotp_shard", None)
    tensor = dp_full(tensor.detach())
    return tensor if shard is None else all_gather_full(tensor, shard.partition, group)


def grad_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Max |diff| relative to the tensor's largest reference entry, floored at `GRAD_FLOOR`.

    The floor covers gradients that are zero in exact arithmetic (a key bias under softmax) and
    hold only rounding noise.
    """
    return ((got - expected).abs().max() / expected.abs().max().clamp_min(GRAD_FLOOR)).item()


def training_inputs(
    model: nn.Module, batch: int = 2, seq: int = 16, seed: int = 1
) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, torch.Tensor]]:
    """(input_ids, labels, other inputs) for one training batch of any task, from `autotp.planning.probe`.

    Seq2seq: the decoder ids are the labels (the model shifts them right). Vision-language: no loss on
    image positions, as processors do. Classification: a class per sequence or per token.
    """
    inputs = probe_inputs(model, batch=batch, seq=seq, seed=seed)
    ids = inputs.pop("input_ids", None)
    if "decoder_input_ids" in inputs:
        return ids, inputs.pop("decoder_input_ids"), inputs
    loss_type = getattr(model, "loss_type", None) or ""
    classes = getattr(model.config, "num_labels", 2)
    if loss_type.endswith("ForSequenceClassification"):
        return ids, torch.arange(batch) % classes, inputs
    if loss_type.endswith("ForTokenClassification"):
        return ids, ids % classes, inputs
    labels = ids.clone()
    token = image_token(model.config)
    if token is not None:
        labels[ids == token] = -100
    return ids, labels, inputs


def compare_training(
    reference: nn.Module,
    ids: torch.Tensor | None,
    tp_size: int,
    steps: int = 3,
    policy: str | Path | Mapping[str, Any] | None = None,
    lr: float = 1e-3,
    labels: torch.Tensor | None = None,
    edit: Callable[[nn.Module], Any] | None = None,
    inputs: Mapping[str, torch.Tensor] | None = None,
    **options: Any,
) -> dict:
    """Train `reference` and a wrapped copy of it side by side with AdamW; report the worst differences.

    AdamW's eps is 1e-6 rather than 1e-8: Adam divides by sqrt(v), so a gradient that is zero in
    exact arithmetic (a key bias under softmax) would turn its 1e-9 rounding noise into full-size
    steps of random sign. With eps 1e-6 such noise moves a parameter by ~lr * 1e-3, while real
    gradients (1e-4 and up) are stepped exactly as with the default.

    `edit`, if given, is applied to the reference and, after `wrap`, to the wrapped model, each time
    from the same random state: what a user does to a loaded model (resize its vocabulary, unfreeze).
    `inputs` are further forward arguments (a vision-language model's pixels, see `autotp.planning.probe`); `ids` may
    be None when they hold the model's main input (Whisper's `input_features`), and then `labels` is needed.
    Both take their steps through `autotp.forward_backward` (`model(**batch)` and the backward for the reference), the
    wrapped one then `allreduce_gradients`, as at every layout; where a dimension runs the step itself (a pipeline) a
    rank reports the parameters its part of the model trains. `options` are `wrap`'s (`sequence_parallel=True`,
    `pp_size=2`, ...).
    """
    model = wrap(copy.deepcopy(reference), tp_size, policy=policy, **options)
    if edit is not None:
        rng = torch.get_rng_state()
        edit(reference)
        torch.set_rng_state(rng)
        edit(model)
    labels = ids if labels is None else labels
    group = state_of(model).tp_group
    staged = stepping(model) is not None  # each rank's step trains only its part (a pipeline: its stages' parameters)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=lr, eps=1e-6) for m in (reference, model)]
    ref_params = dict(reference.named_parameters())
    report: dict[str, Any] = {"loss": 0.0, "grad": {}, "param": {}}
    for step in range(steps):
        losses = []
        for m in (reference, model):
            batch = {**({} if ids is None else {"input_ids": ids}), "labels": labels, **(inputs or {})}
            losses.append(forward_backward(m, **batch).loss.item())
        allreduce_gradients(model)
        report["loss"] = max(report["loss"], abs(losses[0] - losses[1]))
        if step == 0:
            report["grad"] = gradient_errors(model, ref_params, group, staged)
            if staged:  # what one process trains: each name on some stage
                report["reference_trained"] = sum(p.grad is not None for p in ref_params.values())
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    for name, p in model.named_parameters():
        if not staged or name in report["grad"]:  # under a pipeline: the parameters this rank's stages train
            report["param"][name] = (full_tensor(p, p, group) - ref_params[name].detach()).abs().max().item()
    report["sharded"] = sum(hasattr(p, "autotp_shard") for p in model.parameters())
    return report


def gradient_errors(
    model: nn.Module, ref_params: dict[str, nn.Parameter], group: Group, staged: bool
) -> dict[str, float]:
    """`grad_error` of each gradient one process computes, of the parameters this rank trains (`staged`: a rank's
    step trains only its part, a pipeline's stages, and holds other parameters it leaves untrained)."""
    return {
        name: grad_error(full_tensor(p.grad, p, group), ref_params[name].grad)
        for name, p in model.named_parameters()
        if ref_params[name].grad is not None and (not staged or p.grad is not None)
    }


def compare_loading(rank: int, world: int, path: str, task: str | None = None) -> dict:
    """Runs on each rank: `autotp.from_pretrained(path)` against `wrap` after transformers' own load
    (both through the auto class of `task`, by default the one `config.architectures` names).

    The report lists tensors, buffers and gradients that are not bit-equal, the logits' and the
    loss's difference, and how many parameters are sharded.
    """
    from transformers import AutoConfig

    from ..api import from_pretrained
    from ..compat.hf import model_class

    direct = from_pretrained(path, world, task=task)
    reference = wrap(model_class(AutoConfig.from_pretrained(path), task).from_pretrained(path), world)
    ours, theirs = direct.state_dict(), reference.state_dict()
    buffers = dict(reference.named_buffers())  # compared before a forward updates any (I-BERT's activation ranges)
    unequal_buffers = [n for n, b in direct.named_buffers() if not torch.equal(b, buffers[n])]
    ids, labels, inputs = training_inputs(reference)
    batch = {**({} if ids is None else {"input_ids": ids}), "labels": labels, **inputs}
    with torch.no_grad():
        logits = (direct(**batch).logits - reference(**batch).logits).abs().max().item()
    losses = []
    for model in (direct, reference):  # both must also train alike: one step, same loss and gradients
        model.train()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.item())
    grads = dict(reference.named_parameters())
    return {
        "keys": set(ours) == set(theirs),
        "unequal": [k for k in theirs if not torch.equal(ours[k], theirs[k])],
        "buffers": unequal_buffers,
        "shards": sum(hasattr(p, "autotp_shard") for p in direct.parameters()),
        "logits": logits,
        "loss": losses[0] - losses[1],
        "grads": [
            n
            for n, p in direct.named_parameters()
            if (p.grad is None) != (grads[n].grad is None)
            or p.grad is not None
            and not torch.equal(p.grad, grads[n].grad)
        ],
    }


def assert_parity(report: dict) -> None:
    """Fail, naming the worst tensor, when a `compare_training` report exceeds the fp32 tolerances."""
    assert report["loss"] <= LOSS_ATOL, f"loss differs by {report['loss']:.3g}"
    worst = max(report["grad"].items(), key=lambda kv: kv[1])
    assert worst[1] <= GRAD_RTOL, f"gradient of {worst[0]} differs by {worst[1]:.3g} (relative to its max)"
    worst = max(report["param"].items(), key=lambda kv: kv[1])
    assert worst[1] <= PARAM_ATOL, f"{worst[0]} differs by {worst[1]:.3g} after AdamW steps"
