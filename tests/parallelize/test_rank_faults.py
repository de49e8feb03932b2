"""Ranks that disagree or fail: replicated tensors that drift between TP ranks are named, a failed peer stops the
others within the timeout, and tp=1 on a subset of the ranks needs no collective."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import autotp
from autotp.testing import run_ranks
from models import batch, tiny_model


def unseeded_ranks(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama", seed=rank), world, check_inputs=True)  # no common seed
    reference = tiny_model("llama", seed=0)
    norm = model.model.norm.weight
    out = {"equal_to_rank0": torch.equal(norm, reference.model.norm.weight)}
    autotp.check_replicas(model)  # passes: wrap made them equal
    if rank == 1:
        with torch.no_grad():
            model.model.layers[0].input_layernorm.weight.add_(1e-3)  # drift on one rank
    with pytest.raises(RuntimeError) as err:
        autotp.check_replicas(model)
    out["error"] = str(err.value)
    with pytest.raises(RuntimeError) as err:
        model(batch(), labels=batch())  # check_inputs=True checks replicas on the first training forward
    out["forward_error"] = str(err.value)
    return out


def test_replicated_parameters_are_broadcast_and_drift_is_named() -> None:
    for report in run_ranks(unseeded_ranks, 2):
        assert report["equal_to_rank0"]
        for message in (report["error"], report["forward_error"]):
            assert "replicated tensor model.layers.0.input_layernorm.weight (64,) differs between TP ranks" in message


def peer_fails(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama"), world, timeout=3)
    default = autotp.wrap(tiny_model("llama"), world).autotp_state.timeout
    if rank == 1:
        try:
            raise ValueError("a bug in rank 1's data loader")
        except ValueError:
            time.sleep(12)  # still alive, never joining the step
            return {}
    start = time.monotonic()
    with pytest.raises(RuntimeError) as err:
        model(batch(), labels=batch()).loss.backward()
    return {"seconds": time.monotonic() - start, "error": str(err.value), "default": default.total_seconds()}


@pytest.mark.slow  # waits out the timeout; test_io_faults.py's bounded failures stay quick
@pytest.mark.timeout(120)
def test_a_failed_peer_stops_the_others_within_the_timeout() -> None:
    report = run_ranks(peer_fails, 2)[0]
    assert report["seconds"] < 10, report
    assert "over ranks [0, 1]" in report["error"]
    assert report["default"] == 60  # the timeout the ranks' init_process_group was given (autotp.testing.spawn)


def only_rank0_wraps(rank: int, world: int, path: str) -> float | None:
    if rank != 0:
        return None
    model = autotp.wrap(tiny_model("llama"), 1)
    loaded = autotp.from_pretrained(path, 1).train()  # as the built model (transformers loads in eval mode)
    ids = batch()
    return (model(ids, labels=ids).loss - loaded(ids, labels=ids).loss).abs().item()


@pytest.mark.timeout(60)
def test_tp1_on_a_subset_of_ranks_needs_no_collective(tmp_path: Path) -> None:
    tiny_model("llama").save_pretrained(tmp_path)
    assert run_ranks(only_rank0_wraps, 2, str(tmp_path))[0] == 0.0


def clip_after_backward(model: torch.nn.Module) -> None:
    ids = batch()
    model(ids, labels=ids).loss.backward()


SKIPPED = {  # a user call -> (the tp size to wrap at, what to do on both ranks first, the call one rank skips)
    "clip_grad_norm_": (2, {}, clip_after_backward, lambda model: autotp.clip_grad_norm_(model, 1.0)),
    "allreduce_gradients": (1, {}, clip_after_backward, autotp.allreduce_gradients),
    "resize_token_embeddings": (
        2,
        {"vocab_parallel": False},
        lambda model: None,
        lambda model: model.resize_token_embeddings(300),
    ),
}


def one_rank_skips(rank: int, world: int, call: str) -> str | None:
    tp, options, before, skipped = SKIPPED[call]
    model = autotp.wrap(tiny_model("llama"), tp, timeout=5, **options)
    before(model)
    if rank == 1:
        return None  # leaves: its process group closes under rank 0's collective
    with pytest.raises(RuntimeError) as err:
        skipped(model)
    return str(err.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "call, operation",
    [
        ("clip_grad_norm_", "autotp.clip_grad_norm_'s all-reduce of the gradient norm over TP over ranks [0, 1]"),
        ("allreduce_gradients", "autotp.allreduce_gradients' all-reduce of the gradients over ranks [0, 1]"),
        ("resize_token_embeddings", "broadcast of the replicated tensors from the group's rank 0 over ranks [0, 1]"),
    ],
)
def test_a_rank_that_skips_a_collective_is_named_with_the_operation(call: str, operation: str) -> None:
    message = run_ranks(one_rank_skips, 2, call)[0]
    assert message.startswith(f"autotp: {operation} failed"), message
    assert "a rank of that group failed, hung or never called it" in message
