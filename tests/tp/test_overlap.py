"""Overlap (wrap's default): a column layer's backward hands dL/dX on at once and its weight gradient is computed
while the input gradient's all-reduce runs, which is started asynchronously and waited for after. The results are
the ones without overlap (fp32 tolerances of test_parity), and the collective count is unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.runtime import seq_collectives
from autotp.testing.parity import GRAD_RTOL, LOSS_ATOL, full_tensor, grad_error
from autotp.testing.spawn import run_ranks
from autotp.tp.overlap import DeferredWeights
from models import batch, tiny_model


class _Waited:
    """An async collective's handle that records when it is waited for."""

    def __init__(self, work, events: list) -> None:
        self.work, self.events = work, events

    def wait(self, *args, **kwargs):
        self.events.append("wait")
        return self.work.wait(*args, **kwargs)


def backward_events(rank: int, world: int, family: str, overlap: bool, bf16: bool = False) -> dict:
    torch.manual_seed(0)
    model = autotp.wrap(tiny_model(family), world, overlap=overlap)
    ids = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, labels=ids).loss
    events: list = []
    original_reduce, original_grads = dist.all_reduce, DeferredWeights.grads

    def reduce(tensor, *args, async_op=False, **kwargs):
        events.append("all_reduce async" if async_op else "all_reduce")
        work = original_reduce(tensor, *args, async_op=async_op, **kwargs)
        return _Waited(work, events) if async_op else work

    def grads(self):
        events.append("weight gradients")
        return original_grads(self)

    dist.all_reduce, DeferredWeights.grads = reduce, grads
    try:
        loss.backward()
    finally:
        dist.all_reduce, DeferredWeights.grads = original_reduce, original_grads
    group = autotp.tp_group(model)
    return {
        "events": events,
        "loss": loss.item(),
        "grads": {n: full_tensor(p.grad, p, group) for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # gpt2: Conv1D weights stored [in, out]
def test_weight_gradients_are_computed_while_the_input_gradient_all_reduce_runs(family: str) -> None:
    on, off = run_ranks(backward_events, 2, family, True)[0], run_ranks(backward_events, 2, family, False)[0]
    assert abs(on["loss"] - off["loss"]) <= LOSS_ATOL
    worst = max((grad_error(on["grads"][n], g), n) for n, g in off["grads"].items())
    assert worst[0] <= GRAD_RTOL, worst
    # every block entry: started, weight gradients meanwhile, then waited; as many all-reduces as without overlap
    assert on["events"].count("all_reduce async") == on["events"].count("weight gradients") > 0, on["events"]
    for i, event in enumerate(on["events"]):
        if event == "all_reduce async":
            assert on["events"][i + 1 : i + 3] == ["weight gradients", "wait"], on["events"]
    assert len([e for e in on["events"] if e.startswith("all_reduce")]) == off["events"].count("all_reduce")
    assert "all_reduce async" not in off["events"]


def test_overlap_under_bf16_autocast_matches_no_overlap() -> None:
    """The deferred matmul casts as autocast would, so backward sees bf16 on both sides; gradients stay fp32."""
    on, off = (
        run_ranks(backward_events, 2, "llama", True, True)[0],
        run_ranks(backward_events, 2, "llama", False, True)[0],
    )
    assert on["loss"] == off["loss"]  # the same bf16 forward
    assert all(g.dtype == torch.float32 for g in on["grads"].values())
    worst = max((grad_error(on["grads"][n], g), n) for n, g in off["grads"].items())
    assert worst[0] <= 1e-2, worst  # bf16 sums in another order: a few bf16 ulps


def sequence_gathers(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    model = autotp.wrap(tiny_model("llama"), world, sequence_parallel=True)
    ids = batch()
    loss = model(input_ids=ids, labels=ids).loss
    started: list[bool] = []
    original = seq_collectives.start_all_gather

    def recording(x, group, dim=0, async_op=False, of=""):
        started.append(async_op)
        return original(x, group, dim, async_op, of)

    seq_collectives.start_all_gather = recording
    try:
        loss.backward()
    finally:
        seq_collectives.start_all_gather = original
    return {"started": started, "layers": model.config.num_hidden_layers}


def test_sequence_parallel_block_inputs_are_gathered_again_during_the_block_backward() -> None:
    """Each block's row layer, first in its backward, starts the all-gather its column layers need last: 2 per
    layer, asynchronous; the other backward gathers (the row outputs' gradients, the first layer's entry) are not."""
    for report in run_ranks(sequence_gathers, 2):
        layers = report["layers"]
        assert report["started"].count(True) == 2 * layers, report
        assert report["started"].count(False) == 2 * layers + 1, report
