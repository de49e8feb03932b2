"""Training checkpoints resume at any layout: 3 AdamW steps at one tp x dp, save, 3 more at another, equal 6 straight
steps in one process.

The global batch is the same 4 rows at every layout (each DP replica takes its rows), so every layout computes one
process's steps. Tolerances as in test_parity (fp32, only the order of sums differs): loss 1e-5, parameters after
the AdamW steps 3e-5. The one-process reference is built as a user would (same seed, same calls), not copied.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing import tiny_config
from autotp.testing.parity import LOSS_ATOL, PARAM_ATOL, full_tensor
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

GLOBAL = batch(vocab=250, size=(4, 16))
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"], lora_dropout=0.0, init_lora_weights=False)


def build(kind: str, seed: int) -> torch.nn.Module:
    """Llama with 2 KV heads (replicated at tp=4) and a vocabulary of 250 (uneven over 4); a Qwen3-MoE whose expert
    width (40) splits into rows of 40 bytes at tp=4; LoRA adapters on that Llama."""
    if kind == "qwen3_moe":
        config = tiny_config("qwen3_moe")
        config.moe_intermediate_size, config.vocab_size = 40, 250
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = tiny_model("llama", seed=seed, num_key_value_heads=2, vocab_size=250)
    return get_peft_model(model, LoraConfig(**LORA)) if kind == "lora" else model


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)


def steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, count: int) -> list[float]:
    """`count` steps on this replica's rows of the global batch; the global batch's loss (mean over replicas)."""
    wrapped = hasattr(model, "autotp_state") or any(hasattr(m, "autotp_state") for m in model.modules())
    dp, replica = (autotp.dp_size(model), autotp.dp_rank(model)) if wrapped else (1, 0)
    rows = GLOBAL.shape[0] // dp
    ids = GLOBAL[replica * rows:(replica + 1) * rows]
    losses = []
    for _ in range(count):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if wrapped:
            autotp.allreduce_gradients(model)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if dp > 1:
            dist.all_reduce(total, group=autotp.dp_group(model))
        losses.append(total.item() / dp)
    return losses


def layout(kind: str, tp: int, fsdp: bool, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build(kind, seed)
    if kind == "lora":  # the adapters added before wrap, as the README shows: wrap the model PEFT holds
        autotp.wrap(model.base_model.model, tp)
    else:
        model = autotp.wrap(model, tp)
    if fsdp:
        model = autotp.fully_shard(model)
    return model, optimizer_for(model)


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    group = autotp.tp_group(model) if dist.is_initialized() else None
    return {n: full_tensor(p, p, group).clone() for n, p in model.named_parameters()}


def first_half(rank: int, world: int, kind: str, tp: int, fsdp: bool, path: str) -> list[float]:
    model, optimizer = layout(kind, tp, fsdp, seed=0)
    losses = steps(model, optimizer, 3)
    autotp.save_checkpoint(path, model, optimizer, step=3, samples=3 * GLOBAL.shape[0])
    return losses


def second_half(rank: int, world: int, kind: str, tp: int, fsdp: bool, path: str) -> dict:
    torch.manual_seed(999)  # whatever: the checkpoint's state must win
    model, optimizer = layout(kind, tp, fsdp, seed=7)  # other initial weights, an empty optimizer
    state = autotp.load_checkpoint(path, model, optimizer)
    return {"state": state, "losses": steps(model, optimizer, 3), "params": full_params(model)}


def one_process_resume(kind: str, path: Path, with_optimizer: bool = True) -> dict:
    """The checkpoint loaded into a plain model in this process, no torch.distributed: then 3 steps."""
    model = build(kind, seed=7)
    optimizer = optimizer_for(model)
    state = autotp.load_checkpoint(path, model, optimizer if with_optimizer else None)
    return {"state": state, "losses": steps(model, optimizer, 3), "params": full_params(model)}


def straight(kind: str) -> dict:
    model = build(kind, seed=0)
    optimizer = optimizer_for(model)
    return {"losses": steps(model, optimizer, 6), "params": full_params(model)}


def check(report: dict, expected: dict, label: str) -> None:
    assert report["state"] == {"step": 3, "samples": 12}, (label, report["state"])
    worst_loss = max(abs(a - b) for a, b in zip(report["losses"], expected["losses"][3:]))
    assert worst_loss <= LOSS_ATOL, (label, report["losses"], expected["losses"][3:])
    worst = max(((report["params"][n] - p).abs().max().item(), n) for n, p in expected["params"].items())
    assert worst[0] <= PARAM_ATOL, (label, worst)


LAYOUTS = {  # label -> (world, tp, fully_shard)
    "tp=4": (4, 4, False),
    "tp=1 x dp=2": (2, 1, False),
    "tp=2 x dp=1": (2, 2, False),
    "tp=2 x dp=2, fully_shard": (4, 2, True),
}


def test_saved_at_tp2_resumes_in_one_process_and_at_dp2(tmp_path: Path) -> None:
    """The fast tier's case: Llama saved at tp=2, resumed at tp=1 x dp=2 and in one process without
    torch.distributed; loading without the optimizer state is far off (this test sees a dropped state)."""
    path = tmp_path / "ckpt"
    expected = straight("llama")
    halves = run_ranks(first_half, 2, "llama", 2, False, str(path))
    assert max(abs(a - b) for a, b in zip(halves[0], expected["losses"][:3])) <= LOSS_ATOL
    check(one_process_resume("llama", path), expected, "one process")
    for report in run_ranks(second_half, 2, "llama", 1, False, str(path)):
        check(report, expected, "tp=1 x dp=2")
    dropped = one_process_resume("llama", path, with_optimizer=False)
    worst = max((dropped["params"][n] - p).abs().max().item() for n, p in expected["params"].items())
    assert worst > 10 * PARAM_ATOL, f"a resume without Adam's moments came within {worst:.3g}: the test cannot see it"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "lora"])
def test_saved_at_tp2_dp2_resumes_at_every_layout(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ckpt"
    expected = straight(kind)
    halves = run_ranks(first_half, 4, kind, 2, False, str(path))
    assert max(abs(a - b) for a, b in zip(halves[0], expected["losses"][:3])) <= LOSS_ATOL
    check(one_process_resume(kind, path), expected, "one process")
    for label, (world, tp, fsdp) in LAYOUTS.items():
        if fsdp and kind == "lora":
            continue  # PEFT adapters under autotp.fully_shard are refused (tests/test_fsdp.py)
        for report in run_ranks(second_half, world, kind, tp, fsdp, str(path)):
            check(report, expected, label)
