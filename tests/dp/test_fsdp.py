"""FSDP2 over data parallelism x tensor parallelism: dp=2 x tp=2 on 4 CPU ranks equals one process on the global
batch, and every parameter, gradient and optimizer state is split over both dimensions.

Tolerances as in test_parity (fp32, only the order of sums differs): loss 1e-5, parameters after 3 AdamW steps
3e-5, gradient norms 1e-5 relative. Gloo has the all-gather and reduce-scatter FSDP2 uses.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autotp
from autotp.testing.parity import LOSS_ATOL, PARAM_ATOL, full_tensor
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

GLOBAL = batch(size=(4, 16))
CLIP = 0.5
CASES = {  # the TP gradient steps FSDP must not lose: (family, config, wrap options)
    "llama-kv1": ("llama", {"num_key_value_heads": 1}, {}),  # the one KV head replicated on both TP ranks
    "qwen3": ("qwen3", {}, {}),  # per-head q_norm / k_norm, replicated, gradients summed over TP
    "llama-sp": ("llama", {}, {"sequence_parallel": True}),  # layer norms see a sequence chunk, summed over TP
}


def one_process(family: str, config: dict) -> dict:
    model = tiny_model(family, **config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, norms = [], []
    for _ in range(3):
        loss = model(input_ids=GLOBAL, labels=GLOBAL).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "norms": norms,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "numel": sum(p.numel() for p in model.parameters()),
    }


def fsdp_rank(rank: int, world: int, family: str, config: dict, options: dict, reshard: bool, accumulate: bool) -> dict:
    wrapped = autotp.wrap(tiny_model(family, **config), 2, check_inputs=True, **options)  # inputs compared each step
    model = autotp.fully_shard(wrapped, reshard_after_forward=reshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    mine = GLOBAL[2 * autotp.dp_rank(model) : 2 * autotp.dp_rank(model) + 2]  # this replica's half
    losses, norms = [], []
    for _ in range(3):
        if accumulate:  # 2 micro-batches, FSDP's gradient sync off for the first
            model.set_requires_gradient_sync(False)
            first = model(input_ids=mine[:1], labels=mine[:1]).loss / 2
            first.backward()
            model.set_requires_gradient_sync(True)
            second = model(input_ids=mine[1:], labels=mine[1:]).loss / 2
            second.backward()
            loss = first.detach() + second.detach()
        else:
            loss = model(input_ids=mine, labels=mine).loss
            loss.backward()
        autotp.allreduce_gradients(model)  # a DDP script's call: FSDP has reduced them already, so it does nothing
        norms.append(autotp.clip_grad_norm_(model, CLIP).item())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=autotp.dp_group(model))
        losses.append(mean.item() / 2)
    autotp.check_replicas(model)  # replicated tensors (their DP rows) still equal on both TP ranks
    local = sum(p.to_local().numel() for p in model.parameters())
    moments = sum(s["exp_avg"].to_local().numel() for s in opt.state.values())
    group = autotp.tp_group(model)
    return {
        "losses": losses,
        "norms": norms,
        "local": local,
        "moments": moments,
        "params": {n: full_tensor(p, p, group) for n, p in model.named_parameters()},
    }


@pytest.mark.parametrize("reshard", [True, False], ids=["zero3", "zero2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fsdp_dp2_tp2_equals_one_process(case: str, reshard: bool) -> None:
    family, config, options = CASES[case]
    expected = one_process(family, config)
    assert expected["norms"][0] > CLIP, "clipping must be active for this test to mean anything"
    for report in run_ranks(fsdp_rank, 4, family, config, options, reshard, False):
        assert max(abs(a - b) for a, b in zip(report["losses"], expected["losses"])) <= LOSS_ATOL, report["losses"]
        for a, b in zip(report["norms"], expected["norms"]):
            assert abs(a - b) <= 1e-5 * b, (report["norms"], expected["norms"])
        worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
        assert worst[0] <= PARAM_ATOL, worst
        # each rank holds about a quarter: 1/(tp x dp) of the sharded tensors, 1/dp of the replicated ones
        assert report["local"] <= 0.3 * expected["numel"], (report["local"], expected["numel"])
        assert report["moments"] == report["local"]


@pytest.mark.slow  # about 2 s; FSDP's parity at dp2 x tp2 stays quick
def test_fsdp_gradient_accumulation_without_sync_equals_one_process() -> None:
    family, config, options = CASES["llama-kv1"]
    expected = one_process(family, config)
    for report in run_ranks(fsdp_rank, 4, family, config, options, True, True):
        assert max(abs(a - b) for a, b in zip(report["losses"], expected["losses"])) <= LOSS_ATOL, report["losses"]
        worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
        assert worst[0] <= PARAM_ATOL, worst


def trained_and_saved(rank: int, world: int, path: str) -> torch.Tensor:
    model = autotp.fully_shard(autotp.wrap(tiny_model("qwen3"), 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(input_ids=GLOBAL, labels=GLOBAL).loss.backward()
    opt.step()
    autotp.save_pretrained(model, path)  # every rank: each gathers its DP group's rows, one tensor at a time
    with torch.no_grad():
        return model(input_ids=GLOBAL).logits


def test_save_pretrained_from_fsdp_loads_in_plain_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    logits = run_ranks(trained_and_saved, 4, str(tmp_path))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        expected = loaded(input_ids=GLOBAL).logits
    assert max((got - expected).abs().max().item() for got in logits) < 1e-5


def fsdp_over_the_world(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = autotp.wrap(tiny_model("llama"), 2)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))  # the whole world: TP ranks 0 and 1 mixed
    before = {n: full_tensor(p, p, None).clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    try:
        model(input_ids=batch(), labels=batch()).loss.backward()
        opt.step()
    except RuntimeError as err:
        message = str(err)
    else:
        message = "stepped"
    changed = any(not torch.equal(full_tensor(p, p, None), before[n]) for n, p in model.named_parameters())
    return {"message": message, "changed": changed}


def test_fsdp_over_a_mesh_mixing_tp_ranks_is_refused_before_the_first_step() -> None:
    for report in run_ranks(fsdp_over_the_world, 4):
        assert "autotp.fully_shard(model)" in report["message"], report
        assert not report["changed"]


def mixed_precision(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = autotp.fully_shard(autotp.wrap(tiny_model("qwen3"), 2), mp_policy=policy)
    seen = []
    model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    mine = GLOBAL[2 * autotp.dp_rank(model) : 2 * autotp.dp_rank(model) + 2]
    losses = []
    for _ in range(3):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        autotp.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float().clone()
        dist.all_reduce(mean, group=autotp.dp_group(model))
        losses.append(mean.item() / 2)
    return {"losses": losses, "compute": seen[0], "stored": next(model.parameters()).dtype}


@pytest.mark.slow  # about 1.5 s; FSDP's parity at dp2 x tp2 stays quick
def test_fsdp_mixed_precision_computes_in_bf16_and_tracks_fp32() -> None:
    """bf16 compute keeps ~3 significant digits: the loss within 2e-2 of the fp32 one-process run."""
    expected = one_process("qwen3", {})["losses"]
    for report in run_ranks(mixed_precision, 4):
        assert report["compute"] == torch.bfloat16 and report["stored"] == torch.float32, report
        assert max(abs(a - b) for a, b in zip(report["losses"], expected)) <= 2e-2, (report["losses"], expected)


def adapters_under_fsdp(rank: int, world: int) -> str:
    from peft import LoraConfig, get_peft_model

    adapted = get_peft_model(autotp.wrap(tiny_model("llama"), 2), LoraConfig(r=4, target_modules=["q_proj"]))
    try:
        autotp.fully_shard(adapted.base_model.model)
    except NotImplementedError as err:
        return str(err)
    return "sharded"


def test_peft_adapters_under_fsdp_are_refused_by_name() -> None:
    for message in run_ranks(adapters_under_fsdp, 4):
        assert "autotp.fully_shard" in message and "q_proj" in message and "DDP" in message, message


def gathered_under_fsdp(rank: int, world: int, path: str) -> dict:
    """GatherReplacedLayerParams on FSDP x TP after a training step: full weights inside (HF's own save_pretrained
    works there), a weight written inside persists, and training goes on under FSDP like one process."""
    model, opt = fsdp_model()
    steps(model, opt, 1)
    ids = GLOBAL[2 * autotp.dp_rank(model) : 2 * autotp.dp_rank(model) + 2]
    with torch.no_grad():
        sharded = model(input_ids=ids).logits
    with autotp.GatherReplacedLayerParams(model):
        q = model.model.layers[0].self_attn.q_proj.weight
        shape = tuple(q.shape)
        with torch.no_grad():
            inside = model(input_ids=ids).logits
            type(model).save_pretrained(model, path, is_main_process=rank == 0)  # transformers' own method
            model.model.layers[1].mlp.down_proj.weight.mul_(0.5)  # a weight changed inside
        try:
            opt.step()
            stepped = "stepped"
        except RuntimeError as err:
            stepped = str(err)
    after = steps(model, opt, 2)  # FSDP is back: its hooks and DP rows
    return {
        "shape": shape,
        "inside": (inside - sharded).abs().max().item(),
        "stepped": stepped,
        "after": after,
        "params": {n: full_tensor(p, p, autotp.tp_group(model)) for n, p in model.named_parameters()},
    }


@pytest.mark.slow  # about 1.5 s; FSDP's parity at dp2 x tp2 stays quick
def test_gather_under_fsdp_holds_full_weights_and_gives_them_back(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    reports = run_ranks(gathered_under_fsdp, 4, str(tmp_path / "hf"))
    torch.manual_seed(0)
    one = tiny_model("llama", num_key_value_heads=1)
    opt = torch.optim.AdamW(one.parameters(), lr=1e-3, eps=1e-6)
    losses = []
    for step in range(3):
        loss = one(input_ids=GLOBAL, labels=GLOBAL).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(one.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == 0:
            saved = {n: p.detach().clone() for n, p in one.named_parameters()}
            with torch.no_grad():
                one.model.layers[1].mlp.down_proj.weight.mul_(0.5)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert max((loaded.state_dict()[n] - p).abs().max().item() for n, p in saved.items()) <= PARAM_ATOL
    for report in reports:
        assert report["shape"] == (64, 64) and report["inside"] < 1e-5, report
        assert "inside GatherReplacedLayerParams" in report["stepped"], report["stepped"]
        mean = [sum(r["after"][i] for r in reports) / len(reports) for i in range(2)]  # over DP replicas
        assert max(abs(a - b) for a, b in zip(mean, losses[1:])) <= LOSS_ATOL, (mean, losses)
        worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in one.named_parameters())
        assert worst[0] <= PARAM_ATOL, worst


def steps(model: torch.nn.Module, opt: torch.optim.Optimizer, count: int) -> list[float]:
    mine = GLOBAL[2 * autotp.dp_rank(model) : 2 * autotp.dp_rank(model) + 2]
    losses = []
    for _ in range(count):
        loss = model(input_ids=mine, labels=mine).loss
        loss.backward()
        autotp.clip_grad_norm_(model, CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def fsdp_model(reshard: bool = True) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = autotp.fully_shard(
        autotp.wrap(tiny_model("llama", num_key_value_heads=1), 2), reshard_after_forward=reshard
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)


def resume_rank(rank: int, world: int, path: str) -> dict:
    model, opt = fsdp_model()
    steps(model, opt, 2)
    autotp.save_checkpoint(path, model, opt, step=2)
    at_save = {n: full_tensor(p, p, autotp.tp_group(model)) for n, p in model.named_parameters()}
    straight = steps(model, opt, 2)
    expected = {n: full_tensor(p, p, autotp.tp_group(model)) for n, p in model.named_parameters()}
    torch.manual_seed(123)  # a different start: everything must come from the checkpoint
    resumed, opt2 = fsdp_model()
    state = autotp.load_checkpoint(path, resumed, opt2)
    again = steps(resumed, opt2, 2)
    got = {n: full_tensor(p, p, autotp.tp_group(resumed)) for n, p in resumed.named_parameters()}
    plain = autotp.wrap(tiny_model("llama", num_key_value_heads=1, seed=5), 2)  # the same checkpoint without FSDP
    autotp.load_checkpoint(path, plain)
    unsharded = {n: full_tensor(p, p, autotp.tp_group(plain)) for n, p in plain.named_parameters()}
    return {
        "state": state,
        "straight": straight,
        "again": again,
        "same": all(torch.equal(got[n], expected[n]) for n in expected),
        "without fsdp": all(torch.equal(unsharded[n], at_save[n]) for n in at_save),
    }


@pytest.mark.slow  # about 3 s; FSDP's parity at dp2 x tp2 stays quick
def test_fsdp_resume_is_bit_exact_and_consolidates(tmp_path) -> None:
    """Each rank writes its DP rows of its TP shard (and of its Adam moments) as boxes of the full tensors: the same
    layout resumes bit-exactly, a model without fully_shard reads it too, and consolidate joins them."""
    from transformers import AutoModelForCausalLM

    for report in run_ranks(resume_rank, 4, str(tmp_path / "ckpt")):
        assert report["state"] == {"step": 2}
        assert report["again"] == report["straight"] and report["same"], report
        assert report["without fsdp"], "the checkpoint saved under fully_shard loads into a model without it"
    autotp.consolidate(tmp_path / "ckpt", tmp_path / "full")
    torch.manual_seed(0)
    model, opt = tiny_model("llama", num_key_value_heads=1), None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    for _ in range(2):  # the one-process run to step 2 that the checkpoint holds
        loss = model(input_ids=GLOBAL, labels=GLOBAL).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    worst = max((loaded.state_dict()[n] - p).abs().max().item() for n, p in model.state_dict().items())
    assert worst <= PARAM_ATOL, worst


def after_fully_shard(rank: int, world: int) -> dict:
    """What a user may do to the model after fully_shard that FSDP would not follow: each stops, changing nothing."""
    from peft import LoraConfig, get_peft_model

    model = autotp.fully_shard(autotp.wrap(tiny_model("llama"), 2))
    embedding = model.get_input_embeddings().weight
    try:
        model.resize_token_embeddings(300)
        resized = "resized"
    except NotImplementedError as err:
        resized = str(err)
    same = model.get_input_embeddings().weight is embedding
    adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
    try:
        adapted(input_ids=batch(), labels=batch()).loss.backward()
        lora = "trained"
    except NotImplementedError as err:
        lora = str(err)
    return {"resized": resized, "same embedding": same, "lora": lora}


def test_a_resize_or_lora_after_fully_shard_is_refused() -> None:
    """A resize would replace the parameters FSDP holds; LoRA added after fully_shard would train plain tensors that
    FSDP never reduces over DP, so the replicas would drift apart without a word."""
    for report in run_ranks(after_fully_shard, 4):
        assert "Resize before fully_shard" in report["resized"] and report["same embedding"], report
        assert "model.layers.0.self_attn.q_proj" in report["lora"] and "fully_shard" in report["lora"], report
