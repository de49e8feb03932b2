"""The standalone layers, built directly as Megatron- and DeepSpeed-style layer code builds them (not by wrap): overlap
turned off by a public option, and the full weight and gradient of a shard gathered by a public call, each against
one process."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import autotp
from autotp.testing.parity import GRAD_RTOL
from autotp.testing.spawn import run_ranks


def column_then_row(rank: int, world: int) -> dict:
    """A column then a row layer (an MLP), every overlap setting, against the same MLP in one process."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 6), nn.Linear(6, 8)
    reference = nn.Sequential(copy.deepcopy(first), nn.GELU(), copy.deepcopy(second))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    reference(x).square().sum().backward()
    group = dist.group.WORLD
    column = {
        "default": lambda: autotp.LinearLayer(copy.deepcopy(first), autotp.Partition.even(0, 6, world), group),
        "off": lambda: autotp.LinearLayer(
            copy.deepcopy(first), autotp.Partition.even(0, 6, world), group, overlap=False
        ),
    }
    report = {}
    for name, build in [*column.items(), ("off by setter", column["default"])]:
        layer = build()
        if name == "off by setter":
            layer.overlap = False
        row = autotp.LinearAllreduce(copy.deepcopy(second), autotp.Partition.even(1, 6, world), group)
        hidden = layer(x)
        y = row(nn.functional.gelu(hidden))
        y.square().sum().backward()
        grads = {
            f"column {n}": (layer.full_tensor(n, grad=True), p.grad)
            for n, p in zip(("weight", "bias"), reference[0].parameters())
        }
        grads |= {
            f"row {n}": (row.full_tensor(n, grad=True), p.grad)
            for n, p in zip(("weight", "bias"), reference[2].parameters())
        }
        report[name] = {
            "overlap": layer.overlap,
            "node": type(hidden.grad_fn).__name__,  # the deferred matmul's node only under overlap
            "output": (y - reference(x)).abs().max().item(),
            "weights": all(
                torch.equal(layer.full_tensor(n), p.detach())
                for n, p in zip(("weight", "bias"), reference[0].parameters())
            ),
            "grads": {k: ((got - want).abs().max() / want.abs().max()).item() for k, (got, want) in grads.items()},
            "shard": tuple(layer.weight.shape),
        }
    layer.gather_()
    report["gathered"] = (
        layer.is_gathered(),
        tuple(layer.weight.shape),
        torch.equal(layer.full_tensor("weight"), reference[0].weight.detach()),
    )
    layer.partition_()
    report["partitioned"] = (layer.is_gathered(), tuple(layer.weight.shape))
    return report


def test_standalone_layers_turn_overlap_off_and_gather_full_weights_and_grads() -> None:
    """Before, overlap could be turned off only through an entry built by hand (BlockEntry, not exported), and the
    full weight or gradient of a shard only through testing helpers."""
    for report in run_ranks(column_then_row, 2):
        assert report.pop("gathered") == (True, (6, 8), True) and report.pop("partitioned") == (False, (3, 8))
        assert report["default"]["overlap"] and report["default"]["node"] == "_DeferredColumnLinearBackward"
        for name in "off", "off by setter":
            assert not report[name]["overlap"] and report[name]["node"] != "_DeferredColumnLinearBackward", report
        for name, got in report.items():
            assert got["shard"] == (3, 8) and got["weights"], (name, got)
            assert got["output"] <= 1e-6, (name, got)  # fp32: reduction order only
            assert max(got["grads"].values()) <= GRAD_RTOL, (name, got["grads"])


def test_overlap_and_an_entry_that_disagree_are_refused_and_full_tensor_copies_at_tp1() -> None:
    entry = autotp.tp.block_entry.BlockEntry(None, overlap=True)
    with pytest.raises(ValueError, match="overlap=False but the entry given has overlap=True"):
        autotp.LinearLayer(nn.Linear(4, 6), autotp.Partition.even(0, 6, 1), None, entry=entry, overlap=False)
    layer = autotp.LinearLayer(nn.Linear(4, 6), autotp.Partition.even(0, 6, 1), None)
    with pytest.raises(ValueError, match="full_tensor takes 'weight' or 'bias'"):
        layer.full_tensor("other")
    full = layer.full_tensor("weight")  # tp 1: a copy, never the parameter's own storage
    assert torch.equal(full, layer.weight) and full.data_ptr() != layer.weight.data_ptr()
    assert layer.full_tensor("weight", grad=True) is None  # no backward yet
