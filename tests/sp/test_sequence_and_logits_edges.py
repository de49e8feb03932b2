"""Edges of sequence and vocab parallelism: SP with activation checkpointing and dropout, hidden states under SP,
per-rank reseeding after wrap, and logits read after a vocab-parallel training forward.

Tolerances: fp32, where only the reduction order differs (a sum over TP ranks against one process's matmul), 1e-5
relative; a checkpointed recomputation replays the same operations, so it is exact up to that too."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, labels_with_ignored, tiny_model

FP32 = 1e-5
DROPOUTS = {"gpt2": dict(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3),
            "gpt_neox": dict(hidden_dropout=0.3, attention_dropout=0.3)}


def checkpointed_dropout(rank: int, world: int, family: str) -> dict:
    """Gradients of two forward/backward passes with dropout on under SP, without checkpointing and with HF's
    checkpointing (reentrant and not), each from the same random state: the worst difference to the first."""
    reference = tiny_model(family, **DROPOUTS[family]).train()
    ids = batch()
    runs = {}
    for reentrant in (None, True, False):
        model = autotp.wrap(copy.deepcopy(reference), world, sequence_parallel=True)
        if reentrant is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        torch.manual_seed(5)
        for _ in range(2):  # the second pass runs after a recomputation that stopped early (non-reentrant)
            loss = model(ids, labels=ids).loss
            loss.backward()
        group = model.autotp_state.tp_group
        runs[reentrant] = (loss.item(), {n: parity.full_tensor(p.grad, p, group) for n, p in model.named_parameters()})
    loss, grads = runs.pop(None)
    return {str(reentrant): (abs(other - loss), max(parity.grad_error(other_grads[n], g) for n, g in grads.items()))
            for reentrant, (other, other_grads) in runs.items()}


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_checkpointed_layers_under_sequence_parallelism_recompute_the_same_dropout_masks(family: str) -> None:
    """HF checkpoints a decoder layer's `forward`, not its hooks: the recomputation must still draw each chunk's part of
    the whole tensor's mask (before the fix, 25 of 28 gradients were off by a relative ~1)."""
    for report in run_ranks(checkpointed_dropout, 2, family):
        for reentrant, (loss_error, grad_error) in report.items():
            assert loss_error <= FP32 and grad_error <= FP32, (reentrant, loss_error, grad_error)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """TRL's per-token entropy, averaged: a whole-vocabulary operation on the logits."""
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    predicted, target = logits[:, :-1].argmax(-1), labels[:, 1:]
    return (predicted == target)[target != -100].float().mean().item()


def logits_read_after_training_forward(rank: int, world: int) -> dict:
    """One process and tp=`world` (vocab-parallel), each training on loss + entropy of the logits read from the output
    of a forward with labels: what reading them gathers, their difference, the accuracies and the gradients."""
    ids = batch()
    labels = labels_with_ignored(ids)
    reference = tiny_model("llama").train()
    expected = reference(ids, labels=labels)
    (expected.loss + entropy(expected.logits)).backward()
    model = autotp.wrap(tiny_model("llama"), world).train()
    gathers = []  # the all-gathers of vocab-wide tensors [batch, seq, vocab / tp]
    real = dist.all_gather

    def counted(buffers, tensor, *args, **kwargs):
        gathers.extend([tuple(tensor.shape)] if tensor.ndim == 3 and tensor.shape[-1] == 128 else [])
        return real(buffers, tensor, *args, **kwargs)

    dist.all_gather = counted
    try:
        output = model(ids, labels=labels)
        before_read = len(gathers)
        logits = output.logits
        (output.loss + entropy(logits)).backward()
        read_again = [output["logits"] is logits, output.to_tuple()[1] is logits, len(gathers)]
    finally:
        dist.all_gather = real
    group = model.autotp_state.tp_group
    grads = {n: parity.full_tensor(p.grad, p, group) for n, p in model.named_parameters()}
    expected_grads = dict(reference.named_parameters())
    model.eval()
    as_tuple = model(ids, return_dict=False)[0]
    return {"before_read": before_read, "read_again": read_again, "shape": list(logits.shape),
            "logits": (logits - expected.logits).abs().max().item(),
            "accuracy": (accuracy(logits, labels), accuracy(expected.logits, labels)),
            "grad": max(parity.grad_error(g, expected_grads[n].grad) for n, g in grads.items()),
            "tuple": (as_tuple - expected.logits).abs().max().item()}


def test_logits_read_after_a_vocab_parallel_training_forward_are_the_whole_vocabulary() -> None:
    """A training forward with labels computes its loss on vocabulary shards and gathers no logits; reading
    `output.logits` (as TRL's accuracy and entropy do) gathers the full vocabulary once, differentiably, so metrics and
    gradients through them equal one process's. A `return_dict=False` forward's logits are whole too."""
    for report in run_ranks(logits_read_after_training_forward, 2):
        assert report["before_read"] == 0  # the loss path keeps its memory saving
        assert report["read_again"] == [True, True, 1]  # one gather, kept
        assert report["shape"] == [2, 16, 256]
        assert report["logits"] <= FP32 and report["tuple"] <= FP32
        assert report["accuracy"][0] == report["accuracy"][1]
        assert report["grad"] <= FP32, report["grad"]


def reseeded_after_wrap(rank: int, world: int) -> dict:
    """Ranks reseeded apart after wrap (`torch.manual_seed(rank)`), then a training forward with dropout: the error, and
    whether the weights are untouched; then seeded alike (the fix the error names), a step keeps replicas equal."""
    model = autotp.wrap(tiny_model("gpt2", **DROPOUTS["gpt2"]), world).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = batch()
    torch.manual_seed(rank)
    with pytest.raises(RuntimeError) as err:
        model(ids, labels=ids).loss.backward()
    untouched = all(torch.equal(p, before[n]) and p.grad is None for n, p in model.named_parameters())
    torch.manual_seed(7 + autotp.dp_rank(model))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    norm = model.transformer.ln_f.weight.detach()  # replicated: equal on every TP rank after the step
    everyone = [torch.empty_like(norm) for _ in range(world)]
    dist.all_gather(everyone, norm)
    return {"error": str(err.value), "untouched": untouched, "replicas": max((t - norm).abs().max().item() for t in everyone)}


def test_ranks_reseeded_apart_after_wrap_stop_at_the_first_forward_with_the_fix() -> None:
    for report in run_ranks(reseeded_after_wrap, 2):
        assert "seed before wrap, or seed the same on every TP rank" in report["error"]
        assert report["untouched"] and report["replicas"] == 0.0


def hidden_states_under_sp(rank: int, world: int, return_dict: bool) -> dict:
    """`output_hidden_states=True` under SP against one process's model (same seed, same calls): every hidden state
    whole, a mean-pooled embedding equal, and its gradient flowing back to the weights as one process's."""
    reference = tiny_model("llama")
    model = autotp.wrap(tiny_model("llama"), world, sequence_parallel=True)
    ids = batch()
    report = {}
    for name, m in (("one", reference), ("tp", model)):
        out = m(ids, output_hidden_states=True, return_dict=return_dict)
        states = out.hidden_states if return_dict else next(item for item in out if isinstance(item, tuple))
        pooled = states[len(states) // 2].mean(1)  # a middle layer's output: a chunk before the fix
        pooled.sum().backward()
        report[name] = (states, pooled)
    group = model.autotp_state.tp_group
    (one_states, one_pooled), (tp_states, tp_pooled) = report["one"], report["tp"]
    q = "model.layers.0.self_attn.q_proj.weight"
    return {"shapes": [tuple(s.shape) for s in tp_states] == [tuple(s.shape) for s in one_states],
            "states": max((a - b).abs().max().item() for a, b in zip(one_states, tp_states)),
            "pooled": (one_pooled - tp_pooled).abs().max().item(),
            "grad": parity.grad_error(parity.full_tensor(model.get_parameter(q).grad, model.get_parameter(q), group),
                                      reference.get_parameter(q).grad)}


@pytest.mark.parametrize("return_dict", [True, False])
def test_hidden_states_under_sequence_parallelism_are_whole_sequences(return_dict: bool) -> None:
    """Before the fix the layers' hidden states were each rank's token-major chunk (a mean-pooled embedding off by
    3.5e-2); now they are gathered, differentiably, into what one process returns (fp32 reduction order)."""
    for report in run_ranks(hidden_states_under_sp, 2, return_dict):
        assert report["shapes"], report
        assert report["states"] <= FP32 and report["pooled"] <= FP32 and report["grad"] <= FP32, report


def hook_on_a_layer(rank: int, world: int) -> list[str]:
    model = autotp.wrap(tiny_model("llama"), world, sequence_parallel=True)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.model.layers[0].register_forward_hook(lambda module, args, output: None)
        model(batch(), output_hidden_states=True)  # transformers' own recorders: no warning
    return [str(w.message) for w in caught if "autotp" in str(w.message)]


def test_a_users_hook_on_a_decoder_layer_under_sequence_parallelism_is_warned_about() -> None:
    for messages in run_ranks(hook_on_a_layer, 2):
        assert len(messages) == 1 and "sees this rank's chunk of the sequence" in messages[0], messages



def attention_weights(rank: int, world: int, family: str, return_dict: bool) -> dict:
    """`output_attentions=True` on eager attention, against one process's model (same seed, same calls): every
    layer's weights, and the gradients of a loss on them (query and key projections, embeddings) as one process's."""
    reference = tiny_model(family)
    reference.set_attn_implementation("eager")
    model = autotp.wrap(copy.deepcopy(reference), world)
    ids = batch()
    outputs = {}
    for name, m in (("one", reference), ("tp", model)):
        out = m(input_ids=ids, output_attentions=True, return_dict=return_dict)
        weights = out.attentions if return_dict else out[-1]  # (logits, attentions) without a cache
        torch.stack(weights).pow(2).sum().backward()  # a loss on the weights themselves
        outputs[name] = weights
    group = model.autotp_state.tp_group
    grads = {n: parity.grad_error(parity.full_tensor(p.grad, p, group), reference.get_parameter(n).grad)
             for n, p in model.named_parameters() if reference.get_parameter(n).grad is not None}
    shapes = [tuple(w.shape) for w in outputs["tp"]] == [tuple(w.shape) for w in outputs["one"]]
    return {"shapes": shapes, "grad": max(grads.values()),
            "weights": max((a - b).abs().max().item() for a, b in zip(outputs["one"], outputs["tp"])) if shapes else 1}


@pytest.mark.parametrize("family,return_dict", [("llama", True), ("llama", False), ("gpt2", True),
                                                ("bert", True)])  # BERT's weights are recorded inside the block
def test_output_attentions_returns_every_head_in_order(family: str, return_dict: bool) -> None:
    """Before, each rank's weights held its own heads only (4 of 8); now they are gathered, differentiably, into what
    one process returns (fp32: the weights within 1e-5, gradients 1e-5 relative)."""
    for report in run_ranks(attention_weights, 2, family, return_dict):
        assert report["shapes"], report
        assert report["weights"] <= FP32 and report["grad"] <= FP32, report
