"""Resuming at another layout: the rank workers of tests/io/test_reshard_resume.py and tests/io/test_resume.py,
also run on CUDA by tests/package/test_gpu.py (a helper module beside the io tests; pytest's `pythonpath` puts this
folder on sys.path)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import parity, tiny_config
from models import RESUME_LORA, batch, tiny_model

RESUME_BATCH = batch(vocab=250, size=(4, 16))  # the global batch: each DP replica takes its rows


def resume_model(kind: str, seed: int, device: str = "cpu") -> nn.Module:
    """Llama with 2 KV heads (replicated at tp=4) and a vocabulary of 250 (uneven over 4); Gemma (tied embeddings,
    same sizes); a Qwen3-MoE whose expert width (40) splits into 10 rows at tp=4; LoRA adapters on that Llama; GPT-2
    and Phi-3, whose fused projections (c_attn [q | k | v], qkv_proj, gate_up_proj) hold several runs per rank."""
    if kind in ("gpt2", "phi3"):
        return tiny_model(kind, seed=seed, vocab_size=250).to(device)
    if kind == "qwen3_moe":
        config = tiny_config("qwen3_moe")
        config.moe_intermediate_size, config.vocab_size = 40, 250
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    model = tiny_model("gemma" if kind == "gemma" else "llama", seed=seed, num_key_value_heads=2, vocab_size=250)
    if kind == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**RESUME_LORA))
    return model.to(device)


def resume_training(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def resume_steps(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler, count: int
) -> list[float]:
    """`count` steps on this replica's rows of the global batch; the global batch's loss (mean over replicas)."""
    wrapped = any(hasattr(m, "autotp_state") for m in model.modules())
    dp, replica = (autotp.dp_size(model), autotp.dp_rank(model)) if wrapped else (1, 0)
    rows = RESUME_BATCH.shape[0] // dp
    device = next(model.parameters()).device
    ids = RESUME_BATCH[replica * rows : (replica + 1) * rows].to(device)
    losses = []
    for _ in range(count):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if wrapped:
            autotp.allreduce_gradients(model)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(total, group=autotp.dp_group(model))
        losses.append(total.item() / dp)
    return losses


def resume_layout(kind: str, tp: int, fsdp: bool, seed: int, device: str = "cpu") -> tuple:
    """The model wrapped at `tp` (LoRA: the model PEFT holds, as the README shows), under FSDP if asked, its AdamW
    and scheduler."""
    model = resume_model(kind, seed, device)
    if kind == "lora":
        autotp.wrap(model.base_model.model, tp)
    else:
        model = autotp.wrap(model, tp)
    if fsdp:
        model = autotp.fully_shard(model)
    return (model, *resume_training(model))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    group = autotp.tp_group(model) if dist.is_initialized() else None
    return {n: parity.full_tensor(p, p, group).detach().cpu().clone() for n, p in model.named_parameters()}


def first_half(rank: int, world: int, kind: str, tp: int, fsdp: bool, path: str, device: str = "cpu") -> list[float]:
    """Runs on each rank: 3 steps at `tp` x `world // tp`, then `save_checkpoint`."""
    model, optimizer, scheduler = resume_layout(kind, tp, fsdp, seed=0, device=device)
    losses = resume_steps(model, optimizer, scheduler, 3)
    autotp.save_checkpoint(path, model, optimizer, scheduler, step=3, samples=3 * RESUME_BATCH.shape[0])
    return losses


def second_half(rank: int, world: int, kind: str, tp: int, fsdp: bool, path: str, device: str = "cpu") -> dict:
    """Runs on each rank (or in one process without torch.distributed, `tp=0`): load, then 3 more steps."""
    torch.manual_seed(999)  # whatever: the checkpoint's state must win
    if tp:
        model, optimizer, scheduler = resume_layout(kind, tp, fsdp, seed=7, device=device)  # other weights
    else:
        model = resume_model(kind, seed=7, device=device)
        optimizer, scheduler = resume_training(model)
    state = autotp.load_checkpoint(path, model, optimizer, scheduler)
    return {"state": state, "losses": resume_steps(model, optimizer, scheduler, 3), "params": full_params(model)}


def straight_run(kind: str, device: str = "cpu") -> dict:
    """The reference: 6 steps in one process, built as a user would (the same seed and calls)."""
    model = resume_model(kind, seed=0, device=device)
    return {"losses": resume_steps(model, *resume_training(model), 6), "params": full_params(model)}


def check_resume(report: dict, expected: dict, label: str) -> None:
    """fp32: only the order of sums differs, so the parity tolerances hold (loss 1e-5, parameters 3e-5)."""
    assert report["state"] == {"step": 3, "samples": 12}, (label, report["state"])
    worst_loss = max(abs(a - b) for a, b in zip(report["losses"], expected["losses"][3:]))
    assert worst_loss <= parity.LOSS_ATOL, (label, report["losses"], expected["losses"][3:])
    worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
    assert worst[0] <= parity.PARAM_ATOL, (label, worst)
