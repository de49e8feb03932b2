"""LoRA added after `wrap`: PEFT draws each adapter at its layer's full size, as one process does, and autotp splits it
at once (`autotp.tp.lora.build_adapter`). So a script seeded like a one-process script gets the one-process
adapters, bit for bit, before any forward (GatherReplacedLayerParams shows them whole), and the adapters PEFT draws
after them too (the random stream advanced as in one process). Each rank compares with its own one-process run of
the same script: same seed, same calls, no values copied from one run to the other.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

import autotp
from autotp.runtime.replicas import check_replicas
from autotp.testing.parity import LOSS_ATOL, PARAM_ATOL, full_tensor
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model, train_steps

LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config(init) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, target_modules=LLAMA_ALL, lora_dropout=0.0, init_lora_weights=init)


def script(world: int, init, model_config: dict) -> torch.nn.Module:
    """What a user writes: seed, build, (wrap at world > 1), get_peft_model, add a second adapter."""
    torch.manual_seed(0)
    model = tiny_model("llama", **model_config)
    if world > 1:
        autotp.wrap(model, world)
    peft_model = get_peft_model(model, config(init))
    peft_model.add_adapter("second", config(init))
    return peft_model


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if "lora_" in name}


def before_any_forward(rank: int, world: int, init, model_config: dict) -> dict:
    """The adapters right after get_peft_model, gathered, against one process's; and the shards each rank holds."""
    expected = adapters(script(1, init, model_config))
    model = script(world, init, model_config)
    inner = model.base_model.model
    held = {
        name: (tuple(p.shape), hasattr(p, "autotp_shard")) for name, p in model.named_parameters() if "lora_" in name
    }
    with autotp.GatherReplacedLayerParams(inner):
        gathered = adapters(model)
    check_replicas(inner)  # the replicated halves are equal on every TP rank
    differ = sorted(
        n for n in expected if gathered[n].shape != expected[n].shape or not torch.equal(gathered[n], expected[n])
    )
    q = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.default.weight"
    down = "base_model.model.model.layers.0.mlp.down_proj.lora_{}.default.weight"
    return {
        "differ": differ,
        "count": len(expected),
        "names": set(gathered) == set(expected),
        "q": (held[q.format("A")], held[q.format("B")]),
        "down": (held[down.format("A")], held[down.format("B")]),
        "full_out": expected[q.format("B")].shape[0],
        "full_in": expected[down.format("A")].shape[1],
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("init", [True, False, "gaussian"])
def test_adapters_added_after_wrap_are_the_one_process_adapters_before_any_forward(tp: int, init) -> None:
    """Bit-equal, gathered: both adapters on every target, lora_B of PEFT's default init included (zeros), and
    nn.Linear's own draw of both halves (init_lora_weights=False). Outside the context each rank holds its rows."""
    model_config = {"num_key_value_heads": 2} if tp == 4 else {}  # at tp 4, k/v rows replicated on 2 ranks
    for report in run_ranks(before_any_forward, tp, init, model_config):
        assert report["names"] and report["count"] == 2 * 2 * 2 * len(LLAMA_ALL), report
        assert report["differ"] == [], report
        (a_shape, a_split), (b_shape, b_split) = report["q"]  # column layer: lora_A whole, lora_B this rank's rows
        assert a_shape == (4, 64) and not a_split and b_shape == (report["full_out"] // tp, 4) and b_split, report
        (a_shape, a_split), (b_shape, b_split) = report["down"]  # row layer: lora_A this rank's columns, lora_B whole
        assert a_shape == (4, report["full_in"] // tp) and a_split and b_shape == (64, 4) and not b_split, report


def two_steps(rank: int, world: int) -> dict:
    """The same script at world ranks and in one process: 2 AdamW steps on the adapters, losses and final adapters."""
    runs = {}
    for size in (1, world):
        model = script(size, False, {})
        model.set_adapter("default")
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-2, eps=1e-6)
        ids = batch()
        losses = train_steps(model, optimizer, 2, input_ids=ids, labels=ids)
        group = autotp.tp_group(model.base_model.model) if size > 1 else None
        runs[size] = (
            losses,
            {
                n: full_tensor(p.detach(), p, group) if group else p.detach()
                for n, p in model.named_parameters()
                if "lora_" in n
            },
        )
    (ref_losses, ref), (losses, adapted) = runs[1], runs[world]
    return {
        "loss": max(abs(a - b) for a, b in zip(ref_losses, losses)),
        "param": max((adapted[n] - ref[n]).abs().max().item() for n in ref),
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_training_after_wrap_and_get_peft_model_matches_one_process(tp: int) -> None:
    """No values copied between the runs: both start from their own seeded draws. fp32, so only the order of sums
    differs (parity's tolerances)."""
    for report in run_ranks(two_steps, tp):
        assert report["loss"] <= LOSS_ATOL, report
        assert report["param"] <= PARAM_ATOL, report


def init_from_the_weight(rank: int, world: int) -> dict:
    """PiSSA computes the adapter from the base weight (and rewrites it): after wrap that weight is a shard."""
    model = autotp.wrap(tiny_model("llama"), world)
    before = {name: type(module) for name, module in model.named_modules()}
    try:
        get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="pissa"))
    except NotImplementedError as err:
        return {"error": str(err), "unchanged": before == {n: type(m) for n, m in model.named_modules()}}
    return {"error": "built", "unchanged": False}


@pytest.mark.timeout(60)
def test_an_init_computed_from_the_sharded_weight_is_refused_by_name() -> None:
    for report in run_ranks(init_from_the_weight, 2):
        assert "model.layers.0.self_attn.q_proj" in report["error"] and "'pissa'" in report["error"], report
        assert "before autotp.wrap" in report["error"] and report["unchanged"], report


def patch_lifetime(rank: int, world: int) -> list[bool]:
    """Whether PEFT's LoRA `update_layer` is autotp's: with a wrapped model alive, then once it is collected."""
    import gc

    from peft.tuners.lora import Linear

    model = get_peft_model(autotp.wrap(tiny_model("llama"), world), config(True))
    patched = ["update_layer" in vars(Linear)]
    del model
    gc.collect()
    return patched + ["update_layer" in vars(Linear)]


@pytest.mark.timeout(60)
def test_peft_builds_adapters_as_its_own_once_the_last_wrapped_model_is_gone() -> None:
    for patched in run_ranks(patch_lifetime, 2):
        assert patched == [True, False]


def copy_of_split_embedding(rank: int, world: int, modules_to_save: list[str]) -> dict:
    """get_peft_model(modules_to_save=[embed_tokens...]) on a vocab-parallel model: refused with nothing changed, and
    the same model then takes PEFT's LoRA with a copy of the LM head alone."""
    model = autotp.wrap(tiny_model("llama"), world)
    before = {name: type(module) for name, module in model.named_modules()}
    try:
        get_peft_model(model, LoraConfig(r=4, target_modules=LLAMA_ALL, modules_to_save=modules_to_save))
        message = "accepted"
    except NotImplementedError as err:
        message = str(err)
    unchanged = {name: type(module) for name, module in model.named_modules()} == before
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=LLAMA_ALL, modules_to_save=["lm_head"]))
    ids = batch()
    loss = peft_model(input_ids=ids, labels=ids).loss.item()
    return {"message": message, "unchanged": unchanged, "loss": loss}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("modules_to_save", [["embed_tokens"], ["embed_tokens", "lm_head"]])
def test_modules_to_save_of_the_vocab_parallel_embedding_is_refused_unchanged(modules_to_save: list[str]) -> None:
    """PEFT's copy of a vocab-split embedding failed deep in its deepcopy (cannot pickle ProcessGroup), after its
    LoRA layers were in the model; now refused by name at its first adapter, before anything changes."""
    for report in run_ranks(copy_of_split_embedding, 2, modules_to_save):
        assert "trainable copy of model.embed_tokens, which autotp.wrap split by vocabulary" in report["message"], (
            report
        )
        assert "Nothing was changed. Wrap with vocab_parallel=False" in report["message"]
        assert report["unchanged"] and report["loss"] > 0, report
