"""What a stage cut assumes of a decoder model's forward, checked before the model changes: its decoder layers run
once each, in list order, each taking the previous layer's hidden states as they came out, and nothing else of it.

A stage runs the model's own forward and swaps in the hidden states it received at its first layer
(`autotp.pp.schedule.StageModule`). A model that loops over some layers (Dory's recurrent block), computes between
two layers (a norm, a residual from earlier), hands a layer more of the previous one's output (a second stream) or
sends something other than (rows, sequence, hidden) would be cut wrongly, so it is refused by name. Then the cut is
run once in one process, stage after stage, and its logits must equal the uncut model's: whatever else a decoder model
does around its layers (reading a layer another stage holds, say) is caught there. The checks run the model's
structural twin (the same classes, narrower: `autotp.planning.twin`), or the model itself when no twin can be built,
on probe inputs.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..planning.probe import probe_inputs
from ..planning.twin import structural_twin
from .cut import Cut, trainers
from .release import released, unowned
from .schedule import StageForward, StageModule, patched_forward

OUTSIDE = (
    "it computes something outside its decoder layers (from the embeddings, or from the layers' results) that a stage "
    "does not have"
)
Call = tuple[int, Any, list, tuple]  # (layer index, its hidden-states input, its tensor inputs, its outputs)


def check_chain(model: nn.Module, cut: Cut, pp: int) -> None:
    """Refuse, naming the layer, a model whose layers do not run as one chain a cut can split."""
    name = type(model).__name__
    subject = structural_twin(model) or model
    with evaluating(subject), _without_router_loss(subject), _grads_kept(subject):
        inputs = probe_inputs(subject)
        try:
            with torch.no_grad():
                calls = _record(subject, cut, inputs)
        except Exception as err:
            raise NotImplementedError(
                f"pp_size={pp} on {name}: a probe forward, run to check that its decoder layers form one chain a "
                f"pipeline can cut, failed ({type(err).__name__}: {str(err)[:160]})"
            ) from err
        why = _breaks([call[0] for call in calls], cut.bounds[-1]) or _links(calls, inputs, subject)
        if why is None:
            why = _staged(subject, cut, inputs)
    if why is not None:
        raise NotImplementedError(f"pp_size={pp} on {name}: {why}")


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


@contextmanager
def _without_router_loss(model: nn.Module) -> Iterator[None]:
    """A MoE's load-balancing loss off for the check: its share per stage is `autotp.pp.router`'s, tested apart."""
    config = model.config
    saved = getattr(config, "output_router_logits", None)
    if saved:
        config.output_router_logits = False
    try:
        yield
    finally:
        if saved:
            config.output_router_logits = saved


@contextmanager
def _grads_kept(model: nn.Module) -> Iterator[None]:
    """Each parameter's gradient as it was: the check's backwards run on the model itself where no twin builds."""
    saved = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        for param, grad in saved:
            param.grad = grad


def _record(subject: nn.Module, cut: Cut, inputs: dict) -> list[Call]:
    """Every call of a decoder layer in one forward."""
    calls: list[Call] = []

    def record(index: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            outputs = output if isinstance(output, tuple) else (output,)
            calls.append((index, hidden, _tensors((*args, *kwargs.values())), outputs))

        return hook

    layers = subject.get_submodule(cut.base).get_submodule(cut.layers)
    handles = [layer.register_forward_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        subject(**inputs, use_cache=False)
        return calls
    finally:
        for handle in handles:
            handle.remove()


def _breaks(order: list[int], count: int) -> str | None:
    """Why the layers do not run once each in list order, or None."""
    if order == list(range(count)):
        return None
    repeated = [(i, n) for i, n in sorted(Counter(order).items()) if n > 1]
    if repeated:
        why = f"runs decoder layer {repeated[0][0]} {repeated[0][1]} times (a loop over some of its layers)"
    elif len(order) < count:
        why = f"runs {len(order)} of its {count} decoder layers"
    else:
        why = f"runs its decoder layers out of order ({order[:8]})"
    return f"its decoder model {why}, which a stage cut cannot split"


def _links(calls: list[Call], inputs: dict, subject: nn.Module) -> str | None:
    """Why one layer's hidden states do not go to the next as they are, alone, in a stage's buffer shape, or None."""
    expected = (*inputs["input_ids"].shape, subject.get_input_embeddings().weight.shape[-1])
    for (i, _, _, out), (j, hidden, tensors, _) in zip(calls, calls[1:]):
        sent = out[0]
        if torch.is_tensor(sent) and tuple(sent.shape[:-1]) == expected[:-1] and sent.shape[-1] != expected[-1]:
            return (
                f"its decoder layers' hidden states are {sent.shape[-1]} wide, its input embedding {expected[-1]} (a "
                f"projection between them: OPT's project_in, word_embed_proj_dim != hidden_size), and a stage's "
                f"receive buffer takes the embedding's width: not built yet, train it at pp_size=1"
            )
        if not torch.is_tensor(sent) or tuple(sent.shape) != expected:
            shape = tuple(sent.shape) if torch.is_tensor(sent) else type(sent).__name__
            return (
                f"decoder layer {i} hands on hidden states of shape {shape}, not (rows, sequence, hidden) = "
                f"{expected} (several streams, or another layout), which a stage cannot receive"
            )
        if hidden is not sent:
            return (
                f"decoder layer {j}'s hidden states are not layer {i}'s output (the decoder model computes between "
                f"its layers), which a stage cut between them would skip"
            )
        carried = [k for k, t in enumerate(_tensors(out)) if k and any(t is x for x in tensors)]
        if carried:
            return (
                f"decoder layer {j} also takes output {carried[0]} of layer {i}, state carried from layer to layer "
                f"that a pipeline stage does not receive"
            )
    return None


def _staged(subject: nn.Module, cut: Cut, inputs: dict) -> str | None:
    """Why the cut, run stage after stage in one process as the pipeline runs it (each stage from the previous one's
    detached output, the backwards last to first), does not give the whole model's logits and gradients, each
    parameter's gradient on a stage that trains it, or None."""
    ids = inputs["input_ids"]
    rest = {k: v for k, v in inputs.items() if k != "input_ids"}
    params = dict(subject.named_parameters())
    by_id = trainers(subject, cut)
    trains = {n: by_id[id(p)] for n, p in params.items()}  # a tied weight: two stages
    subject.zero_grad(set_to_none=True)
    whole = subject(**inputs, labels=ids, use_cache=False)
    whole.loss.backward()
    expected = {n: p.grad.clone() for n, p in params.items() if p.grad is not None}
    subject.zero_grad(set_to_none=True)
    try:
        received: list[Any] = [None]  # each stage's input: the previous one's output, detached
        outputs = []
        kept: list[torch.Tensor] = []  # the last stage's logits
        forward = StageForward(subject.forward)  # patched as wrap patches it, for the stages' runs
        for stage in range(cut.stages):
            module = StageModule(subject, cut, stage, forward)
            module.logits = kept if module.last else None
            with released(subject, unowned(subject, cut, [stage])), patched_forward(subject, forward):
                outputs.append(module(received[-1], ids, labels=ids, **rest))  # what the stage frees, as it runs
            received.append(outputs[-1].detach().requires_grad_())
        staged = kept[0]
        got: dict[str, torch.Tensor] = {}
        for stage in reversed(range(cut.stages)):
            upstream = None if stage == cut.stages - 1 else received[stage + 1].grad
            outputs[stage].backward(upstream)
            for name, param in params.items():
                if param.grad is None:
                    continue
                if stage not in trains[name]:
                    if param.grad.abs().max() > 0:
                        return (
                            f"cut into {cut.stages} stages, stage {stage} gives a gradient to {name}, which stage "
                            f"{min(trains[name])} trains: it uses, outside its decoder layers, what an earlier stage "
                            f"holds, and that gradient would be lost"
                        )
                    continue
                got[name] = got[name] + param.grad if name in got else param.grad.clone()
            subject.zero_grad(set_to_none=True)
    except Exception as err:
        return (
            f"its forward, cut into {cut.stages} stages, fails ({type(err).__name__}: {str(err)[:160]}): it reads "
            f"more of the decoder layers than each stage holds"
        )
    error = (staged - whole.logits).abs().max().item()
    if error > 1e-5 * max(1.0, whole.logits.abs().max().item()):
        return f"its logits, cut into {cut.stages} stages, differ from the whole model's by {error:.2e}: {OUTSIDE}"
    for name, grad in expected.items():
        error = ((got[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-6)).item() if name in got else 1.0
        if error > 1e-4:
            return (
                f"cut into {cut.stages} stages, the gradient of {name} differs from the whole model's (relative "
                f"{error:.1e}): {OUTSIDE}"
            )
    return None


def _tensors(values: Any) -> list:
    """The tensors among `values`, and those one list, tuple or dict deep (a recurrent state handed on as a list)."""
    found: list = []
    for value in values:
        if isinstance(value, dict):
            value = list(value.values())
        found += list(value) if isinstance(value, (list, tuple)) else [value]
    return [t for t in found if torch.is_tensor(t)]
