"""dp=2 x tp=2 on 4 CPU ranks equals one process on the whole batch; the DDP-over-world mistake is refused; DP
replicas are broadcast at wrap and their drift is named; at dp=1 the DP group is a group of one.

Tolerances as in test_parity (fp32, only the order of sums differs): loss 1e-5, parameters after
3 AdamW steps 3e-5, gradient norms 1e-5 relative.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import autotp
from autotp.testing.parity import LOSS_ATOL, PARAM_ATOL, full_tensor
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model, train_steps

GLOBAL = batch(size=(4, 16))
CLIP = 0.5


def optimizer_for(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)


def single_process(clip: bool) -> dict:
    model = tiny_model("llama")
    opt = optimizer_for(model)
    losses, norms = [], []
    for _ in range(3):
        loss = model(input_ids=GLOBAL, labels=GLOBAL).loss
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def dp_tp_rank(rank: int, world: int, mode: str) -> dict:
    model = autotp.wrap(tiny_model("llama"), 2)
    assert autotp.tp_size() == 2 and autotp.dp_size() == 2 and autotp.dp_rank() == rank // 2
    runner = DistributedDataParallel(model, process_group=autotp.dp_group()) if mode == "ddp" else model
    opt = optimizer_for(model)
    mine = GLOBAL[2 * autotp.dp_rank() : 2 * autotp.dp_rank() + 2]  # this replica's half of the global batch
    losses, norms = [], []
    for _ in range(3):
        if mode == "accumulate":  # 2 micro-batches of one sequence, gradients synced once
            loss = 0.0
            for micro in (mine[:1], mine[1:]):
                part = runner(input_ids=micro, labels=micro).loss / 2
                part.backward()
                loss = loss + part.detach()
        else:
            loss = runner(input_ids=mine, labels=mine).loss
            loss.backward()
        if mode != "ddp":
            autotp.allreduce_gradients(model)
        if mode == "clip":
            norms.append(autotp.clip_grad_norm_(model, CLIP).item())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=autotp.dp_group())
        losses.append(mean.item() / 2)
    group = autotp.tp_group()
    return {
        "losses": losses,
        "norms": norms,
        "params": {n: full_tensor(p, p, group) for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("mode", ["ddp", "accumulate", "clip"])
def test_dp2_tp2_equals_single_process(mode: str) -> None:
    expected = single_process(clip=mode == "clip")
    if mode == "clip":
        assert expected["norms"][0] > CLIP, "clipping must be active for this test to mean anything"
    for report in run_ranks(dp_tp_rank, 4, mode):
        assert max(abs(a - b) for a, b in zip(report["losses"], expected["losses"])) <= LOSS_ATOL
        for a, b in zip(report["norms"], expected["norms"]):
            assert abs(a - b) <= 1e-5 * b, (report["norms"], expected["norms"])
        worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
        assert worst[0] <= PARAM_ATOL, worst


def ddp_over_world(rank: int, world: int) -> str:
    model = autotp.wrap(tiny_model("llama"), 2)
    with pytest.raises(RuntimeError) as err:
        DistributedDataParallel(model)  # the whole world: ranks 0 and 1 hold different shards
    return str(err.value)


def test_ddp_over_the_world_is_refused() -> None:
    for message in run_ranks(ddp_over_world, 4):
        assert "would average different tensor-parallel shards" in message
        assert "process_group=autotp.dp_group(model)" in message


def different_batches(rank: int, world: int) -> str:
    model = autotp.wrap(tiny_model("llama"), 2, check_inputs=True)
    ids = batch(seed=rank)  # the bug: each TP rank reads its own batch
    with pytest.raises(RuntimeError) as err:
        model(input_ids=ids, labels=ids)
    same = batch()
    model(input_ids=same, labels=same)  # identical inputs pass
    return str(err.value)


def test_input_check_names_the_tensor() -> None:
    for message in run_ranks(different_batches, 2):
        assert "tensor-parallel ranks got different inputs: input_ids=" in message


def sampler_parts(rank: int, world: int) -> list[int]:
    autotp.wrap(tiny_model("llama"), 2)
    return list(autotp.data_parallel_sampler(list(range(8)), shuffle=False))


def test_sampler_splits_over_data_parallel_ranks_only() -> None:
    parts = run_ranks(sampler_parts, 4)
    assert parts[0] == parts[1] and parts[2] == parts[3]  # TP ranks of a replica read the same samples
    assert sorted(parts[0] + parts[2]) == list(range(8))  # the replicas split the data


def global_batches(rank: int, world: int, tp: int, per_replica: int, consumed: int, steps: int) -> list[list[int]]:
    """The samples of each global batch this replica reads, from `consumed` global samples on (shuffled order)."""
    model = autotp.wrap(tiny_model("llama"), tp)
    sampler = autotp.data_parallel_sampler(list(range(50)), model, seed=3, consumed_samples=consumed)
    mine = list(sampler)
    batches = [mine[i * per_replica : (i + 1) * per_replica] for i in range(steps)]
    everyone = [None] * world
    dist.all_gather_object(everyone, batches)
    return [sorted(sum((everyone[r][step] for r in range(0, world, tp)), [])) for step in range(steps)]


def test_sampler_resumes_at_another_dp_size_on_the_same_global_samples() -> None:
    """dp=2 x tp=2 reads 3 global batches of 4 (2 per replica); resumed at tp=2 x dp=1 (4 per replica) and at
    tp=1 x dp=2 after 12 consumed samples, every later global batch holds the samples of the uninterrupted run."""
    whole = run_ranks(global_batches, 4, 2, 2, 0, 6)[0]
    assert all(len(set(b)) == 4 for b in whole) and len({s for b in whole for s in b}) == 24
    assert run_ranks(global_batches, 2, 2, 4, 12, 3)[0] == whole[3:]
    assert run_ranks(global_batches, 2, 1, 2, 12, 3)[0] == whole[3:]


def uneven_resume(rank: int, world: int) -> str:
    model = autotp.wrap(tiny_model("llama"), 1)
    with pytest.raises(ValueError) as err:
        autotp.data_parallel_sampler(list(range(50)), model, consumed_samples=7)
    return str(err.value)


def test_sampler_refuses_a_position_the_replicas_cannot_share() -> None:
    for message in run_ranks(uneven_resume, 2):
        assert "consumed_samples=7 is not a multiple of the 2 data-parallel replicas" in message, message


def norm_with_replicated_kv(rank: int, world: int) -> tuple[float, float]:
    reference = tiny_model("llama", num_key_value_heads=1)
    model = autotp.wrap(copy.deepcopy(reference), world)  # the one KV head is held by every rank
    for m in (reference, model):
        m(input_ids=GLOBAL, labels=GLOBAL).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    return autotp.clip_grad_norm_(model, 1e9).item(), expected


def test_grad_norm_counts_replicated_rows_once() -> None:
    for got, expected in run_ranks(norm_with_replicated_kv, 4):
        assert abs(got - expected) <= 1e-5 * expected


def user_tp_group(rank: int, world: int) -> dict:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # the user's own TP groups
    model = autotp.wrap(tiny_model("llama"), 2, tp_group=groups[rank // 2])
    dp = autotp.dp_group(model)
    return {"tp": dist.get_process_group_ranks(autotp.tp_group(model)), "dp": dist.get_process_group_ranks(dp)}


def test_user_supplied_tp_group_gets_matching_dp_groups() -> None:
    for rank, groups in enumerate(run_ranks(user_tp_group, 4)):
        assert groups["tp"] == ([0, 1] if rank < 2 else [2, 3])
        assert groups["dp"] == [rank % 2, rank % 2 + 2]


def two_wrapped_models(rank: int, world: int) -> dict:
    policy = autotp.wrap(tiny_model("llama"), 2)
    reference = autotp.wrap(tiny_model("llama", seed=3), 2)  # an RL script's reference model
    out = {"mine": dist.get_process_group_ranks(autotp.tp_group(reference))}
    with pytest.raises(RuntimeError) as err:
        autotp.tp_group()  # which one? refused rather than guessed
    out["error"] = str(err.value)
    del reference
    out["after_del"] = autotp.tp_size() == 2 and autotp.tp_group() is autotp.tp_group(policy)
    return out


def test_helpers_without_a_model_refuse_when_two_wrapped_models_are_alive() -> None:
    for report in run_ranks(two_wrapped_models, 2):
        assert report["mine"] == [0, 1]
        assert "2 models wrapped by autotp are alive" in report["error"] and "pass the model" in report["error"]
        assert report["after_del"]


def ddp_over_world_found_at_forward(rank: int, world: int) -> str:
    """If a future torch hides DDP's group from the constructor, the guard still stops the first forward."""
    import autotp.integrations.guards

    model = autotp.wrap(tiny_model("llama"), 2)
    autotp.integrations.guards._ddp_under_construction = lambda: None
    runner = DistributedDataParallel(model)
    with pytest.raises(RuntimeError) as err:
        runner(input_ids=batch(), labels=batch())
    return str(err.value)


def test_ddp_over_the_world_is_refused_at_first_forward_when_construction_cannot_tell() -> None:
    for message in run_ranks(ddp_over_world_found_at_forward, 4):
        assert "would average different tensor-parallel shards" in message


def dp_replicas(rank: int, world: int) -> dict:
    model = autotp.wrap(tiny_model("llama", seed=rank), 2)  # no common seed: every rank starts apart
    tensors = [t.detach() for t in [*model.parameters(), *model.buffers()]]
    theirs: list = [None] * autotp.dp_size()
    dist.all_gather_object(theirs, tensors, group=autotp.dp_group())
    equal = all(torch.equal(a, b) for a, b in zip(theirs[0], theirs[1]))
    autotp.check_replicas(model)  # passes: wrap made them equal
    if rank == 3:
        with torch.no_grad():
            model.model.layers[0].self_attn.q_proj.weight.add_(1e-3)  # a shard drifts on one DP replica
    try:
        autotp.check_replicas(model)
        error = None
    except RuntimeError as err:
        error = str(err)
    return {"equal": equal, "error": error}


@pytest.mark.slow
def test_dp_replicas_are_broadcast_at_wrap_and_their_drift_is_named() -> None:
    reports = run_ranks(dp_replicas, 4)
    assert all(report["equal"] for report in reports), reports
    assert reports[0]["error"] is None and reports[2]["error"] is None  # DP group {0, 2} still agrees
    for report in reports[1], reports[3]:
        assert "model.layers.0.self_attn.q_proj.weight (32, 64) differs between DP ranks 1 and 3" in report["error"]


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
    return {
        "reduced": mine.item(),
        "dp_size": autotp.dp_size(model),
        "losses": losses,
        "params": {n: full_tensor(p, p, group) for n, p in model.named_parameters()},
    }


def test_dp_group_is_a_group_of_one_at_dp1_and_ddp_over_it_trains_as_one_process() -> None:
    expected = one_process_adamw()
    for rank, report in enumerate(run_ranks(ddp_at_dp1, 2)):
        assert report["reduced"] == rank + 1 and report["dp_size"] == 1
        assert max(abs(a - b) for a, b in zip(report["losses"], expected["losses"])) <= LOSS_ATOL, report["losses"]
        worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
        assert worst[0] <= PARAM_ATOL, worst
