"""Vocab parallelism: parity with tied/untied embeddings, uneven vocab and -100 labels; bytes; logits (read after a
training forward: gathered once, differentiably); saving.

Tolerances as in test_parity (fp32, only the order of sums differs).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM

import autotp
from autotp.planning.sharding import Partition
from autotp.testing import assert_parity, parity
from autotp.testing.spawn import run_ranks
from autotp.vocab.layers import VocabParallelLoss, _VocabParallelCrossEntropy
from models import batch, labels_with_ignored, tiny_model


def vocab_parity(rank: int, world: int, tied: bool, vocab: int) -> dict:
    reference = tiny_model("llama", tie_word_embeddings=tied, vocab_size=vocab)
    if tied:
        reference.tie_weights()
    ids = batch(vocab=vocab)
    report = parity.compare_training(reference, ids, world, labels=labels_with_ignored(ids))
    plan = autotp.explain(reference, world)
    report["vocab"] = plan.vocab
    return report


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("vocab", [256, 250])  # 250 = 63/63/62/62 rows at tp=4
@pytest.mark.parametrize("tied", [False, True])
def test_vocab_parallel_parity(tied: bool, vocab: int, tp: int) -> None:
    for report in run_ranks(vocab_parity, tp, tied, vocab):
        assert report["vocab"] is not None and report["vocab"].tied == tied
        assert report["vocab"].embedding == "model.embed_tokens"
        assert_parity(report)


def per_rank_bytes(rank: int, world: int) -> tuple[int, int, int]:
    config = dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
    )
    full = tiny_model("llama", **config)
    total = sum(p.numel() * p.element_size() for p in full.parameters())
    norms = sum(p.numel() * p.element_size() for n, p in full.named_parameters() if "norm" in n)
    model = autotp.wrap(full, world)
    return sum(p.numel() * p.element_size() for p in model.parameters()), total, norms


def test_parameter_bytes_per_rank_are_total_over_tp() -> None:
    for tp in (2, 4):
        for mine, total, norms in run_ranks(per_rank_bytes, tp):
            expected = (total - norms) / tp + norms  # everything but the norms is split
            assert abs(mine - expected) <= 0.02 * expected, (mine, expected)


def logits_shapes(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama", vocab_size=250), world)
    ids = batch(vocab=250)
    out = {"train_with_labels": tuple(model(input_ids=ids, labels=ids).logits.shape)}
    out["train_without_labels"] = tuple(model(input_ids=ids).logits.shape)
    model.eval()
    with torch.no_grad():
        out["eval_with_labels"] = tuple(model(input_ids=ids, labels=ids).logits.shape)
    return out


def test_logits_stay_sharded_only_for_a_training_loss() -> None:
    for shapes in run_ranks(logits_shapes, 2):
        # read after a training loss, the logits are gathered then (issue 23 item 10): never this rank's half
        assert (
            shapes["train_with_labels"] == shapes["train_without_labels"] == shapes["eval_with_labels"] == (2, 16, 250)
        )


def smoothed_loss(rank: int, world: int) -> tuple[float, float, float]:
    reference = tiny_model("llama", vocab_size=250)
    model = autotp.wrap(copy.deepcopy(reference), world)
    ids = batch(vocab=250)
    labels = labels_with_ignored(ids)
    whole = model.lm_head(model.model(input_ids=ids).last_hidden_state)  # called directly, the head gathers
    logits = whole.chunk(world, dim=-1)[rank]  # this rank's vocabulary shard (125 rows each), as the forward holds it
    ours = model.loss_function(logits, labels, label_smoothing=0.1)
    expected = reference.loss_function(reference(input_ids=ids).logits, labels, 250, label_smoothing=0.1)
    ours.backward()
    expected.backward()
    head = model.lm_head.weight
    grad = parity.full_tensor(head.grad, head, autotp.tp_group(model))
    return ours.item(), expected.item(), parity.grad_error(grad, reference.lm_head.weight.grad)


def test_label_smoothing_is_ignored_as_transformers_loss_ignores_it() -> None:
    """transformers' `ForCausalLMLoss` takes `label_smoothing` in its keywords and drops it (issue 49 item 8: before,
    the sharded loss applied it); one process's loss, the keyword passed alike."""
    for ours, expected, grad_error in run_ranks(smoothed_loss, 2):
        assert abs(ours - expected) <= 1e-5 and grad_error <= 1e-5


def masked_vocabulary_loss(rank: int, world: int) -> tuple[float, float, float]:
    """Logits at -inf over rank 1's whole vocabulary half for some rows (a masked vocabulary), and one more -inf
    logit elsewhere: the loss and its gradient still equal torch's cross-entropy on the full logits."""
    model = autotp.wrap(tiny_model("llama", vocab_size=250), world)
    full = torch.randn(2, 16, 250, generator=torch.Generator().manual_seed(3))
    full[0, :8, 125:] = float("-inf")
    full[1, 3, 7] = float("-inf")
    labels = torch.randint(0, 125, (2, 16), generator=torch.Generator().manual_seed(4))
    ours_logits = full[..., 125 * rank : 125 * (rank + 1)].clone().requires_grad_()
    ours = model.loss_function(ours_logits, labels)
    reference = full.clone().requires_grad_()
    target = F.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1)
    expected = F.cross_entropy(reference.reshape(-1, 250), target, ignore_index=-100)
    ours.backward()
    expected.backward()
    grad = reference.grad[..., 125 * rank : 125 * (rank + 1)]
    return ours.item(), expected.item(), (ours_logits.grad - grad).abs().max().item()


def test_a_shard_masked_out_whole_keeps_the_loss_finite_and_exact() -> None:
    for ours, expected, grad_error in run_ranks(masked_vocabulary_loss, 2):
        assert abs(ours - expected) <= 1e-5 and grad_error <= 1e-6, (ours, expected, grad_error)


def save_vocab_parallel(rank: int, world: int, path: str) -> torch.Tensor:
    model = autotp.wrap(tiny_model("llama", vocab_size=250, tie_word_embeddings=True), world)
    model.tie_weights()
    autotp.save_pretrained(model, path)
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch(vocab=250)).logits


def test_vocab_parallel_tied_checkpoint_loads_in_plain_transformers(tmp_path: Path) -> None:
    logits = run_ranks(save_vocab_parallel, 4, str(tmp_path / "out"))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    with torch.no_grad():
        expected = plain(input_ids=batch(vocab=250)).logits
    for tp_logits in logits:
        assert (tp_logits - expected).abs().max().item() <= 1e-5  # fp32: reduction order only


class OwnLossForCausalLM(transformers.LlamaForCausalLM):
    """A causal LM that computes its cross-entropy itself instead of through self.loss_function."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if labels is not None:
            logits = out.logits[:, :-1].reshape(-1, out.logits.shape[-1])
            out.loss = torch.nn.functional.cross_entropy(logits, labels[:, 1:].reshape(-1))
        return out


def own_loss(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = autotp.wrap(OwnLossForCausalLM(tiny_model("llama").config), world)
    ids = batch(vocab=100)  # every target inside rank 0's shard: the wrong loss would compute without complaint
    with pytest.raises(RuntimeError) as err:
        model(ids, labels=ids)
    torch.manual_seed(0)
    report = parity.compare_training(OwnLossForCausalLM(tiny_model("llama").config), ids, world, vocab_parallel=False)
    return {"error": str(err.value), "report": report}


def test_a_model_computing_its_own_loss_is_stopped_before_training_on_sharded_logits() -> None:
    for out in run_ranks(own_loss, 2):
        assert "computed its loss without self.loss_function" in out["error"]
        assert "vocab_parallel=False" in out["error"]
        assert_parity(out["report"])


# --- the cross-entropy maths in one process (a one-rank group: its all-reduces change nothing) --------------------


def logits_and_targets(rows: int = 12, vocab: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits with some -inf entries (a masked vocabulary) and targets with ignored (-100) rows."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=generator)
    logits[3, 2] = logits[4, :3] = float("-inf")
    targets = torch.randint(3, vocab, (rows,), generator=generator)  # never a -inf logit
    targets[1] = targets[7] = -100
    return logits, targets


def test_sharded_cross_entropy_of_the_whole_vocabulary_is_torchs(gloo_group_of_one) -> None:
    """Per-row losses (0 on ignored rows) and the logits' gradient equal `F.cross_entropy`'s; rows 3 and 4 hold -inf
    logits."""
    logits, targets = logits_and_targets()
    ours_in, torch_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = _VocabParallelCrossEntropy.apply(ours_in, targets, 0, -100, gloo_group_of_one)
    expected = F.cross_entropy(torch_in, targets, ignore_index=-100, reduction="none")
    assert torch.isfinite(expected).all()
    assert ours[1] == ours[7] == 0
    torch.testing.assert_close(ours, expected)
    weights = torch.linspace(0.5, 2, len(targets))  # a different upstream gradient on each row
    (ours * weights).sum().backward()
    (expected * weights).sum().backward()
    assert ours_in.grad[1].abs().max() == 0  # an ignored row
    assert ours_in.grad[3, 2] == 0  # a -inf logit has probability 0
    torch.testing.assert_close(ours_in.grad, torch_in.grad)


@pytest.mark.parametrize("num_items_in_batch", [None, 7, torch.tensor(9)])
def test_the_loss_shifts_labels_and_divides_as_transformers_does(gloo_group_of_one, num_items_in_batch) -> None:
    """`VocabParallelLoss` on this rank's 6 logits of a vocabulary of 8, the other rank's 2 at -inf (they add
    nothing to any sum): labels shifted left with -100 appended, the sum over the targets divided by
    `num_items_in_batch`, else by the count of targets that are not -100."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 6, generator=generator)
    labels = torch.randint(0, 6, (2, 5), generator=generator)
    labels[0, 2] = -100
    loss = VocabParallelLoss(Partition(-1, 8, (((0, 6),), ((6, 2),))), gloo_group_of_one, full_loss=None)
    ours = loss(logits, labels, num_items_in_batch=num_items_in_batch)
    assert loss.calls == 1  # the sharded path, not the model's own loss
    whole = torch.cat([logits, torch.full((2, 5, 2), float("-inf"))], dim=-1)
    shifted = torch.tensor(
        [
            [labels[0, 1], -100, labels[0, 3], labels[0, 4], -100],
            [labels[1, 1], labels[1, 2], labels[1, 3], labels[1, 4], -100],
        ]
    )
    total = F.cross_entropy(whole.reshape(-1, 8), shifted.reshape(-1), ignore_index=-100, reduction="sum")
    divisor = 7 if num_items_in_batch is None else int(num_items_in_batch)  # 10 positions, 3 of them -100
    torch.testing.assert_close(ours, total / divisor)


def chunked_log_probs(model: torch.nn.Module, ids: torch.Tensor, head: str) -> torch.Tensor:
    """The common RL pattern: hidden states from the base model, the LM head applied chunk by chunk, the log-prob of
    each next token picked (`head`: called as `model.lm_head` or as `model.get_output_embeddings()`)."""
    hidden = model.model(input_ids=ids).last_hidden_state[:, :-1]
    call = model.lm_head if head == "lm_head" else model.get_output_embeddings()
    picked = []
    for chunk, targets in zip(hidden.split(5, dim=1), ids[:, 1:].split(5, dim=1)):
        log_probs = call(chunk).float().log_softmax(-1)
        picked.append(log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1))
    return torch.cat(picked, dim=1)


def head_called_directly(rank: int, world: int, head: str, vocab: int) -> dict:
    """The LM head called outside the model's forward, on a wrapped model and on one process; then the model's own
    training forward, which must still compute its loss on the vocabulary shards."""
    reference = tiny_model("llama", vocab_size=250)
    model = autotp.wrap(copy.deepcopy(reference), world)
    ids = batch(vocab=vocab)
    ours, expected = chunked_log_probs(model, ids, head), chunked_log_probs(reference, ids, "lm_head")
    ours.sum().backward()
    expected.sum().backward()
    group = autotp.tp_group(model)
    grads = {
        name: parity.grad_error(parity.full_tensor(p.grad, p, group), reference.get_parameter(name).grad)
        for name, p in model.named_parameters()
    }
    model.zero_grad()
    calls = model.loss_function.calls
    model(input_ids=ids, labels=ids).loss.backward()
    return {
        "log_probs": (ours - expected).abs().max().item(),
        "shape": tuple(ours.shape),
        "grads": grads,
        "sharded_loss": model.loss_function.calls - calls,
    }


@pytest.mark.parametrize("head", ["lm_head", "get_output_embeddings"])
@pytest.mark.parametrize("vocab", [125, 250])  # 125: every id in rank 0's shard (wrong values); 250: an index error
def test_the_lm_head_called_directly_returns_whole_logits_with_their_gradients(head: str, vocab: int) -> None:
    """fp32, only the order of sums differs: log-probs within 1e-5, gradients as test_parity's (1e-5 relative)."""
    for report in run_ranks(head_called_directly, 2, head, vocab):
        assert report["log_probs"] <= 1e-5, report["log_probs"]
        worst = max(report["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] <= 1e-5, worst
        assert report["sharded_loss"] == 1


FP32 = 1e-5  # fp32, only the reduction order differs


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
    return {
        "before_read": before_read,
        "read_again": read_again,
        "shape": list(logits.shape),
        "logits": (logits - expected.logits).abs().max().item(),
        "accuracy": (accuracy(logits, labels), accuracy(expected.logits, labels)),
        "grad": max(parity.grad_error(g, expected_grads[n].grad) for n, g in grads.items()),
        "tuple": (as_tuple - expected.logits).abs().max().item(),
    }


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
