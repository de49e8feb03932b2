"""Context parallelism at the model's boundary: CP ranks fed different batches or lengths, tuple outputs,
`logits_to_keep`, logits read after the gradient sync or on one rank only, padding-free batch keywords, a manual
decode loop, and TRL's SFTTrainer.

Each compares a cp=2 run with one process set up alike (same seed, same calls, same batch): fp32, where only the
reduction order differs (attention over gathered keys in blocks, the loss summed over CP), so 1e-5
(`parity.LOSS_ATOL`); or checks a refusal that names the fix, raised on every rank.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import autotp
from autotp.testing import parity
from autotp.testing.spawn import run_ranks
from cp_workers import CP_FAMILIES, cp_models
from models import batch, tiny_model

TOL = parity.LOSS_ATOL


def _pair(attn: str = "sdpa") -> tuple[torch.nn.Module, torch.nn.Module]:
    """(one process's model, the same weights wrapped at cp=2), as a user builds them from one seed."""
    reference, model = cp_models("llama", attn)
    return reference, autotp.wrap(model, 1, cp_size=2)


def _error(call) -> str:
    try:
        call()
    except Exception as err:  # noqa: BLE001 (the message is what the test checks)
        return f"{type(err).__name__}: {err}"
    return ""


def _different_inputs(rank: int, world: int) -> dict:
    """Each CP rank its own batch (DistributedSampler over the world), then its own length; then the same batch."""
    _, model = _pair()
    ids = batch(seed=1 + rank)
    report = {
        "forward": _error(lambda: model(input_ids=ids, labels=ids)),
        "check": _error(lambda: autotp.check_same_inputs(model, input_ids=ids)),
    }
    ids = batch(size=(2, 15 + rank))
    report["length"] = _error(lambda: model(input_ids=ids, labels=ids))
    same = batch()
    report["same"] = model(input_ids=same, labels=same).loss.item()
    return report


@pytest.mark.timeout(120)
def test_cp_ranks_given_different_batches_or_lengths_are_refused_on_every_rank() -> None:
    """Before: each rank's loss mixed both batches silently, and different lengths died in gloo's collective."""
    for report in run_ranks(_different_inputs, 2):
        for key in ("forward", "check"):
            assert "context-parallel ranks got different inputs: input_ids=" in report[key], report
            assert "autotp.data_parallel_sampler" in report[key], report
        assert "(shape (2, 15), torch.int64) differs from rank 1's (shape (2, 16)" in report["length"], report
        assert report["same"] > 0


def _tuples(rank: int, world: int) -> dict:
    reference, model = _pair()
    ids = batch(size=(2, 15))  # padded to 16 under CP
    model.eval()
    got = model(input_ids=ids, output_hidden_states=True, return_dict=False, use_cache=False)
    expected = reference.eval()(input_ids=ids, output_hidden_states=True, return_dict=False, use_cache=False)
    model.train()
    trained = model(input_ids=ids, labels=ids, return_dict=False, use_cache=False)
    expected_trained = reference.train()(input_ids=ids, labels=ids, return_dict=False, use_cache=False)
    return {
        "got": got,
        "expected": expected,
        "trained": trained,
        "expected_trained": expected_trained,
        "refused": _error(lambda: model(input_ids=ids, return_dict=False)),
    }


def _flat(values) -> list[torch.Tensor]:
    return [t for v in values for t in (v if isinstance(v, tuple) else (v,))]


@pytest.mark.timeout(120)
def test_return_dict_false_gives_one_process_tuple_at_cp2() -> None:
    """Before: the hidden states were this rank's zigzag chunk ((2, 8, 64) for (2, 15, 64))."""
    for report in run_ranks(_tuples, 2):
        for got, expected in ((report["got"], report["expected"]), (report["trained"], report["expected_trained"])):
            assert [type(x) for x in got] == [type(x) for x in expected]
            for a, b in zip(_flat(got), _flat(expected)):
                assert a.shape == b.shape and (a - b).abs().max() <= TOL
        assert "return_dict=False with use_cache" in report["refused"] and "use_cache=False" in report["refused"]


def _kept_logits(rank: int, world: int) -> dict:
    reference, model = _pair()
    ids = batch(size=(2, 15))
    positions = torch.tensor([3, 14])
    with torch.no_grad():
        return {
            "last": (
                model(input_ids=ids, logits_to_keep=1).logits,
                reference(input_ids=ids, logits_to_keep=1, use_cache=False).logits,
            ),
            "some": (
                model(input_ids=ids, logits_to_keep=positions).logits,
                reference(input_ids=ids, logits_to_keep=positions, use_cache=False).logits,
            ),
            "refused": _error(lambda: model(input_ids=ids, labels=ids, logits_to_keep=1)),
        }


@pytest.mark.timeout(120)
def test_logits_to_keep_gives_one_process_last_positions_at_cp2() -> None:
    """Before: the last positions of this rank's chunk, not of the sequence."""
    for report in run_ranks(_kept_logits, 2):
        assert "logits_to_keep with labels" in report.pop("refused")
        for got, expected in report.values():
            assert got.shape == expected.shape and (got - expected).abs().max() <= TOL


def _logits_after_sync(rank: int, world: int) -> dict:
    reference, model = _pair()
    ids = batch()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (reference, model)]
    accuracy = []
    for m, optimizer in zip((reference, model), optimizers):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        if m is model:
            autotp.allreduce_gradients(model)
        accuracy.append((out.logits[:, :-1].argmax(-1) == ids[:, 1:]).float().mean().item())  # a metric
        optimizer.step()
    error = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), model.parameters()))
    return {"accuracy": accuracy, "param": error}


@pytest.mark.timeout(120)
def test_logits_read_after_allreduce_gradients_leave_the_step_allowed() -> None:
    """Before: reading .logits for a metric marked the synced gradients unsynced, and the step was refused."""
    for report in run_ranks(_logits_after_sync, 2):
        assert report["accuracy"][0] == report["accuracy"][1]
        assert report["param"] <= parity.PARAM_ATOL, report


def _logits_on_one_rank(rank: int, world: int, then: str) -> str:
    """Rank 0 alone reads a training forward's logits (to log a metric); both `then` run the next forward, or the
    backward of the loss."""
    _, model = _pair()
    ids = batch()
    out = model(input_ids=ids, labels=ids)

    def read_then_go_on():
        if rank == 0:
            out.logits.sum()
        if then == "backward":
            out.loss.backward()
        else:
            model(input_ids=ids, labels=ids)

    return _error(read_then_go_on)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("then", ["forward", "backward"])
def test_logits_read_on_one_cp_rank_only_is_named_on_every_rank(then: str) -> None:
    """Before: the reader hung in its gather until gloo's timeout (or a collective mismatch), unnamed; so it did with
    the other rank gone on to its backward (issue 39: past 300 s at torch's default timeout; 60 s here)."""
    calls = {
        "forward": "some began a forward, others read a forward's logits",
        "backward": "some read a forward's logits (.logits), others began a backward",
    }
    for message in run_ranks(_logits_on_one_rank, 2, then):
        assert calls[then] in message, message
        assert "is a collective" in message and "every CP rank or on none" in message


def _padding_free(rank: int, world: int, attn: str) -> dict:
    """Padding-free batches (no attention mask; cu_seq_lens_q/k and max_length_q/k, TRL's also seq_idx) as
    transformers' DataCollatorWithFlattening and TRL's collator build them, one training forward and backward."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    examples = [{"input_ids": batch(size=(1, n), seed=n)[0].tolist()} for n in (5, 9, 7)]
    batches = {
        "transformers": tf.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples),
        "trl": DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples),
    }
    report = {}
    for name, inputs in batches.items():
        assert "cu_seq_lens_q" in inputs and "attention_mask" not in inputs
        reference, model = _pair(attn)
        expected = reference(**inputs, use_cache=False)
        expected.loss.backward()
        got = model(**inputs, use_cache=False)
        got.loss.backward()
        autotp.allreduce_gradients(model)
        grad = max(parity.grad_error(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters()))
        report[name] = (abs(got.loss.item() - expected.loss.item()), grad, "seq_idx" in inputs)
    return report


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attn", ["sdpa", "varlen_reference"])
def test_padding_free_batch_keywords_at_cp2(attn: str) -> None:
    """Before: the flash branch failed with "got multiple values for keyword argument 'cu_seq_lens_q'", and TRL's
    seq_idx was refused as a per-token input. One process's loss and gradients (sdpa: documents from position_ids;
    flash: from cu_seq_lens, as each reads them)."""
    for report in run_ranks(_padding_free, 2, attn):
        assert report["trl"][2]  # TRL's collator adds seq_idx
        for loss, grad, _ in report.values():
            assert loss <= TOL and grad <= parity.GRAD_RTOL, report


def _decode(rank: int, world: int) -> dict:
    """A manual greedy decode loop with a cache passed as transformers 5.24 names it (cache=) and as before
    (past_key_values=): every forward with a cache runs whole at cp=2, as on one process."""
    reference, model = _pair()
    prompt = batch(size=(2, 6))
    model.eval()
    reference.eval()
    runs = {}
    for name, m in (("one", reference), ("cache", model), ("past_key_values", model)):
        keyword = "past_key_values" if name == "past_key_values" else "cache"
        cache, ids, tokens = tf.DynamicCache(config=m.config), prompt, []
        with torch.no_grad():
            for _ in range(4):
                logits = m(input_ids=ids, use_cache=True, **{keyword: cache}).logits[:, -1]
                ids = logits.argmax(-1, keepdim=True)
                tokens.append(ids)
        runs[name] = (torch.cat(tokens, 1), logits)
    return runs


@pytest.mark.timeout(120)
def test_manual_decode_with_cache_or_past_key_values_matches_one_process_at_cp2() -> None:
    for runs in run_ranks(_decode, 2):
        tokens, logits = runs.pop("one")
        for got_tokens, got_logits in runs.values():
            assert torch.equal(got_tokens, tokens) and (got_logits - logits).abs().max() <= TOL


ISSUE_LENGTHS = torch.randint(3, 20, (24,), generator=torch.Generator().manual_seed(0)).tolist()  # batches of
# 10, 19 and 5 tokens in sequential order, none a multiple of 2 x cp: autotp pads them to 12, 20 and 8


def _sft_run(
    rank: int, world: int, output: str, packing: bool, lengths: list[int], sequential: bool, bf16: bool = False
) -> dict:
    """TRL's SFTTrainer (its fused LM head) on a tiny Llama: on one process as TRL's docs show it, or through
    `tp_trainer` at cp=world; 3 steps on sequences of `lengths`, packed or padded, read in autotp's DP sampler's order
    or (`sequential`) in order on both sides, as a user's `_get_train_sampler` override does. Records each step's
    loss and gradients (synced, before Trainer clips them), the parameters after the last step and the logged
    metrics."""
    import os
    import sys

    from accelerate.state import PartialState
    from datasets import Dataset
    from torch.utils.data import DistributedSampler, SequentialSampler
    from trl import SFTConfig, SFTTrainer

    from autotp.hf_trainer import tp_trainer
    from readme_commands import ROOT

    sys.path.insert(0, str(ROOT / "examples"))
    from sft_lora import tokenizer
    from train_trainer import LossRecorder

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # as torchrun sets them
    PartialState._reset_state()  # accelerate's process state, as a fresh process finds it

    class Recorder(LossRecorder):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters()})
            return loss

    class Sequential:
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(self.train_dataset)

    class OneProcessSFT(Recorder, SFTTrainer):
        def _get_train_sampler(self, train_dataset=None):  # the order autotp's DP sampler deals
            return DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=self.args.seed)

    class ContextParallelSFT(Recorder, tp_trainer(SFTTrainer)):
        pass

    data = Dataset.from_dict({"input_ids": [batch(size=(1, n), seed=i)[0].tolist() for i, n in enumerate(lengths)]})
    args = SFTConfig(
        output_dir=output,
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        logging_steps=1,
        seed=0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        max_length=32,
        disable_tqdm=True,
        bf16=bf16,
        packing=packing,
    )
    model = tiny_model("llama", **CP_FAMILIES["llama"])
    if world > 1:
        autotp.wrap(model, 1, cp_size=world)
    cls = ContextParallelSFT if world > 1 else OneProcessSFT
    if sequential:
        cls = type(cls.__name__, (Sequential, cls), {})
    trainer = cls(model=model, args=args, train_dataset=data, processing_class=tokenizer(256))
    trainer.grads = []
    trainer.train()
    logs = [
        {k: v for k, v in log.items() if "runtime" not in k and "per_second" not in k and k != "total_flos"}
        for log in trainer.state.log_history
    ]
    return {
        "losses": trainer.losses,
        "grads": trainer.grads,
        "logs": logs,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _sft_difference(got: dict, one: dict) -> dict:
    """The worst differences of a CP run from one process: losses, each step's gradients (relative), parameters."""
    return {
        "loss": max(abs(a - b) for a, b in zip(got["losses"], one["losses"])),
        "grad": max(
            parity.grad_error(mine[n], theirs[n]) for mine, theirs in zip(got["grads"], one["grads"]) for n in theirs
        ),
        "param": max((got["params"][n] - p).abs().max().item() for n, p in one["params"].items()),
    }


@pytest.mark.slow  # TRL's trainer, three times per case
@pytest.mark.timeout(300)
@pytest.mark.parametrize("packing", [False, True])
@pytest.mark.parametrize("data", ["mixed", "issue"])
def test_trl_sft_at_cp2_trains_as_one_process(tmp_path, packing: bool, data: str) -> None:
    """Before: without packing TRL's fused LM head ran on this rank's chunk against the whole labels ("shape ... is
    invalid"); with it, the collator's seq_idx was refused. Now the head reads the whole sequence's last hidden
    states (gathered), so its log-probabilities, entropy and accuracy are one process's. Compared over 3 steps:
    losses, gradients, parameters and every logged metric (`num_tokens` counted each batch twice at cp 2). "issue":
    issue 39's setup, 24 rows of random lengths 3-19 read in order on both sides (batches of lengths that are no
    multiple of 2 x cp); "mixed": longer rows in autotp's shuffled order."""
    lengths = ISSUE_LENGTHS if data == "issue" else [12, 20, 9, 31, 17, 25, 14, 28]
    (one,) = run_ranks(_sft_run, 1, str(tmp_path / "one"), packing, lengths, data == "issue")
    for got in run_ranks(_sft_run, 2, str(tmp_path / "cp"), packing, lengths, data == "issue"):
        assert len(got["losses"]) == 3, got["losses"]
        difference = _sft_difference(got, one)
        assert difference["loss"] <= TOL and difference["grad"] <= parity.GRAD_RTOL, difference
        assert difference["param"] <= parity.PARAM_ATOL, difference
        assert [log.keys() for log in got["logs"]] == [log.keys() for log in one["logs"]]
        for mine, theirs in zip(got["logs"], one["logs"]):
            assert not {k: (mine[k], v) for k, v in theirs.items() if abs(mine[k] - v) > TOL}, (mine, theirs)


@pytest.mark.slow  # TRL's trainer, four times
@pytest.mark.timeout(300)
def test_trl_sft_at_cp2_in_bf16_is_as_close_to_fp32_as_one_process(tmp_path) -> None:
    """SFTConfig's default bf16 autocast, issue 39's setup unpacked (where the issue saw the first loss 1.5e-4 off):
    CP differs from one process by bf16 rounding, not by a fault of its own. Its losses, gradients and parameters are
    as far from one process's fp32 run as one process's own bf16 run is (measured: 0.3-1x; allowed 1.5x), and both
    bf16 runs are measurably off it (autocast ran)."""
    paths = [str(tmp_path / name) for name in ("fp32", "one", "cp")]
    (fp32,) = run_ranks(_sft_run, 1, paths[0], False, ISSUE_LENGTHS, True)
    (one,) = run_ranks(_sft_run, 1, paths[1], False, ISSUE_LENGTHS, True, True)
    one_off = _sft_difference(one, fp32)
    assert min(one_off.values()) > 1e-5, one_off
    for got in run_ranks(_sft_run, 2, paths[2], False, ISSUE_LENGTHS, True, True):
        off = _sft_difference(got, fp32)
        assert all(off[k] <= 1.5 * one_off[k] for k in off), (off, one_off)
