"""Sequence parallelism: parity (tolerances as in test_parity) and clear refusals; dropout masks recomputed under
activation checkpointing, whole hidden states, and a warning for a user's hook on a decoder layer (fp32, where only
the reduction order differs, 1e-5 relative)."""

from __future__ import annotations

import copy
import gc
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import autotp
from autotp.runtime.seq_collectives import SavedChunk
from autotp.sp.sequence import ChunkDropout
from autotp.testing import assert_parity, parity
from autotp.testing.spawn import run_ranks
from autotp.testing.tiny import tiny_config
from autotp.tp.layers import ParallelLinear
from models import CONFIGS, batch, labels_with_ignored, tiny_model


def sp_parity(rank: int, world: int, family: str, vocab_parallel_labels: bool) -> dict:
    ids = batch()
    labels = labels_with_ignored(ids) if vocab_parallel_labels else None
    return parity.compare_training(tiny_model(family), ids, world, labels=labels, sequence_parallel=True)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "gpt2", "gpt_neox"])  # the last two: row biases
def test_sequence_parallel_parity(family: str, tp: int) -> None:
    for report in run_ranks(sp_parity, tp, family, True):
        assert_parity(report)


def ctrl_parity(rank: int, world: int) -> dict:
    config = tiny_config("ctrl")
    config.resid_pdrop = config.embd_pdrop = 0.0
    torch.manual_seed(0)
    return parity.compare_training(AutoModelForCausalLM.from_config(config), batch(), world, sequence_parallel=True)


def test_a_block_taking_the_hidden_states_as_query_key_and_value_gets_them_gathered_in_each() -> None:
    """CTRL calls its attention with the normed hidden states three times over (value, key, query)."""
    for report in run_ranks(ctrl_parity, 2):
        assert_parity(report)


DROPOUTS = {
    "gpt2": dict(resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.3),  # nn.Dropout modules
    "starcoder2": dict(residual_dropout=0.3, embedding_dropout=0.3, attention_dropout=0.3),  # functional
    "gpt_neox": dict(hidden_dropout=0.3, attention_dropout=0.3),
}
FP32 = 1e-5


def dropout_with_and_without_sequence_parallel(rank: int, world: int, family: str, compiled: bool = False) -> dict:
    """`family` with every dropout at 0.3, wrapped at tp=`world` with and without SP (`compiled`: SP's step under
    torch.compile, aot_eager), one training forward/backward from the same random state: (loss, gathered gradients)
    of each."""
    reference = tiny_model(family, **DROPOUTS[family]).train()
    ids = batch()
    runs = []
    for sequence_parallel in (False, True):
        model = autotp.wrap(copy.deepcopy(reference), world, sequence_parallel=sequence_parallel)
        step = lambda m, ids: m(ids, labels=ids).loss  # noqa: E731
        torch.manual_seed(5)
        loss = (torch.compile(step, backend="aot_eager") if compiled and sequence_parallel else step)(model, ids)
        loss.backward()
        group = model.autotp_state.tp_group
        runs.append((loss.item(), {name: parity.full_tensor(p.grad, p, group) for name, p in model.named_parameters()}))
    (loss, grads), (sp_loss, sp_grads) = runs
    return {"loss": abs(loss - sp_loss), "grad": max(parity.grad_error(sp_grads[n], g) for n, g in grads.items())}


@pytest.mark.parametrize("family", ["gpt2", "starcoder2"])
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_dropout_on_a_chunk_draws_the_whole_tensors_mask(tp: int, family: str) -> None:
    """Resid dropout after a row layer sees a chunk under SP, as an `nn.Dropout` (GPT-2) or a call of
    `nn.functional.dropout` (StarCoder2). Each rank keeps its part of the mask the TP-only run draws for the whole
    tensor, so both runs agree (a chunk-size draw would repeat one mask on every rank)."""
    for report in run_ranks(dropout_with_and_without_sequence_parallel, tp, family):
        assert report["loss"] <= parity.LOSS_ATOL and report["grad"] <= parity.GRAD_RTOL, report


@pytest.mark.slow  # torch.compile
def test_functional_dropout_on_a_chunk_keeps_its_masks_under_compile() -> None:
    for report in run_ranks(dropout_with_and_without_sequence_parallel, 2, "starcoder2", True):
        assert report["loss"] <= parity.LOSS_ATOL and report["grad"] <= parity.GRAD_RTOL, report


@pytest.fixture
def two_rank_group(monkeypatch: pytest.MonkeyPatch):
    """A stand-in TP group of 2 for code that only asks torch.distributed for its size and this rank's place in it
    (`.rank` picks the rank); no process group, nothing is communicated."""
    group = SimpleNamespace(rank=0)
    monkeypatch.setattr(dist, "get_world_size", lambda g=None: 2 if g is group else pytest.fail("another group"))
    monkeypatch.setattr(dist, "get_rank", lambda g=None: group.rank if g is group else pytest.fail("another group"))
    return group


@pytest.mark.parametrize("how", ["F.dropout", "nn.Dropout"])
def test_chunk_dropout_keeps_this_ranks_part_of_the_whole_tensors_mask(two_rank_group, how: str) -> None:
    """Under the same generator state, the mask ChunkDropout applies to a rank's chunk [2, 4, 3] is that rank's share
    of the mask torch's dropout draws for the whole [2, 8, 3] tensor: chunks are the tokens in memory order, so rank 0
    holds sequence 0 and rank 1 sequence 1, each viewed as [2, 4, 3]."""
    p, seed = 0.3, 11
    torch.manual_seed(seed)
    whole_mask = F.dropout(torch.ones(2, 8, 3), p, training=True)
    assert torch.equal(whole_mask.unique(), torch.tensor([0, 1 / (1 - p)]))  # dropped, or kept and scaled
    x = torch.randn(2, 8, 3, generator=torch.Generator().manual_seed(0))
    drop = (lambda t: F.dropout(t, p, training=True)) if how == "F.dropout" else torch.nn.Dropout(p).train()
    masks = []
    for rank in (0, 1):
        two_rank_group.rank = rank
        chunk = x[rank].reshape(2, 4, 3)
        torch.manual_seed(seed)
        with ChunkDropout(SimpleNamespace(on=True), two_rank_group, True, []):
            out = drop(chunk)
        expected = whole_mask[rank].reshape(2, 4, 3)
        assert torch.equal(out, chunk * expected)
        masks.append(expected)
    assert not torch.equal(masks[0], masks[1])  # a chunk-size draw would give both ranks one mask


def test_chunk_dropout_off_a_chunk_is_torchs_dropout(two_rank_group) -> None:
    """Not on a chunk (a gathered block input), not training, or p = 0: torch's own dropout, the same draw."""
    x = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    expected = F.dropout(x, 0.5, training=True)
    torch.manual_seed(3)
    with ChunkDropout(SimpleNamespace(on=False), two_rank_group, True, []):
        assert torch.equal(F.dropout(x, 0.5, training=True), expected)
    with ChunkDropout(SimpleNamespace(on=True), two_rank_group, True, []):
        assert torch.equal(F.dropout(x, 0.5, training=False), x)
        assert torch.equal(F.dropout(x, 0.0, training=True), x)


def checkpointed(rank: int, world: int) -> dict:
    """SP with HF activation checkpointing: parity, and what a checkpointed forward, then its backward (whose
    recomputations stop early), leave holding a chunk."""
    reference = tiny_model("llama")
    reference.gradient_checkpointing_enable()
    report = parity.compare_training(
        reference, batch(), world, sequence_parallel=True, edit=lambda model: model.gradient_checkpointing_enable()
    )
    model = autotp.wrap(tiny_model("llama"), world, sequence_parallel=True)
    model.gradient_checkpointing_enable()
    gc.collect()  # the parity run's graphs

    def held() -> list[list[int]]:
        return [list(o.chunk.shape) for o in gc.get_objects() if isinstance(o, SavedChunk) and o.chunk is not None]

    loss = model(batch(), labels=batch()).loss
    report["chunks_held"] = held()
    loss.backward()
    report["chunks_held_after_backward"] = held()
    return report


@pytest.mark.slow  # about 1.5 s; SP parity stays quick
def test_activation_checkpointing_keeps_no_sequence_chunk_and_keeps_parity() -> None:
    """Checkpointing keeps only each layer's input: the column layers' shared chunk must not outlive the block's
    forward outside autograd's saved tensors, or SP would hold more than it saves."""
    for report in run_ranks(checkpointed, 2):
        assert report.pop("chunks_held") == [] and report.pop("chunks_held_after_backward") == []
        assert_parity(report)


def odd_sequence(rank: int, world: int) -> str:
    model = autotp.wrap(tiny_model("llama"), world, sequence_parallel=True)
    ids = batch(size=(2, 15))
    with pytest.raises(ValueError) as err:
        model(input_ids=ids, labels=ids)
    return str(err.value)


def test_sequence_length_must_divide() -> None:
    for message in run_ranks(odd_sequence, 2):
        assert "sequence length (15) to be a multiple of tp_size=2" in message


def test_moe_plans_are_refused_before_any_change() -> None:
    model = tiny_model("mixtral")
    before = [type(m).__name__ for m in model.modules()]
    with pytest.raises(ValueError, match="sequence_parallel supports dense attention and MLP blocks"):
        autotp.wrap(model, 1, sequence_parallel=True)
    assert [type(m).__name__ for m in model.modules()] == before


@pytest.mark.parametrize(
    "family,weight",
    [
        ("olmo2", "model.layers.0.self_attn.q_proj.weight"),  # attention left replicated (q/k norms over all heads)
        ("falcon_h1", "model.layers.0.mamba."),  # a state-space mixer beside the attention
    ],
)
def test_replicated_mixers_between_blocks_are_refused_before_any_change(family: str, weight: str) -> None:
    """Code between the sharded blocks sees one chunk of the sequence: a replicated attention would attend within
    the chunk only, a convolution or state-space scan would miss the other ranks' tokens."""
    model = tiny_model(family) if family in CONFIGS else AutoModelForCausalLM.from_config(tiny_config(family))
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(ValueError, match="sequence_parallel runs what sits between the sharded blocks") as err:
        autotp.wrap(model, 1, sequence_parallel=True)
    assert weight in str(err.value) and "use sequence_parallel=False" in str(err.value)
    assert not any(isinstance(m, ParallelLinear) for m in model.modules())
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())


def load_with_sequence_parallel(rank: int, world: int, path: str) -> float:
    from transformers import AutoModelForCausalLM

    ids = batch()
    direct = autotp.from_pretrained(path, world, sequence_parallel=True)
    wrapped = autotp.wrap(AutoModelForCausalLM.from_pretrained(path), world, sequence_parallel=True)
    losses = [m(input_ids=ids, labels=ids).loss for m in (direct, wrapped)]
    return abs(losses[0].item() - losses[1].item())


def test_from_pretrained_with_sequence_parallel_equals_wrap(tmp_path) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    assert run_ranks(load_with_sequence_parallel, 2, str(tmp_path)) == [0.0, 0.0]


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
    return {
        str(reentrant): (abs(other - loss), max(parity.grad_error(other_grads[n], g) for n, g in grads.items()))
        for reentrant, (other, other_grads) in runs.items()
    }


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_checkpointed_layers_under_sequence_parallelism_recompute_the_same_dropout_masks(family: str) -> None:
    """HF checkpoints a decoder layer's `forward`, not its hooks: the recomputation must still draw each chunk's part of
    the whole tensor's mask (before the fix, 25 of 28 gradients were off by a relative ~1)."""
    for report in run_ranks(checkpointed_dropout, 2, family):
        for reentrant, (loss_error, grad_error) in report.items():
            assert loss_error <= FP32 and grad_error <= FP32, (reentrant, loss_error, grad_error)


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
    return {
        "shapes": [tuple(s.shape) for s in tp_states] == [tuple(s.shape) for s in one_states],
        "states": max((a - b).abs().max().item() for a, b in zip(one_states, tp_states)),
        "pooled": (one_pooled - tp_pooled).abs().max().item(),
        "grad": parity.grad_error(
            parity.full_tensor(model.get_parameter(q).grad, model.get_parameter(q), group),
            reference.get_parameter(q).grad,
        ),
    }


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
