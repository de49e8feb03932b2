"""The vocab-parallel LM head and loss over chunks of tokens (`autotp.vocab.chunked`): one process's loss and
gradients, with the batch x seq x vocab logits never built for a training loss.

Tolerances are `autotp.testing.parity`'s fp32 ones: the chunks and the shards only change the order of reductions.
"""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.options import WrapOptions
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from models import batch, labels_with_ignored, tiny_model


def build(family: str, tied: bool) -> torch.nn.Module:
    model = tiny_model(family, vocab_size=250, tie_word_embeddings=tied).train()
    if tied:
        model.tie_weights()
    return model


def head_of(model: torch.nn.Module):
    return model.get_output_embeddings()


def head_outputs(model: torch.nn.Module) -> list[str]:
    """The class of each output of the model's head from now on: `PendingLogits` (the stand-in) or `Tensor`."""
    built: list[str] = []
    head_of(model).register_forward_hook(lambda m, a, logits: built.append(type(logits).__name__))
    return built


def one_step(
    rank: int,
    world: int,
    family: str,
    chunk: int | None,
    num_items: bool,
    tied: bool = False,
    sequence_parallel: bool = False,
) -> dict:
    """One training step of one process and of tp=`world` (same seed, same calls): the loss's and each gradient's
    difference, and what the head returned (the stand-in, or whole logits)."""
    ids = batch(vocab=250, size=(2, 16 if sequence_parallel else 15))  # SP splits the sequence evenly
    labels = labels_with_ignored(ids)
    extra = {"num_items_in_batch": torch.tensor(17)} if num_items else {}
    reference = build(family, tied)
    expected = reference(input_ids=ids, labels=labels, **extra).loss
    expected.backward()
    model = autotp.wrap(build(family, tied), world, loss_chunk=chunk, sequence_parallel=sequence_parallel)
    built = head_outputs(model)
    loss = model(input_ids=ids, labels=labels, **extra).loss
    loss.backward()
    group = model.autotp_state.tp_group
    want = dict(reference.named_parameters())
    grads = {
        n: parity.grad_error(parity.full_tensor(p.grad, p, group), want[n].grad) for n, p in model.named_parameters()
    }
    return {"loss": abs(loss.item() - expected.item()), "grad": grads, "built": built}


def assert_close(report: dict) -> None:
    assert report["loss"] <= parity.LOSS_ATOL, report["loss"]
    worst = max(report["grad"].items(), key=lambda kv: kv[1])
    assert worst[1] <= parity.GRAD_RTOL, worst


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("chunk", "num_items", "tied"), [(7, False, False), (4, True, True), (1024, True, False)])
def test_chunked_loss_matches_one_process(chunk: int, num_items: bool, tied: bool, tp: int) -> None:
    # 30 tokens: chunks of 7 and 4 do not divide them; rows with -100 (a prompt, padding)
    for report in run_ranks(one_step, tp, "llama", chunk, num_items, tied):
        assert_close(report)
        assert report["built"] == ["PendingLogits"]  # the head built no logits: the loss ran over chunks


def test_turned_off_or_under_sequence_parallelism_or_not_vocab_parallel_the_whole_logits_are_used_and_match() -> None:
    # gpt2 is not vocab-parallel (its plan says why): its own head and loss, untouched
    for off in (
        run_ranks(one_step, 2, "llama", None, False),
        run_ranks(one_step, 2, "llama", 5, True, False, True),
        run_ranks(one_step, 2, "gpt2", 5, True, True),
    ):
        for report in off:
            assert_close(report)
            assert report["built"] == ["Tensor"]


def saved_bytes(rank: int, world: int, chunk: int | None) -> int:
    """Bytes saved for backward by one training step's forward at a 32k vocabulary, hidden 64, 2 x 1024 tokens."""
    config = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2
    )
    model = autotp.wrap(tiny_model("llama", vocab_size=32000, **config), world, loss_chunk=chunk).train()
    ids = batch(vocab=32000, size=(2, 1024))
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[id(t.untyped_storage())] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return sum(saved.values())


def test_a_chunked_step_saves_at_most_an_eighth_of_the_whole_logits_step() -> None:
    chunked = run_ranks(saved_bytes, 2, 1024)
    whole = run_ranks(saved_bytes, 2, None)
    for ours, today in zip(chunked, whole):
        assert ours * 8 <= today, (ours, today)


def transformed_or_read(rank: int, world: int) -> dict:
    """A head whose logits are scaled by a forward hook (as a softcap or Cohere's logit_scale would), and logits read
    after a chunked training forward: each against one process."""
    ids = batch(vocab=250, size=(2, 15))
    labels = labels_with_ignored(ids)
    out = {}
    for name, hooked in (("scaled", True), ("read", False)):
        reference, model = build("llama", False), autotp.wrap(build("llama", False), world, loss_chunk=4)
        for m in (reference, model):
            if hooked:
                head_of(m).register_forward_hook(lambda m, a, logits: logits * 0.5)
        built = head_outputs(model)
        expected, output = reference(input_ids=ids, labels=labels), model(input_ids=ids, labels=labels)
        (expected.loss + expected.logits.square().mean()).backward()
        (output.loss + output.logits.square().mean()).backward()  # the logits read, and trained through
        group = model.autotp_state.tp_group
        want = dict(reference.named_parameters())
        out[name] = {
            "loss": abs(output.loss.item() - expected.loss.item()),
            "logits": (output.logits - expected.logits).abs().max().item(),
            "grad": {
                n: parity.grad_error(parity.full_tensor(p.grad, p, group), want[n].grad)
                for n, p in model.named_parameters()
            },
            "built": built,
        }
    return out


def test_transformed_logits_take_the_whole_path_and_logits_read_after_a_chunked_loss_are_whole() -> None:
    for report in run_ranks(transformed_or_read, 2):
        for case in report.values():
            assert_close(case)
            assert case["logits"] <= 1e-5  # fp32, reduction order only
        assert report["scaled"]["built"] == ["Tensor"]  # the hook's product computed the logits: the loss used them
        assert report["read"]["built"] == ["PendingLogits"]


@pytest.mark.parametrize("chunk", [-1, 2.5, True])
def test_a_loss_chunk_that_is_not_a_token_count_is_refused(chunk) -> None:
    with pytest.raises(ValueError, match="loss_chunk"):
        WrapOptions(loss_chunk=chunk)
