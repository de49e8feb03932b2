"""A gated MLP's `act(gate) * up` is recomputed in the row layer's backward (`autotp.tp.glu`): the block keeps gate and
up for the backward, not also act(gate) and the product. Loss and every gradient are those of `recompute_glu=False`
bit for bit: the recomputation runs the same kernels on the same tensors, and backward applies autograd's own
formulas in the same order."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.planning.sharding import Partition
from autotp.testing.memory import KeptForBackward
from autotp.testing.parity import full_tensor
from autotp.testing.spawn import run_ranks
from autotp.tp.block_entry import BlockEntry
from autotp.tp.glu import match
from models import batch, tiny_model

IDS = (2, 16)


def step(
    rank: int,
    world: int,
    family: str,
    recompute: bool,
    sequence_parallel: bool = False,
    bf16: bool = False,
    frozen: str = "",
) -> dict:
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
    return {
        "loss": loss.detach(),
        "kept": held,
        "grads": {n: full_tensor(p.grad, p, group) for n, p in model.named_parameters() if p.requires_grad},
    }


def product_bytes(family: str, world: int, itemsize: int) -> int:
    """act(gate) and the product, [batch, seq, ffn / tp] each, in every layer."""
    config = tiny_model(family).config
    return config.num_hidden_layers * 2 * IDS[0] * IDS[1] * config.intermediate_size // world * itemsize


@pytest.mark.parametrize(
    "family, world, sequence_parallel",
    [
        ("llama", 1, False),
        ("llama", 2, False),
        ("llama", 2, True),
        pytest.param("llama", 4, False, marks=pytest.mark.slow),
        ("gemma", 2, False),  # gelu (tanh) instead of silu
        # one gate_up_proj, chunked into gate and up (tp=1 is llama's: a group of one computes alike for both)
        ("phi3", 2, False),
        pytest.param("phi3", 4, False, marks=pytest.mark.slow),
    ],
)
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
    on, off = (
        run_ranks(step, 2, "llama", True, False, False, frozen),
        run_ranks(step, 2, "llama", False, False, False, frozen),
    )
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


# --- glu.match on hand-built autograd graphs (no process group) ------------------------------------------------


def recorded(*outputs: torch.Tensor):
    """A `column_output` for `match` that knows `outputs` as the column layers' outputs, as a block's entry records
    them: the tensor whose autograd edge is (node, output_nr)."""
    by_node = {id(t.grad_fn): t for t in outputs}

    def column_output(node, output_nr: int) -> torch.Tensor | None:
        found = by_node.get(id(node))
        return found if found is not None and found.grad_fn is node and found.output_nr == output_nr else None

    return column_output


def columns(width: int = 16, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Two column layers' outputs (gate, up) on one [2, 3, 8] input, [2, 3, width] each."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, generator=generator, dtype=dtype)
    gate_w, up_w = (torch.randn(width, 8, generator=generator, dtype=dtype).requires_grad_() for _ in range(2))
    return F.linear(x, gate_w), F.linear(x, up_w)


def silu_grad(z: torch.Tensor) -> torch.Tensor:
    """d silu(z) / dz = sigmoid(z) (1 + z (1 - sigmoid(z)))."""
    s = 1 / (1 + torch.exp(-z))
    return s * (1 + z * (1 - s))


def gelu_tanh(z: torch.Tensor) -> torch.Tensor:
    """0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3)))."""
    return 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))


def gelu_tanh_grad(z: torch.Tensor) -> torch.Tensor:
    inner = math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * z * (1 - t**2) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * z**2)


@pytest.mark.parametrize("order", ["act(gate) * up", "up * act(gate)"])
def test_match_finds_silu_of_gate_times_up_in_either_order(order: str) -> None:
    gate, up = columns()
    product = F.silu(gate) * up if order == "act(gate) * up" else up * F.silu(gate)
    found = match(product, recorded(gate, up))
    assert found is not None
    (forward, backward), got_gate, got_up = found
    assert got_gate is gate and got_up is up  # the recorded tensors themselves, not copies
    z = gate.detach()
    torch.testing.assert_close(forward(z), z / (1 + torch.exp(-z)))
    grad = torch.full_like(z, 0.5)
    torch.testing.assert_close(backward(grad, z), 0.5 * silu_grad(z))


def test_match_finds_tanh_gelu_and_keeps_its_approximation() -> None:
    gate, up = columns()
    found = match(F.gelu(gate, approximate="tanh") * up, recorded(gate, up))
    assert found is not None
    (forward, backward), got_gate, got_up = found
    assert got_gate is gate and got_up is up
    z = gate.detach()
    torch.testing.assert_close(forward(z), gelu_tanh(z))
    assert not torch.allclose(forward(z), F.gelu(z))  # not the exact (erf) gelu
    torch.testing.assert_close(backward(torch.ones_like(z), z), gelu_tanh_grad(z))


@pytest.mark.parametrize("dim", [-1, 2])
def test_match_splits_a_fused_gate_up_projection_chunked_in_halves(dim: int) -> None:
    """Phi-3's gate_up_proj: one column output [.., 2 * width], chunked; a negative dim (saved unsigned) as well."""
    fused, _ = columns(width=32)
    gate, up = fused.chunk(2, dim=dim)
    found = match(F.silu(gate) * up, recorded(fused))
    assert found is not None
    _, got_gate, got_up = found
    assert torch.equal(got_gate, fused[..., :16]) and torch.equal(got_up, fused[..., 16:])


def test_match_refuses_operands_of_different_shapes() -> None:
    gate, _ = columns(width=16)
    _, narrow = columns(width=1)  # [2, 3, 1], broadcast over the width
    product = F.silu(gate) * narrow
    assert product.shape == gate.shape
    assert match(product, recorded(gate, narrow)) is None


def test_match_refuses_a_product_not_of_recorded_outputs() -> None:
    gate, up = columns()
    assert match(F.silu(gate) * up, recorded(gate)) is None  # up unknown
    assert match(F.silu(gate) * up, recorded(up)) is None  # gate unknown
    assert match(F.silu(gate + 1) * up, recorded(gate, up)) is None  # the activation's input is not gate itself
    assert match(F.relu(gate) * up, recorded(gate, up)) is None  # an activation without a recompute rule
    assert match(gate * up, recorded(gate, up)) is None  # no activation at all
    assert match(F.silu(gate) + up, recorded(gate, up)) is None  # not a product


def test_match_refuses_an_upcast_in_between() -> None:
    gate, up = columns(dtype=torch.bfloat16)
    assert match(F.silu(gate) * up, recorded(gate, up)) is not None  # the same graph without the casts matches
    assert match(F.silu(gate.float()) * up.float(), recorded(gate, up)) is None
    assert match(F.silu(gate) * up.float(), recorded(gate, up)) is None


def test_match_leaves_a_product_with_a_gradient_hook_alone() -> None:
    gate, up = columns()
    product = F.silu(gate) * up
    product.register_hook(lambda grad: grad)
    assert match(product, recorded(gate, up)) is None


def test_column_and_row_layers_take_their_block_entry_under_one_name() -> None:
    """`LinearLayer(..., entry=)` and `LinearAllreduce(..., entry=)`: the same BlockEntry under one name (the row
    layer's `block_entry=`, its earlier name, still works)."""
    entry = BlockEntry(None)
    column = autotp.LinearLayer(nn.Linear(4, 6), Partition.even(0, 6, 1), None, entry=entry)
    row = autotp.LinearAllreduce(nn.Linear(6, 4), Partition.even(1, 6, 1), None, entry=entry)
    earlier = autotp.LinearAllreduce(nn.Linear(6, 4), Partition.even(1, 6, 1), None, block_entry=entry)
    assert column.entry is entry and row.entry is entry and earlier.entry is entry
