"""A gated MLP's `act(gate) * up` is recomputed in the row layer's backward (`autotp.parallel.glu`): the block keeps gate and
up for the backward, not also act(gate) and the product. Loss and every gradient are those of `recompute_glu=False`
bit for bit: the recomputation runs the same kernels on the same tensors, and backward applies autograd's own
formulas in the same order."""

from __future__ import annotations

import pytest
import torch

import autotp
from autotp.testing.memory import KeptForBackward
from autotp.testing.parity import full_tensor
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

IDS = (2, 16)


def step(rank: int, world: int, family: str, recompute: bool, sequence_parallel: bool = False,
         bf16: bool = False, frozen: str = "") -> dict:
    model = autotp.wrap(tiny_model(family), world, recompute_glu=recompute, sequence_parallel=sequence_parallel)
    for name, param in model.named_parameters():
        param.requires_grad_(not (frozen and frozen in name))
    ids = batch(size=IDS)
    kept = KeptForBackward(model)
    with kept.hooks, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = model(input_ids=ids, labels=ids).loss
    held = kept.bytes()
    loss.backward()
    group = autotp.tp_group(model)
    return {"loss": loss.detach(), "kept": held,
            "grads": {n: full_tensor(p.grad, p, group) for n, p in model.named_parameters() if p.requires_grad}}


def product_bytes(family: str, world: int, itemsize: int) -> int:
    """act(gate) and the product, [batch, seq, ffn / tp] each, in every layer."""
    config = tiny_model(family).config
    return config.num_hidden_layers * 2 * IDS[0] * IDS[1] * config.intermediate_size // world * itemsize


@pytest.mark.parametrize("family, world, sequence_parallel", [
    ("llama", 1, False), ("llama", 2, False), ("llama", 2, True), ("llama", 4, False),
    ("gemma", 2, False),  # gelu (tanh) instead of silu
    ("phi3", 1, False), ("phi3", 2, False), ("phi3", 4, False),  # one gate_up_proj, chunked into gate and up
])
def test_the_product_is_recomputed_with_bit_equal_results(family: str, world: int, sequence_parallel: bool) -> None:
    on = run_ranks(step, world, family, True, sequence_parallel)
    off = run_ranks(step, world, family, False, sequence_parallel)
    for a, b in zip(on, off):
        assert a["kept"] == b["kept"] - product_bytes(family, world, 4), (a["kept"], b["kept"])
        assert torch.equal(a["loss"], b["loss"])
        unequal = [n for n, g in b["grads"].items() if not torch.equal(a["grads"][n], g)]
        assert not unequal, unequal


def test_under_bf16_autocast_the_product_is_recomputed_in_bf16() -> None:
    """autocast's casts are made as autocast makes them: the same bf16 forward and backward, fp32 gradients."""
    on, off = run_ranks(step, 2, "llama", True, False, True), run_ranks(step, 2, "llama", False, False, True)
    for a, b in zip(on, off):
        assert a["kept"] == b["kept"] - product_bytes("llama", 2, 2), (a["kept"], b["kept"])
        assert torch.equal(a["loss"], b["loss"])
        assert all(g.dtype == torch.float32 for g in a["grads"].values())
        unequal = [n for n, g in b["grads"].items() if not torch.equal(a["grads"][n], g)]
        assert not unequal, unequal


def test_an_mlp_without_a_gate_is_left_alone() -> None:
    """GPT-2's MLP (c_fc, gelu_new written out, c_proj) has no product to recompute: nothing changes."""
    on, off = run_ranks(step, 2, "gpt2", True)[0], run_ranks(step, 2, "gpt2", False)[0]
    assert on["kept"] == off["kept"] and torch.equal(on["loss"], off["loss"])
    assert all(torch.equal(on["grads"][n], g) for n, g in off["grads"].items())


@pytest.mark.parametrize("frozen", ["down_proj", "mlp"])
def test_a_frozen_mlp_still_recomputes_and_trains_the_rest_alike(frozen: str) -> None:
    """A frozen row weight needs no product (autograd then keeps none either, so only act(gate) is saved on); a frozen
    MLP still passes gradients through."""
    on, off = run_ranks(step, 2, "llama", True, False, False, frozen), run_ranks(step, 2, "llama", False, False, False,
                                                                              frozen)
    for a, b in zip(on, off):
        assert a["kept"] == b["kept"] - product_bytes("llama", 2, 4) // 2, (a["kept"], b["kept"])
        assert torch.equal(a["loss"], b["loss"]) and not any(frozen in n for n in a["grads"])
        unequal = [n for n, g in b["grads"].items() if not torch.equal(a["grads"][n], g)]
        assert not unequal, unequal


def hooked(rank: int, world: int) -> dict:
    """A gradient hook on every down_proj's input (the product), put there by a forward pre-hook as inspection tools
    do: it must fire, with the product's gradient."""
    model = autotp.wrap(tiny_model("llama"), world)
    seen: list[torch.Tensor] = []

    def watch(module: torch.nn.Module, args: tuple) -> None:
        args[0].register_hook(seen.append)

    for name, module in model.named_modules():
        if name.endswith("down_proj"):
            module.register_forward_pre_hook(watch)
    ids = batch(size=IDS)
    model(input_ids=ids, labels=ids).loss.backward()
    return {"grads": len(seen), "layers": model.config.num_hidden_layers}


def test_a_hook_on_the_product_keeps_the_plain_path_and_fires() -> None:
    for report in run_ranks(hooked, 2):
        assert report["grads"] == report["layers"], report
