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
    vocab_parallel: bool = True,
    smoothing: float = 0.0,
) -> dict:
    """One training step of one process and of tp=`world` (same seed, same calls): the loss's difference, each
    parameter gradient's and the hidden states' (the head's input) gradient's, and what the head returned (the
    stand-in, or whole logits). `label_smoothing`, passed to both, transformers' own loss drops: so does autotp's."""
    ids = batch(vocab=250, size=(2, 16 if sequence_parallel else 15))  # SP splits the sequence evenly
    labels = labels_with_ignored(ids)
    extra: dict = {"num_items_in_batch": torch.tensor(17)} if num_items else {}
    if smoothing:
        extra["label_smoothing"] = smoothing
    reference = build(family, tied)
    reference_hidden = hidden_grad(reference)
    expected = reference(input_ids=ids, labels=labels, **extra).loss
    expected.backward()
    model = autotp.wrap(
        build(family, tied),
        world,
        loss_chunk=chunk,
        sequence_parallel=sequence_parallel,
        vocab_parallel=vocab_parallel,
    )
    built, hidden = head_outputs(model), hidden_grad(model)
    loss = model(input_ids=ids, labels=labels, **extra).loss
    loss.backward()
    group = model.autotp_state.tp_group
    want = dict(reference.named_parameters())
    grads = {
        n: parity.grad_error(parity.full_tensor(p.grad, p, group), want[n].grad) for n, p in model.named_parameters()
    }
    grads["hidden states"] = parity.grad_error(hidden[0], reference_hidden[0])  # whole sequences, under SP too
    return {"loss": abs(loss.item() - expected.item()), "grad": grads, "built": built}


def hidden_grad(model: torch.nn.Module) -> list[torch.Tensor]:
    """The gradient of the LM head's input (the last hidden states) from now on."""
    grads: list[torch.Tensor] = []
    head_of(model).register_forward_pre_hook(lambda m, args: args[0].register_hook(grads.append) and None)
    return grads


def assert_close(report: dict) -> None:
    assert report["loss"] <= parity.LOSS_ATOL, report["loss"]
    worst = max(report["grad"].items(), key=lambda kv: kv[1])
    assert worst[1] <= parity.GRAD_RTOL, worst


def assert_chunked(reports: list[dict]) -> None:
    for report in reports:
        assert_close(report)
        assert report["built"] == ["PendingLogits"]  # the head built no logits: the loss ran over chunks


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize(("chunk", "num_items", "tied"), [(7, False, False), (4, True, True), (1024, True, False)])
def test_chunked_loss_matches_one_process(chunk: int, num_items: bool, tied: bool, tp: int) -> None:
    # 30 tokens: chunks of 7 and 4 do not divide them; rows with -100 (a prompt, padding)
    assert_chunked(run_ranks(one_step, tp, "llama", chunk, num_items, tied))


@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_at_tp1_and_with_a_replicated_head_the_loss_runs_over_chunks_and_matches(vocab_parallel: bool) -> None:
    """Before, only a vocab-parallel head was chunked: at tp 1 (no vocab plan) and with vocab_parallel=False the
    head built the whole logits. Label smoothing, num_items_in_batch, a tied head, -100 rows, chunks of 4."""
    assert_chunked([one_step(0, 1, "llama", 4, True, True, vocab_parallel=vocab_parallel, smoothing=0.1)])
    assert_chunked(run_ranks(one_step, 2, "llama", 4, True, True, False, vocab_parallel, 0.1))


def test_softcapping_and_logit_scale_run_over_chunks_at_tp1() -> None:
    """Gemma 2's final_logit_softcapping (divide, tanh, multiply) and Cohere's logit_scale are taken by the stand-in
    and applied to each chunk; before, they computed the whole logits."""
    assert_chunked([one_step(0, 1, "gemma2", 4, False), one_step(0, 1, "cohere", 4, True, smoothing=0.1)])


FAMILIES = ["llama", "gemma2", "cohere", "gpt2"]  # gpt2: a tied nn.Linear head (not a Conv1D), learned positions


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("vocab_parallel", [True, False])
def test_each_family_at_each_tp_matches_one_process_over_chunks(family: str, tp: int, vocab_parallel: bool) -> None:
    """Gemma 2 and Cohere are vocab-parallel under TP (the softcap and the logit scale on the shards; Cohere's plan is
    transformers', its logits' path checked by emulation), GPT-2 is not (not a causal LM by transformers' loss_type):
    its replicated head is chunked. Tied where the family's default is."""
    tied = family in ("gemma2", "gpt2")
    for num_items, smoothing in ((True, 0.0), (False, 0.1)):
        if tp == 1:
            reports = [one_step(0, 1, family, 5, num_items, tied, False, vocab_parallel, smoothing)]
        else:
            reports = run_ranks(one_step, tp, family, 5, num_items, tied, False, vocab_parallel, smoothing)
        assert_chunked(reports)


def test_turned_off_the_whole_logits_are_used_and_match() -> None:
    for off in (run_ranks(one_step, 2, "llama", None, False), [one_step(0, 1, "llama", None, True)]):
        for report in off:
            assert_close(report)
            assert report["built"] == ["Tensor"]


@pytest.mark.parametrize(
    ("family", "vocab_parallel"),
    [
        ("llama", True),
        pytest.param("llama", False, marks=pytest.mark.slow),
        pytest.param("gemma2", True, marks=pytest.mark.slow),
    ],
)
def test_under_sequence_parallelism_the_loss_runs_over_chunks_and_matches(family: str, vocab_parallel: bool) -> None:
    """Before, sequence parallelism took the whole logits. The head reads whole sequences there (the last layer's
    output is gathered), so its chunks are the same as without SP; 32 tokens, label_smoothing (ignored), num_items_in_batch."""
    assert_chunked(run_ranks(one_step, 2, family, 5, True, family == "gemma2", True, vocab_parallel, 0.1))


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


@pytest.mark.slow  # a memory measurement (about 1.5 s); the chunked loss's parity stays quick
def test_a_chunked_step_saves_at_most_an_eighth_of_the_whole_logits_step() -> None:
    chunked = run_ranks(saved_bytes, 2, 1024)
    whole = run_ranks(saved_bytes, 2, None)
    for ours, today in zip(chunked, whole):
        assert ours * 8 <= today, (ours, today)


def transformed_or_read(rank: int, world: int) -> dict:
    """A head whose logits are scaled by a tensor in a forward hook (a number is taken by the stand-in, a tensor
    computes the logits), and logits read after a chunked training forward: each against one process."""
    ids = batch(vocab=250, size=(2, 15))
    labels = labels_with_ignored(ids)
    out = {}
    for name, hooked in (("scaled", True), ("read", False)):
        reference, model = build("llama", False), autotp.wrap(build("llama", False), world, loss_chunk=4)
        for m in (reference, model):
            if hooked:
                head_of(m).register_forward_hook(lambda m, a, logits: logits * torch.tensor(0.5))
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


def test_a_replicated_heads_loss_on_whole_logits_ignores_label_smoothing_too() -> None:
    """A head scaled by a tensor computes its logits whole; at tp 1 the loss then drops `label_smoothing`, as over
    chunks and as one process's (transformers' own loss drops it)."""
    ids = batch(vocab=250, size=(2, 15))
    labels = labels_with_ignored(ids)
    reference, model = build("llama", False), autotp.wrap(build("llama", False), 1, loss_chunk=4)
    for m in (reference, model):
        head_of(m).register_forward_hook(lambda m, a, logits: logits * torch.tensor(0.5))
    built = head_outputs(model)
    expected = reference(input_ids=ids, labels=labels, label_smoothing=0.1).loss
    loss = model(input_ids=ids, labels=labels, label_smoothing=0.1).loss
    assert built == ["Tensor"]
    assert abs(loss.item() - expected.item()) <= parity.LOSS_ATOL


def cp_step(rank: int, world: int, tp: int, mode: str) -> dict:
    """One step of one process and of tp x cp (cp = world / tp) on the CP tests' inputs (`cp_workers.cp_inputs`): the
    loss's and gradients' differences, and what the head returned."""
    from cp_workers import cp_inputs, cp_models

    reference, model = cp_models("llama")
    model = autotp.wrap(model, tp, cp_size=world // tp, loss_chunk=5)
    built = head_outputs(model)
    inputs, ref_inputs = cp_inputs(mode)
    expected = reference(**ref_inputs).loss
    expected.backward()
    loss = model(**inputs).loss
    loss.backward()
    autotp.allreduce_gradients(model)
    group, want = autotp.tp_group(model), dict(reference.named_parameters())
    grads = {
        n: parity.grad_error(parity.full_tensor(p.grad, p, group), want[n].grad) for n, p in model.named_parameters()
    }
    return {"loss": abs(loss.item() - expected.item()), "grad": grads, "built": built}


@pytest.mark.parametrize(("tp", "mode"), [(1, "padding"), pytest.param(2, "packed", marks=pytest.mark.slow)])
def test_under_context_parallelism_each_ranks_tokens_run_over_chunks_and_match(tp: int, mode: str) -> None:
    """Before, context parallelism took the whole logits. CP's loss hands this rank's tokens' stand-in to the loss
    inside it, which sums them over chunks; CP adds the sums and divides by the whole batch's count."""
    assert_chunked(run_ranks(cp_step, 2 * tp, tp, mode))


def test_under_cpu_autocast_entered_inside_the_forward_the_head_computes_whole_logits() -> None:
    """accelerate (the Trainer's bf16) enters autocast inside the model's forward, after its pre-hooks: the head then
    computes its bf16 logits as one process's does, not a float32 stand-in, and the loss equals one process's."""
    ids = batch(vocab=250, size=(2, 15))
    reference, model = build("llama", False), autotp.wrap(build("llama", False), 1, loss_chunk=4)
    losses = []
    for m in (reference, model):
        forward = m.forward
        m.forward = lambda *a, forward=forward, **k: torch.autocast("cpu", torch.bfloat16)(forward)(*a, **k)
        losses.append(m(input_ids=ids, labels=ids).loss)
    built = head_outputs(model)
    assert model(input_ids=ids, labels=ids).logits.dtype == torch.bfloat16
    assert built == ["Tensor"]
    assert losses[1].item() == losses[0].item()
