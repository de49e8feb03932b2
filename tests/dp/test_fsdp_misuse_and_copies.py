"""torch's own `fully_shard` on a wrapped model is refused at its first use; a garbage-collected wrapped model leaves
optimizer steps working; `copy.deepcopy` of a wrapped model is a wrapped model of its own; the DP group is a real
group at dp=1; `autotp.fully_shard` on an unwrapped model says to wrap it first.

Tolerances (fp32, only the order of sums differs between one process and the shards): logits 1e-5, parameters after
one SGD step or a few AdamW steps `PARAM_ATOL` (3e-5). A deep copy and its original run the same shards through the
same operations, so their logits must be bit-identical.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autotp
from autotp.testing.parity import LOSS_ATOL, PARAM_ATOL, full_tensor
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model, train_steps

IDS = batch()
GLOBAL = batch(size=(4, 16))
REFUSAL = "Wrap the model again and call autotp.fully_shard(model)"


# torch's own fully_shard: refused at whichever use comes first


def torch_fully_shard_then(rank: int, world: int, first_use: str, path: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    model = autotp.wrap(tiny_model("llama"), 2)
    fully_shard(model, mesh=autotp.dp_mesh(model))  # the do-it-yourself path the docs used to offer
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
        assert "dp_mesh" not in message and "mesh=" not in message, message


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


# copy.deepcopy of a wrapped model


def one_process_copy_step() -> dict:
    twin = copy.deepcopy(tiny_model("llama", num_key_value_heads=1))
    twin(input_ids=IDS, labels=IDS).loss.backward()
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    with torch.no_grad():
        logits = twin(input_ids=IDS).logits
    return {"params": {n: p.detach().clone() for n, p in twin.named_parameters()}, "logits": logits}


def deep_copied(rank: int, world: int, path: str) -> dict:
    model = autotp.wrap(tiny_model("llama", num_key_value_heads=1), 2)  # replicated KV rows: gradient hooks copied
    with autotp.GatherReplacedLayerParams(model), pytest.raises(RuntimeError, match="deepcopy of a wrapped model"):
        copy.deepcopy(model)  # the copy would hold full weights with nothing to split them again
    twin = copy.deepcopy(model)
    assert autotp.tp_group(twin) is autotp.tp_group(model) and autotp.tp_size(twin) == 2
    with torch.no_grad():
        equal = torch.equal(model(input_ids=IDS).logits, twin(input_ids=IDS).logits)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    twin(input_ids=IDS, labels=IDS).loss.backward()
    torch.optim.SGD(twin.parameters(), lr=0.1).step()
    untouched = all(torch.equal(p, original[n]) and p.grad is None for n, p in model.named_parameters())
    with autotp.GatherReplacedLayerParams(twin):
        gathered = {n: p.detach().clone() for n, p in twin.named_parameters()}
    autotp.save_pretrained(twin, path)
    with torch.no_grad():
        logits = twin(input_ids=IDS).logits
    return {"equal": equal, "untouched": untouched, "gathered": gathered, "logits": logits}


def test_deepcopy_of_a_wrapped_model_is_a_wrapped_model_of_its_own(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    expected = one_process_copy_step()
    reports = run_ranks(deep_copied, 2, str(tmp_path))
    with torch.no_grad():
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)(input_ids=IDS).logits
    assert (loaded - expected["logits"]).abs().max().item() <= 1e-5
    for report in reports:
        assert report["equal"] and report["untouched"]
        worst = max(((report["gathered"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
        assert worst[0] <= PARAM_ATOL, worst
        assert (report["logits"] - loaded).abs().max().item() <= 1e-5


# the DP group at dp=1


def one_process_adamw() -> dict:
    model = tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = train_steps(model, opt, 3, input_ids=GLOBAL, labels=GLOBAL)
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def ddp_at_dp1(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama"), 2)
    mine = torch.tensor([float(rank + 1)])
    dist.all_reduce(mine, group=autotp.dp_group(model))  # over this rank alone, never the world
    runner = DistributedDataParallel(model, process_group=autotp.dp_group())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses = train_steps(runner, opt, 3, input_ids=GLOBAL, labels=GLOBAL)
    group = autotp.tp_group(model)
    return {"reduced": mine.item(), "dp_size": autotp.dp_size(model), "losses": losses,
            "params": {n: full_tensor(p, p, group) for n, p in model.named_parameters()}}


def test_dp_group_is_a_group_of_one_at_dp1_and_ddp_over_it_trains_as_one_process() -> None:
    expected = one_process_adamw()
    for rank, report in enumerate(run_ranks(ddp_at_dp1, 2)):
        assert report["reduced"] == rank + 1 and report["dp_size"] == 1
        assert max(abs(a - b) for a, b in zip(report["losses"], expected["losses"])) <= LOSS_ATOL, report["losses"]
        worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
        assert worst[0] <= PARAM_ATOL, worst


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


def copy_one_layer(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("qwen2"), world)
    out = {}
    for path in ("lm_head", "model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        memo: dict = {}
        layer = copy.deepcopy(model.get_submodule(path), memo)
        out[path] = {"model copied": id(model) in memo, "shard kept": hasattr(layer.weight, "autotp_shard"),
                     "forward": layer(torch.ones(2, layer.in_features)).shape[0] == 2}
    return out


def test_deepcopy_of_one_sharded_layer_copies_the_layer_not_the_model() -> None:
    """PEFT's modules_to_save deep-copies one layer: the copy shares the model's state and never reaches the model
    itself (before, the state-dict hooks' module set and the mesh guard dragged the whole model into the copy, and a
    row layer's copy could fail with `instance must not be None`)."""
    for report in run_ranks(copy_one_layer, 2):
        assert all(not r["model copied"] and r["shard kept"] and r["forward"] for r in report.values()), report
