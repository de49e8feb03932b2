"""Random draws under a pipeline (dropout, LoRA's dropout, mixtral's router jitter): the rank workers of
tests/pp/test_pp_draws.py (a helper module beside it)."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

import autotp
from models import GPT2_DROPOUT, tiny_model
from pp_workers import pp_batch, pp_parity

JITTER = dict(router_jitter_noise=0.1)
AUX = dict(output_router_logits=True, router_aux_loss_coef=0.02)
LORA_DROPOUT = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.05)


def trained(rank: int, world: int, family: str, config: dict, tp: int = 1, **options: object) -> dict:
    """`family` wrapped at pp 2 (`options`: wrap's, and `lora`, `checkpointing`), seeded 7 after wrap alike on every
    rank, 3 AdamW steps in training mode on one batch through `forward_backward`: each step's loss, the parameters
    after (this rank's), whether the TP ranks' replicated tensors are equal (`autotp.check_replicas`) and whether the
    steps moved the CPU random stream (one process's steps move it only by drawing)."""
    lora = options.pop("lora", None)
    model = tiny_model(family, **config)
    if lora is not None:
        model = get_peft_model(model, lora)
    if options.pop("checkpointing", False):
        model.gradient_checkpointing_enable()
    autotp.wrap(model.base_model.model if lora is not None else model, tp, pp_size=2, pp_microbatches=2, **options)
    model.train()
    torch.manual_seed(7)
    seeded = torch.get_rng_state()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    inputs, losses = pp_batch(), []
    for _ in range(3):
        losses.append(autotp.forward_backward(model, **inputs).loss.item())
        autotp.allreduce_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
    moved = not torch.equal(torch.get_rng_state(), seeded)
    try:
        autotp.check_replicas(model)
        replicas = "equal"
    except RuntimeError as err:
        replicas = str(err)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.device.type != "meta"}
    return {"losses": losses, "params": params, "replicas": replicas, "stream moved": moved}


def routed(rank: int, world: int) -> dict:
    """mixtral at pp 2 with router jitter and its load-balancing loss, one training step: every router's logits in
    the step's counting pass (under no_grad) and in its training pass, in call order (equal: the same jitter)."""
    model = autotp.wrap(tiny_model("mixtral", **JITTER, **AUX), 1, pp_size=2, pp_microbatches=2).train()
    torch.manual_seed(7)
    calls: list[tuple[bool, torch.Tensor]] = []
    for layer in model.model.layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None)
        if gate is not None:  # this stage's layers (another stage's pass their input through)
            gate.register_forward_hook(lambda m, a, out: calls.append((torch.is_grad_enabled(), out[0].detach())))
    autotp.forward_backward(model, **pp_batch())
    return {
        "counted": [t for grad, t in calls if not grad],
        "trained": [t for grad, t in calls if grad],
    }


def quick(rank: int, world: int) -> dict:
    """The 2-rank cases (pp 2) of tests/pp/test_pp_draws.py."""
    dropout = dict(GPT2_DROPOUT)
    return {
        "gpt2": trained(rank, world, "gpt2", dropout),
        "gpt2 again": trained(rank, world, "gpt2", dropout),
        "gpt2 checkpointed": trained(rank, world, "gpt2", dropout, checkpointing=True),
        "gpt2 p=0": trained(rank, world, "gpt2", {}),
        "gpt2 eval": pp_parity(rank, world, "gpt2", 1, 2, dict(pp_microbatches=2, config=dropout, eval=True)),
        "lora": trained(rank, world, "llama", {}, lora=LORA_DROPOUT),
        "mixtral": trained(rank, world, "mixtral", JITTER),
        "mixtral again": trained(rank, world, "mixtral", JITTER),
        "mixtral no jitter": trained(rank, world, "mixtral", {}),
        "routed": routed(rank, world),
    }


def four_ranks(rank: int, world: int) -> dict:
    """The 4-rank cases (pp 2 x tp 2) of tests/pp/test_pp_draws.py."""
    return {
        "gpt2": trained(rank, world, "gpt2", dict(GPT2_DROPOUT), tp=2),
        "gpt2 again": trained(rank, world, "gpt2", dict(GPT2_DROPOUT), tp=2),
        "gpt2 GPipe": trained(rank, world, "gpt2", dict(GPT2_DROPOUT), tp=2, pp_schedule="GPipe"),
        "lora": trained(rank, world, "llama", {}, tp=2, lora=LORA_DROPOUT),
        "lora again": trained(rank, world, "llama", {}, tp=2, lora=LORA_DROPOUT),
        "mixtral": trained(rank, world, "mixtral", JITTER, tp=2),
        "mixtral again": trained(rank, world, "mixtral", JITTER, tp=2),
    }
