"""`GatherReplacedLayerParams`: full weights inside, the same shards back on exit, still training."""

from __future__ import annotations

import copy

import pytest
import torch

import autotp
from autotp.testing.parity import GRAD_RTOL, LOSS_ATOL, grad_error
from autotp.testing.parity import full_tensor as full
from autotp.testing.spawn import run_ranks
from autotp.tp.layers import LinearAllreduce, LinearLayer
from models import batch, tiny_model


def gather_cycle(rank: int, world: int, family: str) -> dict:
    reference = tiny_model(family)
    model = autotp.wrap(copy.deepcopy(reference), world)
    group = model.autotp_state.tp_group
    ids = batch()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    report = {}
    with autotp.GatherReplacedLayerParams(model):
        layers = [m for m in model.modules() if isinstance(m, (LinearLayer, LinearAllreduce))]
        report["full_shapes"] = all(tuple(m.weight.shape) == (m.full_out, m.full_in) for m in layers)
        report["state_dict_shapes"] = {k: tuple(v.shape) for k, v in model.state_dict().items()} == {
            k: tuple(v.shape) for k, v in reference.state_dict().items()
        }
        with torch.no_grad():
            report["logits_inside"] = (model(ids).logits - reference(ids).logits).abs().max().item()
        # A backward inside: gradients of full weights, sliced back to shards on exit.
        model(ids, labels=ids).loss.backward()
    reference(ids, labels=ids).loss.backward()
    ref_params = dict(reference.named_parameters())
    report["grad_inside"] = max(
        grad_error(full(p.grad, p, group), ref_params[n].grad) for n, p in model.named_parameters()
    )
    report["shards_back"] = all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    model.zero_grad()
    reference.zero_grad()

    # Weights loaded inside the context persist as shards after it.
    other = tiny_model(family, seed=7)
    with autotp.GatherReplacedLayerParams(model):
        model.load_state_dict(other.state_dict())
    report["loaded_kept"] = all(
        torch.equal(full(p, p, group), dict(other.named_parameters())[n].detach()) for n, p in model.named_parameters()
    )
    losses = [m(ids, labels=ids).loss for m in (other, model)]
    for loss in losses:
        loss.backward()
    report["loss_after"] = abs(losses[0].item() - losses[1].item())
    other_params = dict(other.named_parameters())
    report["grad_after"] = max(
        grad_error(full(p.grad, p, group), other_params[n].grad) for n, p in model.named_parameters()
    )
    return report


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_gather_replaced_layer_params(family: str, tp: int) -> None:
    for report in run_ranks(gather_cycle, tp, family):
        assert report["full_shapes"] and report["state_dict_shapes"]
        # Inside, the model runs the very same ops on the very same full weights: exact up to rounding noise.
        assert report["logits_inside"] <= 1e-6, report["logits_inside"]
        assert report["grad_inside"] <= GRAD_RTOL, report["grad_inside"]
        assert report["shards_back"], "shards changed across an enter/exit with no edits"
        assert report["loaded_kept"], "weights loaded inside the context were lost"
        assert report["loss_after"] <= LOSS_ATOL and report["grad_after"] <= GRAD_RTOL, report


def step_inside_gather(rank: int, world: int) -> str:
    model = autotp.wrap(tiny_model("llama"), world)
    opt = torch.optim.AdamW(model.parameters())
    with autotp.GatherReplacedLayerParams(model):
        model(batch(), labels=batch()).loss.backward()
        with pytest.raises(RuntimeError) as err:
            opt.step()
    opt.step()  # outside, with the gradients computed inside: fine
    model(batch(), labels=batch()).loss.backward()
    opt.step()
    return str(err.value)


def test_optimizer_step_inside_gather_is_refused() -> None:
    for message in run_ranks(step_inside_gather, 2):
        assert "inside GatherReplacedLayerParams" in message and "Leave the context first" in message


def standalone_gather(rank: int, world: int) -> dict:
    """A module of standalone layers, built directly (Megatron-style), not by wrap: a column then a row layer."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(8, 6), torch.nn.Linear(6, 8)
    reference = torch.nn.Sequential(copy.deepcopy(first), copy.deepcopy(second))
    group = torch.distributed.group.WORLD
    model = torch.nn.Sequential(
        LinearLayer(first, autotp.Partition.even(0, 6, world), group),
        LinearAllreduce(second, autotp.Partition.even(1, 6, world), group),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    shards = [p.detach().clone() for p in model.parameters()]
    report = {}
    with autotp.GatherReplacedLayerParams(model):
        report["shapes_inside"] = [tuple(p.shape) for p in model.parameters()]
        report["output_inside"] = (model(x) - reference(x)).abs().max().item()
        model(x).sum().backward()
        with pytest.raises(RuntimeError) as err:
            opt.step()
        report["step_refused"] = str(err.value)
    reference(x).sum().backward()
    report["shapes_after"] = [tuple(p.shape) for p in model.parameters()]
    report["shards_back"] = all(torch.equal(a, p.detach()) for a, p in zip(shards, model.parameters()))
    report["grads"] = max(
        grad_error(full(p.grad, p, group), r.grad) for p, r in zip(model.parameters(), reference.parameters())
    )
    return report


def test_gather_replaced_layer_params_gathers_standalone_layers() -> None:
    """Before, the context did nothing on a module holding standalone layers: the weight stayed (3, 8) inside."""
    for report in run_ranks(standalone_gather, 2):
        assert report["shapes_inside"] == [(6, 8), (6,), (8, 6), (8,)], report["shapes_inside"]
        assert report["output_inside"] <= 1e-6, report["output_inside"]  # the same ops on the same full weights
        assert "inside GatherReplacedLayerParams" in report["step_refused"]
        assert report["shapes_after"] == [(3, 8), (3,), (8, 3), (8,)] and report["shards_back"]
        assert report["grads"] <= GRAD_RTOL, report["grads"]  # gradients computed inside, sliced onto the shards
