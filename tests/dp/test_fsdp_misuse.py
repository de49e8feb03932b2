"""torch's own `fully_shard` on a wrapped model is refused at its first use (forward, clip, save or optimizer step),
the mesh refusal recommends `autotp.fully_shard` only, the optimizer-step guard outlives a garbage-collected wrapped
model, and `autotp.fully_shard` on an unwrapped model says to wrap it first."""

from __future__ import annotations

import gc

import pytest
import torch

import autotp
from autotp.testing.parity import full_tensor
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

IDS = batch()


REFUSAL = "Wrap the model again and call autotp.fully_shard(model)"


# torch's own fully_shard: refused at whichever use comes first


def torch_fully_shard_then(rank: int, world: int, first_use: str, path: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = autotp.wrap(tiny_model("llama"), 2)
    fully_shard(model, mesh=autotp.dp_cp_mesh(model))  # the do-it-yourself path the docs used to offer
    before = {n: full_tensor(p, p, None).clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    uses = {
        "forward": lambda: model(input_ids=IDS, labels=IDS),
        "clip": lambda: autotp.clip_grad_norm_(model, 1.0),
        "save": lambda: autotp.save_pretrained(model, path),
        "step": opt.step,
    }
    try:
        uses[first_use]()
    except RuntimeError as err:
        message = str(err)
    else:
        message = "accepted"
    changed = any(not torch.equal(full_tensor(p, p, None), before[n]) for n, p in model.named_parameters())
    return {"message": message, "changed": changed}


@pytest.mark.parametrize("first_use", ["forward", "clip", "save", "step"])
def test_torch_fully_shard_on_a_wrapped_model_is_refused_at_first_use(first_use: str, tmp_path) -> None:
    for report in run_ranks(torch_fully_shard_then, 2, first_use, str(tmp_path)):  # tp=2, dp=1: a one-rank DP mesh
        assert REFUSAL in report["message"] and "LlamaForCausalLM" in report["message"], report
        assert not report["changed"]


@pytest.mark.slow
def test_torch_fully_shard_over_dp_mesh_at_dp2_tp2_is_refused(tmp_path) -> None:
    for first_use in ("forward", "save"):
        for report in run_ranks(torch_fully_shard_then, 4, first_use, str(tmp_path / first_use)):
            assert REFUSAL in report["message"], report
            assert not report["changed"]


def mesh_message(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from autotp.dp.fsdp import check_mesh

    model = autotp.wrap(tiny_model("llama"), 2)
    param = DTensor.from_local(torch.zeros(2), init_device_mesh("cpu", (world,)), [Replicate()])
    with pytest.raises(RuntimeError) as err:
        check_mesh(param, autotp.tp_group(model))
    return str(err.value)


def test_the_mesh_refusal_recommends_autotp_fully_shard_only() -> None:
    for message in run_ranks(mesh_message, 2):
        assert "FSDP over ranks [0, 1]" in message and "autotp.fully_shard(model)" in message, message
        assert "dp_cp_mesh" not in message and "mesh=" not in message, message


# optimizer steps after a wrapped model was garbage-collected


def step_after_collect(rank: int, world: int) -> float:
    model = autotp.wrap(tiny_model("llama"), 2)
    kept = autotp.wrap(tiny_model("llama"), 2)  # its guard runs after the collected model's, in the same step
    del model
    gc.collect()
    unrelated = torch.nn.Parameter(torch.ones(3))
    unrelated.grad = torch.ones(3)
    torch.optim.SGD([unrelated], lr=0.5).step()
    assert autotp.tp_size(kept) == 2
    return unrelated.sum().item()


def test_optimizer_step_after_a_wrapped_model_is_collected() -> None:
    assert run_ranks(step_after_collect, 2) == [1.5, 1.5]


# autotp.fully_shard on a model that was never wrapped


@pytest.mark.timeout(60)
def test_fully_shard_of_an_unwrapped_model_says_to_wrap_it_first() -> None:
    others = [autotp.wrap(tiny_model("llama"), 1)]  # one other wrapped model alive, then two
    for _ in range(2):
        with pytest.raises(RuntimeError) as err:
            autotp.fully_shard(tiny_model("qwen3"))
        assert "Qwen3ForCausalLM is not wrapped by autotp" in str(err.value), err.value
        assert "autotp.wrap(model, tp_size) first" in str(err.value), err.value
        others.append(autotp.wrap(tiny_model("llama"), 1))
