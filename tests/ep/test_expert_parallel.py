"""Expert parallelism (`ep_size`) against one process: the README's DP loop on each rank, the whole batch in one.

Tolerances (fp32) as in test_parity: EP moves whole tokens and runs whole experts, so only the order of sums changes
(the experts' matmuls on other row counts, the slot sums in another association). Loss 1e-5 absolute; gradients
after the sync 1e-5 of the tensor's largest reference entry (floored at 1e-3, `grad_error`); parameters after 3
AdamW steps 3e-5 absolute. Routing ties: the tests do not avoid them by construction; they check instead that every
MoE layer's top-k indices equal one process's on every step, so a flipped near-tie would fail by name.
Controls: expert gradients averaged over the DP group as plain data parallelism would (different experts mixed), and
summed without the division by the replicas (a spurious factor of dp), each fail those tolerances.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import run_ranks, tiny_config
from autotp.testing.parity import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL, full_tensor, grad_error
from models import batch, tiny_model

FAMILIES = ["qwen3_moe", "mixtral", "olmoe"]
GLOBAL = batch(size=(4, 16))
STEPS = 3
CLIP = 0.5
pytestmark = pytest.mark.timeout(240)


def moe_model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(family), dtype=torch.float32)


def record_routing(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every experts call's top-k indices, in call order (the model's own router picks them)."""
    seen: list[torch.Tensor] = []
    for name, module in model.named_modules():
        if name.endswith("mlp.experts"):
            module.register_forward_pre_hook(lambda m, args: seen.append(args[1].detach().clone()))
    return seen


def single_process(family: str, clip: bool = False) -> dict:
    model = moe_model(family)
    routing = record_routing(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, grads, norms = [], {}, []
    for step in range(STEPS):
        loss = model(input_ids=GLOBAL, labels=GLOBAL).loss
        loss.backward()
        if clip:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    experts = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    return {"losses": losses, "grads": grads, "routing": routing, "expert_bytes": experts, "norms": norms,
            "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def whole(tensor: torch.Tensor, param: torch.nn.Parameter, model: torch.nn.Module) -> torch.Tensor:
    """The full tensor behind this rank's part: experts all-gathered over EP, TP shards over TP."""
    if hasattr(param, "autotp_expert"):
        parts = [torch.empty_like(tensor) for _ in range(autotp.ep_size(model))]
        dist.all_gather(parts, tensor.detach().contiguous(), group=autotp.ep_group(model))
        return torch.cat(parts)
    return full_tensor(tensor, param, autotp.tp_group(model))


def wrong_sync(model: torch.nn.Module, mode: str) -> None:
    """The controls: expert gradients averaged over DP like dense ones, or summed but never divided."""
    if mode == "dp_average":
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=autotp.dp_group(model))
                p.grad /= autotp.dp_size(model)
        return
    autotp.allreduce_gradients(model)
    for p in model.parameters():
        if hasattr(p, "autotp_expert"):
            p.grad *= autotp.dp_size(model)


def ep_rank_run(rank: int, world: int, family: str, tp: int, ep: int, mode: str = "right") -> dict:
    """The README's DP loop at tp x ep: this replica's rows of the global batch, gradients synced, AdamW."""
    model = autotp.wrap(moe_model(family), tp, ep_size=ep)
    assert autotp.ep_size(model) == ep and autotp.ep_rank(model) == rank % ep
    routing = record_routing(model)
    replicas = autotp.dp_size(model)
    rows = GLOBAL.shape[0] // replicas
    mine = GLOBAL[autotp.dp_rank(model) * rows:(autotp.dp_rank(model) + 1) * rows]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, grads, norms = [], {}, []
    for step in range(STEPS):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        autotp.allreduce_gradients(model) if mode in ("right", "clip") else wrong_sync(model, mode)
        if mode == "clip":
            norms.append(autotp.clip_grad_norm_(model, CLIP).item())
        if step == 0:
            grads = {n: whole(p.grad, p, model) for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=autotp.dp_group(model))
        losses.append(mean.item() / replicas)
    experts = sum(p.numel() * p.element_size() for p in model.parameters() if hasattr(p, "autotp_expert"))
    return {"losses": losses, "grads": grads, "routing": routing, "rows": (autotp.dp_rank(model) * rows, rows),
            "expert_bytes": experts, "norms": norms, "params": {n: whole(p, p, model) for n, p in model.named_parameters()}}


def check(report: dict, expected: dict) -> None:
    """Parity with one process, the routing included; raises AssertionError naming the worst tensor."""
    first, rows = report["rows"]
    seq = GLOBAL.shape[1]
    for ours, theirs in zip(report["routing"], expected["routing"]):
        assert torch.equal(ours, theirs[first * seq:(first + rows) * seq]), "top-k differs from one process's"
    loss = max(abs(a - b) for a, b in zip(report["losses"], expected["losses"]))
    assert loss <= LOSS_ATOL, f"loss differs by {loss:.3g}"
    worst = max((grad_error(report["grads"][n], g), n) for n, g in expected["grads"].items())
    assert worst[0] <= GRAD_RTOL, f"gradient of {worst[1]} differs by {worst[0]:.3g}"
    worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
    assert worst[0] <= PARAM_ATOL, f"{worst[1]} differs by {worst[0]:.3g} after AdamW steps"


@pytest.mark.parametrize("family", FAMILIES)
def test_ep2_on_two_ranks_equals_one_process(family: str) -> None:
    expected = single_process(family)
    for report in run_ranks(ep_rank_run, 2, family, 1, 2):
        check(report, expected)
        assert report["expert_bytes"] * 2 == expected["expert_bytes"]  # each rank holds half the experts


def test_clipping_at_ep2_uses_the_whole_models_norm() -> None:
    """Each EP rank's experts count once in the norm (gradient norms: 1e-5 relative, as in test_data_parallel)."""
    expected = single_process("qwen3_moe", clip=True)
    assert expected["norms"][0] > CLIP, "clipping must be active for this test to mean anything"
    for report in run_ranks(ep_rank_run, 2, "qwen3_moe", 1, 2, "clip"):
        check(report, expected)
        for ours, theirs in zip(report["norms"], expected["norms"]):
            assert abs(ours - theirs) <= 1e-5 * theirs, (report["norms"], expected["norms"])


@pytest.mark.parametrize("mode", ["dp_average", "no_division"])
def test_a_wrong_expert_gradient_sync_fails_the_tolerance(mode: str) -> None:
    expected = single_process("qwen3_moe")
    for report in run_ranks(ep_rank_run, 2, "qwen3_moe", 1, 2, mode):
        with pytest.raises(AssertionError, match="differs"):  # the loss, a gradient or the routing
            check(report, expected)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2), (1, 4)], ids=["dp4-ep2", "tp2-ep2", "dp4-ep4"])
def test_four_ranks_equal_one_process(tp: int, ep: int) -> None:
    """ep 2 at tp 1 sums the experts over an expert-DP group of 2; at tp 2 the TP ranks split the tokens."""
    expected = single_process("qwen3_moe")
    for report in run_ranks(ep_rank_run, 4, "qwen3_moe", tp, ep):
        check(report, expected)
        assert report["expert_bytes"] * ep == expected["expert_bytes"]


def test_refused_before_any_group() -> None:
    with pytest.raises(ValueError, match="ep_size=3 does not divide the 4 experts"):
        autotp.explain(moe_model("qwen3_moe"), 1, ep_size=3)
    with pytest.raises(ValueError, match="no routed experts autotp can find"):
        autotp.explain(tiny_model("llama"), 1, ep_size=2)
    with pytest.raises(NotImplementedError, match="ep_size=2 with cp_size=2"):
        autotp.explain(moe_model("qwen3_moe"), 1, ep_size=2, cp_size=2)


def refusals_at_ep2(rank: int, world: int, tmp: str) -> list[str]:
    messages = []
    try:
        autotp.wrap(moe_model("qwen3_moe"), 1, ep_size=4)
    except ValueError as err:
        messages.append(str(err))
    model = autotp.wrap(moe_model("qwen3_moe"), 1, ep_size=2)
    for attempt in (lambda: autotp.fully_shard(model),
                    lambda: DistributedDataParallel(model, process_group=autotp.dp_group(model))):
        try:
            attempt()
            messages.append("accepted")
        except NotImplementedError as err:
            messages.append(str(err))
    with autotp.GatherReplacedLayerParams(model):  # every expert on every rank, computed as one process
        logits = model(input_ids=GLOBAL[:1]).logits
    messages.append(logits.shape == (1, GLOBAL.shape[1], model.config.vocab_size))
    return messages


def test_ep_refuses_by_name_what_it_cannot_do_yet(tmp_path) -> None:
    for messages in run_ranks(refusals_at_ep2, 2, str(tmp_path)):
        assert "ep_size=4 must divide the world size 2" in messages[0]
        assert messages[1] == "accepted"  # fully_shard at ep > 1: tests/ep/test_expert_compose.py
        assert "DistributedDataParallel at ep_size=2" in messages[2]
        assert messages[3] is True


def loaded_at_ep2(rank: int, world: int, path: str) -> dict:
    """`from_pretrained(..., ep_size=2)` against `wrap(transformers' own load, ep_size=2)`: same tensors, same loss."""
    direct = autotp.from_pretrained(path, 1, ep_size=2)
    reference = autotp.wrap(AutoModelForCausalLM.from_pretrained(path), 1, ep_size=2)
    theirs = reference.state_dict()
    with torch.no_grad():
        losses = [m(input_ids=GLOBAL[:2], labels=GLOBAL[:2]).loss.item() for m in (direct, reference)]
    return {"unequal": [k for k, v in direct.state_dict().items() if not torch.equal(v, theirs[k])],
            "loss": abs(losses[0] - losses[1])}


def test_from_pretrained_at_ep2_equals_wrap_after_transformers_load(tmp_path) -> None:
    moe_model("qwen3_moe").save_pretrained(tmp_path)
    for report in run_ranks(loaded_at_ep2, 2, str(tmp_path)):
        assert report["unequal"] == [] and report["loss"] == 0.0, report
