"""`wrap` is a transaction: failing at any stage (an exception injected into each in turn) leaves the model exactly
as it was: modules, hooks, attributes, tensors, and the loss it computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import run_ranks, tiny_config
from models import CONFIGS, batch, tiny_model

STAGES = [
    "autotp.tp.apply.LinearAllreduce.__init__",
    "autotp.sp.dimension.apply_sequence_parallel",
    "autotp.tp.dimension.register_grad_hooks",
    "autotp.parallelize.DDPGuard",
    "autotp.parallelize.broadcast_replicated",
]


def snapshot(model: nn.Module) -> dict:
    return {
        "modules": [
            (n, type(m).__name__, len(m._forward_hooks), len(m._forward_pre_hooks)) for n, m in model.named_modules()
        ],
        "attrs": [(n, sorted(k for k in vars(m) if not k.startswith("_"))) for n, m in model.named_modules()],
        "heads": [
            (n, getattr(m, "num_key_value_groups", None), getattr(m, "config", None) is model.config)
            for n, m in model.named_modules()
        ],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "own": sorted(vars(model)),
    }


def failing_wrap(rank: int, world: int, stage: str, family: str = "qwen3", options: dict | None = None) -> dict:
    import importlib

    model = tiny_model(family) if family in CONFIGS else AutoModelForCausalLM.from_config(tiny_config(family))
    before = snapshot(model)
    ids = batch()
    loss_before = model(ids, labels=ids).loss.item()
    module_name, _, attr = stage.rpartition(".")
    owner = importlib.import_module(module_name) if not attr.startswith("__") else None
    if owner is None:  # a method: fail on the second row layer, after the first was swapped in
        import autotp.tp.apply as target

        cls = target.LinearAllreduce
        calls = {"n": 0}
        original = cls.__init__

        def broken(self, *args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("injected")
            original(self, *args, **kwargs)

        cls.__init__ = broken
    else:

        def broken(*args, **kwargs):
            raise RuntimeError("injected")

        setattr(owner, attr, broken)
    with pytest.raises(RuntimeError, match="injected"):
        options = dict(options or {"tp": world, "sequence_parallel": True})
        autotp.wrap(model, options.pop("tp"), **options)
    after = snapshot(model)
    same_tensors = all(torch.equal(before["state"][k], v) for k, v in after["state"].items())
    return {
        "same": {k: before[k] == after[k] for k in ("modules", "attrs", "heads", "own")},
        "tensors": same_tensors and before["state"].keys() == after["state"].keys(),
        "loss": model(ids, labels=ids).loss.item() - loss_before,
        "wrapped": hasattr(model, "autotp_state"),
    }


@pytest.mark.parametrize("stage", STAGES)
def test_wrap_failing_at_any_stage_leaves_the_model_as_it_was(stage: str) -> None:
    for report in run_ranks(failing_wrap, 2, stage):
        assert all(report["same"].values()), report["same"]
        assert report["tensors"] and report["loss"] == 0.0 and not report["wrapped"]


@pytest.mark.parametrize("stage", ["autotp.tp.dimension.register_grad_hooks", "autotp.ep.dimension.broadcast_experts"])
def test_wrap_at_ep2_failing_after_the_experts_are_split_leaves_the_model_as_it_was(stage: str) -> None:
    """The expert step replaces each experts module's parameters and forward: undone too (tp 1, ep 2)."""
    for report in run_ranks(failing_wrap, 2, stage, "qwen3_moe", {"tp": 1, "ep_size": 2}):
        assert all(report["same"].values()), report["same"]
        assert report["tensors"] and report["loss"] == 0.0 and not report["wrapped"]
