"""Expert parallelism (`ep_size`) composed with the rest of autotp, each against one process.

The harness and tolerances are tests/ep/test_expert_parallel.py's (fp32; EP only reorders sums): loss 1e-5 absolute,
gradients after the sync 1e-5 of the tensor's largest reference entry (`grad_error`), parameters after 3 AdamW steps
3e-5 absolute; the routing (every MoE layer's top-k indices) equal to one process's on every step.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import autotp
from autotp.testing import run_ranks
from autotp.testing.parity import GRAD_RTOL, LOSS_ATOL, PARAM_ATOL, grad_error
from ep_workers import GLOBAL, STEPS, check, dp_loop, record_routing, single_process, whole
from ep_workers import moe_model as family_model

pytestmark = pytest.mark.timeout(300)


def moe_model() -> torch.nn.Module:
    return family_model("qwen3_moe")


def ep_fsdp_run(rank: int, world: int, tp: int, ep: int, clip: bool = False, family: str = "qwen3_moe") -> dict:
    """The README's FSDP loop at tp x ep: wrap, autotp.fully_shard, this replica's rows, AdamW (no gradient sync:
    FSDP reduces the dense gradients over DP x CP and the experts' over expert-DP)."""
    model = autotp.fully_shard(autotp.wrap(family_model(family), tp, ep_size=ep))
    routing = record_routing(model)
    report = dp_loop(model, lambda: autotp.allreduce_gradients(model), clip)  # a no-op under FSDP, experts too
    experts = [p for p in model.parameters() if hasattr(p, "autotp_expert")]
    return {
        **report,
        "routing": routing,
        "expert_dtensors": all(isinstance(p, DTensor) for p in experts) and len(experts) > 0,
    }


# --- FSDP2 ----------------------------------------------------------------------------------------------------------


def test_fully_shard_at_ep2_on_two_ranks_equals_one_process() -> None:
    """world == ep: each expert-DP group is one rank, so FSDP keeps the experts whole and only divides by dp 2."""
    expected = single_process("qwen3_moe")
    for report in run_ranks(ep_fsdp_run, 2, 1, 2):
        assert report["expert_dtensors"]
        check(report, expected)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(1, 2), (2, 2)], ids=["dp4-ep2", "tp2-ep2"])
def test_fully_shard_at_ep2_on_four_ranks_equals_one_process(tp: int, ep: int) -> None:
    """Dense parameters over DP, experts over expert-DP (2 ranks each); clipped by the whole model's norm (gradient
    norms 1e-5 relative, as in test_expert_parallel)."""
    expected = single_process("qwen3_moe", clip=True)
    for report in run_ranks(ep_fsdp_run, 4, tp, ep, True):
        assert report["expert_dtensors"]
        check(report, expected)
        for ours, theirs in zip(report["norms"], expected["norms"]):
            assert abs(ours - theirs) <= 1e-5 * theirs, (report["norms"], expected["norms"])


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "olmoe", "gpt_oss", "dbrx", "deepseek_v3"])
def test_fully_shard_at_ep2_for_other_families(family: str) -> None:
    """gpt-oss (expert biases), DBRX (flat per-expert blocks, dotted names), DeepSeek-V3 (shared experts beside the
    routed ones): dense over DP, experts over expert-DP, clipped; the harness of tests/ep/ep_workers.py's families."""
    expected = single_process(family, clip=True)
    for report in run_ranks(ep_fsdp_run, 2, 1, 2, True, family):
        assert report["expert_dtensors"]
        check(report, expected)
        for ours, theirs in zip(report["norms"], expected["norms"]):
            assert abs(ours - theirs) <= 1e-5 * theirs, (report["norms"], expected["norms"])


def fsdp_warnings(rank: int, world: int, family: str) -> list[str]:
    """The warnings of one training step under autotp.fully_shard at ep 2 (every one, repeats included)."""
    model = autotp.fully_shard(autotp.wrap(family_model(family), 1, ep_size=2))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model(input_ids=GLOBAL[:2], labels=GLOBAL[:2]).loss.backward()
    return [str(w.message) for w in seen]


@pytest.mark.parametrize("family", ["qwen3_moe", "dbrx"])
def test_experts_under_fully_shard_return_no_view(family: str) -> None:
    """torch warned on every step that the FSDP2 experts module returned a view (the dispatch's `.view`): an in-place
    op on it would drop FSDP's pre-backward hook. qwen3_moe's experts take [tokens, hidden], DBRX's [batch, seq,
    hidden]."""
    for seen in run_ranks(fsdp_warnings, 2, family):
        assert not [w for w in seen if "returned a view tensor" in w], seen


# --- generate, activation checkpointing, LoRA ------------------------------------------------------------------------

PROMPTS = GLOBAL[:, :6]
NEW = 8


def generated(model: torch.nn.Module, prompts: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            **kwargs,
        )


def generate_at_ep(rank: int, world: int, tp: int, ep: int) -> torch.Tensor:
    """Each replica its own prompts (EP ranks then dispatch different tokens); `synced_gpus` keeps every rank stepping
    until all are done, as the all-to-all needs every EP rank at every step."""
    model = autotp.wrap(moe_model(), tp, ep_size=ep).eval()
    rows = PROMPTS.shape[0] // autotp.dp_size(model)
    first = autotp.dp_rank(model) * rows
    return generated(model, PROMPTS[first : first + rows], synced_gpus=True)


def generate_ending_early(rank: int, world: int, eos: int) -> torch.Tensor:
    """Rank 0's sequence meets `eos` first; `generate` is called as a user would, without `synced_gpus`."""
    model = autotp.wrap(moe_model(), 1, ep_size=2, timeout=30).eval()
    return generated(model, PROMPTS[rank : rank + 1], eos_token_id=eos)


def test_generate_at_ep2_keeps_a_finished_rank_stepping_without_synced_gpus() -> None:
    """One rank's sequence ends before the other's: without `synced_gpus` it would leave generate early and its EP
    peer would wait in the all-to-all until the timeout. autotp defaults it on, and each rank's tokens are one
    process's for its own prompt."""
    alone = [generated(moe_model().eval(), PROMPTS[r : r + 1])[0, PROMPTS.shape[1] :].tolist() for r in range(2)]
    eos = next(t for t in alone[0][:-1] if t not in alone[1])  # ends rank 0's row early, never rank 1's
    outputs = run_ranks(generate_ending_early, 2, eos)
    for rank, tokens in enumerate(outputs):
        assert torch.equal(tokens, generated(moe_model().eval(), PROMPTS[rank : rank + 1], eos_token_id=eos)), rank
    assert outputs[0].shape[1] < outputs[1].shape[1]  # rank 0 really finished first


@pytest.mark.parametrize("tp,world", [(1, 2), (2, 4)], ids=["dp2-ep2", "tp2-ep2"])
def test_greedy_generate_at_ep2_equals_one_process(tp: int, world: int) -> None:
    """Greedy tokens, exactly: the logits differ only in the order of sums (no near-ties on these prompts)."""
    expected = generated(moe_model().eval(), PROMPTS)
    outputs = run_ranks(generate_at_ep, world, tp, 2)
    replicas = world // tp
    rows = PROMPTS.shape[0] // replicas
    for rank, tokens in enumerate(outputs):
        first = (rank // tp) * rows
        assert torch.equal(tokens, expected[first : first + rows]), (rank, tokens, expected)


def lora(model: torch.nn.Module, targets: dict) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **targets))


ATTENTION = {"target_modules": ["q_proj", "v_proj"]}


def single_process_with(mode: str) -> dict:
    """One process, set up as the ranks are: activation checkpointing, or LoRA on attention."""
    model = moe_model()
    if mode == "checkpointing":
        model.gradient_checkpointing_enable()
        model.train()
    else:
        model = lora(model, ATTENTION)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    losses, grads = [], {}
    for step in range(STEPS):
        loss = model(input_ids=GLOBAL, labels=GLOBAL).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "grads": grads,
        "routing": [],
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def ep_run_with(rank: int, world: int, tp: int, ep: int, mode: str) -> dict:
    """The README's DP loop at tp x ep with activation checkpointing, or LoRA on attention (PEFT after wrap)."""
    model = autotp.wrap(moe_model(), tp, ep_size=ep)
    routing = record_routing(model)
    if mode == "checkpointing":
        model.gradient_checkpointing_enable()
        model.train()
    else:
        model = lora(model, ATTENTION)
    calls = []

    def sync() -> None:  # after each backward: the experts calls seen so far (the first step's: forward + recompute)
        calls.append(len(routing))
        autotp.allreduce_gradients(model)

    return {**dp_loop(model, sync), "routing": [], "calls": calls[0]}


@pytest.mark.parametrize("mode", ["checkpointing", "lora"])
def test_checkpointing_and_attention_lora_at_ep2_equal_one_process(mode: str) -> None:
    """Checkpointing recomputes the MoE layers in backward, all-to-alls included, in the same order on every rank."""
    expected = single_process_with(mode)
    layers = moe_model().config.num_hidden_layers
    for report in run_ranks(ep_run_with, 2, 1, 2, mode):
        check(report, expected)
        assert report["calls"] == layers * (2 if mode == "checkpointing" else 1)  # recomputed in backward


def lora_on_experts(rank: int, world: int) -> str:
    model = lora(
        autotp.wrap(moe_model(), 1, ep_size=2),
        {"target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]},
    )
    try:
        model(input_ids=GLOBAL[:2], labels=GLOBAL[:2])
    except NotImplementedError as err:
        return str(err)
    return "accepted"


def test_lora_on_expert_parameters_at_ep2_is_refused_by_name() -> None:
    """PEFT's ParamWrapper would hold per-expert factors for this rank's experts only, synced as dense ones."""
    for message in run_ranks(lora_on_experts, 2):
        assert "model.layers.0.mlp.experts was replaced after wrap by peft.tuners.lora.layer.ParamWrapper" in message
        assert "an adapter on the experts at ep_size=2 is not supported yet" in message


# --- torch.compile ---------------------------------------------------------------------------------------------------


def compiled_at_ep2(rank: int, world: int) -> dict:
    """torch._dynamo.explain of the EP model's forward, then one compiled forward and backward, gradients synced."""
    torch._dynamo.reset()
    model = autotp.wrap(moe_model(), 1, ep_size=2)
    mine = GLOBAL[rank * 2 : (rank + 1) * 2]
    explained = torch._dynamo.explain(model)(input_ids=mine, labels=mine)
    where = {
        frame.filename.replace("\\", "/").rsplit("autotp/", 1)[-1]
        for reason in explained.break_reasons
        for frame in reason.user_stack[-1:]
    }
    loss = torch.compile(model)(input_ids=mine, labels=mine).loss
    loss.backward()
    autotp.allreduce_gradients(model)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return {
        "breaks": explained.graph_break_count,
        "where": where,
        "loss": mean.item() / world,
        "reasons": {"ExpertRegion._dispatch" in reason.reason for reason in explained.break_reasons},
        "grads": {n: whole(p.grad, p, model) for n, p in model.named_parameters()},
    }


@pytest.mark.slow
def test_torch_compile_at_ep2_equals_one_process() -> None:
    """Compiled forward and backward at ep 2 (tolerances as above: inductor reorders sums further, within 1e-5).
    The graph breaks are all at the token dispatch, which runs eagerly (`torch.compiler.disable`: its sizes follow the
    routed counts), and nowhere else; one process's model compiles whole."""
    expected = single_process("qwen3_moe")
    for report in run_ranks(compiled_at_ep2, 2):
        assert report["breaks"] > 0 and report["where"] == {"ep/dispatch.py"}, report["where"]
        assert report["reasons"] == {True}, "a graph break other than the dispatch's"
        assert abs(report["loss"] - expected["losses"][0]) <= LOSS_ATOL
        worst = max((grad_error(report["grads"][n], g), n) for n, g in expected["grads"].items())
        assert worst[0] <= GRAD_RTOL, f"gradient of {worst[1]} differs by {worst[0]:.3g}"


# --- AutoTPTrainer ---------------------------------------------------------------------------------------------------

TRAINER_STEPS = 3


def trainer_run(path: str, ep: int, accumulation: int = 1, fsdp: bool = False, adapters: bool = False) -> dict:
    """Trainer on the MoE model: AutoTPTrainer at `ep` (its own DP sampler, global batch 4), or at ep 0 transformers'
    Trainer in one process reading the same global batches (a one-replica DistributedSampler, autotp's order).
    Clipping at Trainer's default max_grad_norm 1.0 (active on these steps); `adapters`: LoRA on attention."""
    from torch.utils.data import DistributedSampler
    from transformers import Trainer, TrainingArguments

    from autotp.hf_trainer import AutoTPTrainer
    from models import Sequences

    class Recording(AutoTPTrainer if ep else Trainer):
        losses: list[float] = []
        norms: list[float] = []

        def _get_train_sampler(self, train_dataset=None):  # AutoTPTrainer deals its batches over the DP replicas
            return DistributedSampler(self.train_dataset, num_replicas=1, rank=0, shuffle=True, seed=self.args.seed)

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.losses = [*self.losses, loss.item()]
            return loss

    replicas = dist.get_world_size() if ep else 1
    args = TrainingArguments(
        output_dir=path,
        per_device_train_batch_size=4 // replicas // accumulation,
        gradient_accumulation_steps=accumulation,
        max_steps=TRAINER_STEPS,
        learning_rate=1e-3,
        adam_epsilon=1e-6,
        seed=0,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1,
    )
    model = autotp.wrap(moe_model(), 1, ep_size=ep) if ep else moe_model()
    model = lora(model, ATTENTION) if adapters else model
    extra = {"fully_shard": fsdp} if ep else {}
    trainer = Recording(model=model, args=args, train_dataset=Sequences(16), **extra)
    trainer.train()
    norms = [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]
    params = {n: whole(p, p, model) if ep else p.detach().clone() for n, p in model.named_parameters()}
    return {"losses": trainer.losses, "norms": norms, "params": params}


def trainer_at_ep2(rank: int, world: int, path: str, accumulation: int, fsdp: bool, adapters: bool) -> dict:
    return trainer_run(f"{path}/ep", 2, accumulation, fsdp, adapters)


@pytest.mark.parametrize(
    "accumulation,fsdp,adapters",
    [(1, False, False), (2, False, False), (1, True, False), (1, False, True)],
    ids=["sync", "accumulation", "fully_shard", "lora"],
)
def test_trainer_at_ep2_equals_one_process_trainer(tmp_path, accumulation: int, fsdp: bool, adapters: bool) -> None:
    """AutoTPTrainer at ep 2 on 2 ranks (no DDP: the experts' gradients are synced over expert-DP after the last
    micro-batch) against transformers' Trainer: step losses 1e-5, gradient norms 1e-5 relative, parameters 3e-5."""
    expected = trainer_run(str(tmp_path / "one"), 0, accumulation, adapters=adapters)
    assert adapters or expected["norms"][0] > 1.0, "clipping must be active for this test to mean anything"
    for report in run_ranks(trainer_at_ep2, 2, str(tmp_path), accumulation, fsdp, adapters):
        assert len(report["losses"]) == len(expected["losses"]) == TRAINER_STEPS * accumulation
        loss = max(abs(a - b) for a, b in zip(report["losses"], expected["losses"]))
        assert loss <= LOSS_ATOL, (report["losses"], expected["losses"])
        for ours, theirs in zip(report["norms"], expected["norms"]):
            assert abs(ours - theirs) <= 1e-5 * theirs, (report["norms"], expected["norms"])
        worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
        assert worst[0] <= PARAM_ATOL, f"{worst[1]} differs by {worst[0]:.3g} after Trainer's steps"


# --- state under fully_shard -----------------------------------------------------------------------------------------


def sharded_half(rank: int, world: int, path: str, save: bool) -> dict:
    """Under `autotp.fully_shard` at ep 2: 3 steps then `save_checkpoint` and `save_pretrained` (`save`), or
    `load_checkpoint` into other weights then 3 steps."""
    from resume_workers import resume_model, resume_steps, resume_training

    model = autotp.fully_shard(autotp.wrap(resume_model("qwen3_moe", seed=0 if save else 7), 1, ep_size=2))
    optimizer, scheduler = resume_training(model)
    if save:
        losses = resume_steps(model, optimizer, scheduler, 3)
        autotp.save_checkpoint(path, model, optimizer, scheduler, step=3, samples=12)
        autotp.save_pretrained(model, path + "-hf")
        return {"losses": losses}
    state = autotp.load_checkpoint(path, model, optimizer, scheduler)
    losses = resume_steps(model, optimizer, scheduler, 3)
    return {"state": state, "losses": losses, "params": {n: whole(p, p, model) for n, p in model.named_parameters()}}


def resumed_in_one_process(path: str) -> dict:
    from resume_workers import resume_model, resume_steps, resume_training

    model = resume_model("qwen3_moe", seed=7)
    optimizer, scheduler = resume_training(model)
    state = autotp.load_checkpoint(path, model, optimizer, scheduler)
    return {
        "state": state,
        "losses": resume_steps(model, optimizer, scheduler, 3),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


@pytest.mark.slow  # about 2 s; ep2 checkpoints stay quick (test_expert_state.py)
def test_checkpoints_under_fully_shard_at_ep2_resume_in_one_process_and_at_ep2(tmp_path) -> None:
    """3 steps under fully_shard at ep 2, `save_checkpoint`; resumed in one process and under fully_shard at ep 2,
    each as 6 straight steps of one process go (tolerances of tests/io/test_reshard_resume.py: loss 1e-5,
    parameters 3e-5). `save_pretrained` of the same weights equals `consolidate` of the checkpoint, exactly."""
    from safetensors.torch import load_file

    from resume_workers import check_resume, straight_run

    path = str(tmp_path / "ckpt")
    expected = straight_run("qwen3_moe")
    first = run_ranks(sharded_half, 2, path, True)[0]
    assert max(abs(a - b) for a, b in zip(first["losses"], expected["losses"][:3])) <= LOSS_ATOL
    check_resume(resumed_in_one_process(path), expected, "one process")
    for report in run_ranks(sharded_half, 2, path, False):
        check_resume(report, expected, "fully_shard at ep 2")
    autotp.consolidate(path, tmp_path / "consolidated")
    ours = {k: v for f in sorted((tmp_path / "consolidated").glob("*.safetensors")) for k, v in load_file(f).items()}
    saved = {k: v for f in sorted((tmp_path / "ckpt-hf").glob("*.safetensors")) for k, v in load_file(f).items()}
    assert ours.keys() == saved.keys() and all(torch.equal(ours[k], saved[k]) for k in saved)
