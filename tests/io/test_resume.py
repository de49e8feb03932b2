"""Resumable checkpoints: bit-identical resume, consolidation, resharding and clear errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM

import autotp
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model
from resume_workers import resume_layout


def make(tp: int, seed: int = 0):
    model = autotp.wrap(tiny_model("llama", seed=seed), tp)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def train(model, optimizer, scheduler, steps: int) -> list[float]:
    """Batches come from torch's global RNG, so resuming must restore it too."""
    dp = model.autotp_state.dp_group
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 16))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if dp is not None:  # data parallel: average over the replicas
            for p in model.parameters():
                dist.all_reduce(p.grad, group=dp)
                p.grad /= dist.get_world_size(dp)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def straight(rank: int, world: int, tp: int) -> dict:
    torch.manual_seed(100 + rank // tp)  # each data-parallel replica draws its own data
    model, optimizer, scheduler = make(tp)
    losses = train(model, optimizer, scheduler, 6)
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def first_half(rank: int, world: int, tp: int, directory: str) -> list[float]:
    torch.manual_seed(100 + rank // tp)
    model, optimizer, scheduler = make(tp)
    losses = train(model, optimizer, scheduler, 3)
    autotp.save_checkpoint(directory, model, optimizer, scheduler, step=3, data_position=3 * 2)
    return losses


def second_half(rank: int, world: int, tp: int, directory: str) -> dict:
    torch.manual_seed(999)  # whatever: the checkpoint's RNG state must win
    model, optimizer, scheduler = make(tp, seed=42)  # different initial weights: the checkpoint's must win
    state = autotp.load_checkpoint(directory, model, optimizer, scheduler)
    losses = train(model, optimizer, scheduler, 3)
    return {"user": state, "losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


@pytest.mark.parametrize("tp,world", [(2, 2), pytest.param(2, 4, marks=pytest.mark.slow)])
def test_resume_is_bit_identical(tmp_path: Path, tp: int, world: int) -> None:
    whole = run_ranks(straight, world, tp)
    halves = run_ranks(first_half, world, tp, str(tmp_path / "ckpt"))
    resumed = run_ranks(second_half, world, tp, str(tmp_path / "ckpt"))  # new processes
    for rank in range(world):
        assert resumed[rank]["user"] == {"step": 3, "data_position": 6}
        assert halves[rank] + resumed[rank]["losses"] == whole[rank]["losses"]  # exact float equality
        for key, tensor in whole[rank]["state"].items():
            assert torch.equal(resumed[rank]["state"][key], tensor), f"rank {rank}: {key} differs"


def save_both(rank: int, world: int, ckpt: str, full: str) -> None:
    model, optimizer, scheduler = make(world)
    torch.manual_seed(1)
    train(model, optimizer, scheduler, 2)
    autotp.save_checkpoint(ckpt, model, optimizer, scheduler, step=2)
    autotp.save_pretrained(model, full)


def test_consolidate_equals_save_pretrained(autotp_cli, tmp_path: Path) -> None:
    run_ranks(save_both, 4, str(tmp_path / "ckpt"), str(tmp_path / "full"))
    done = autotp_cli("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "consolidated"))
    assert done.returncode == 0, done.stderr
    from safetensors.torch import load_file

    for name in ("model.safetensors",):
        ours, theirs = load_file(tmp_path / "consolidated" / name), load_file(tmp_path / "full" / name)
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    assert json.loads((tmp_path / "consolidated" / "config.json").read_text()) == json.loads(
        (tmp_path / "full" / "config.json").read_text()
    )


def bf16_with_fp32_norms() -> torch.nn.Module:
    """A bf16 Llama whose RMSNorms stay fp32, as transformers' `_keep_in_fp32_modules` leaves the modules it names."""
    model = tiny_model("llama").to(torch.bfloat16)
    for name, module in model.named_modules():
        if name.endswith("norm"):
            module.float()
    return model


def save_mixed_dtypes(rank: int, world: int, ckpt: str) -> None:
    model = autotp.wrap(bf16_with_fp32_norms(), world)
    autotp.save_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()))


def test_consolidate_keeps_each_tensors_dtype(tmp_path: Path) -> None:
    """Saved at tp=2, consolidated: bit-equal to transformers' `save_pretrained` of the same model in one process, fp32
    norms beside bf16 weights."""
    from safetensors.torch import load_file

    run_ranks(save_mixed_dtypes, 2, str(tmp_path / "ckpt"))
    autotp.consolidate(tmp_path / "ckpt", tmp_path / "consolidated")
    bf16_with_fp32_norms().save_pretrained(tmp_path / "full")
    ours = load_file(tmp_path / "consolidated" / "model.safetensors")
    theirs = load_file(tmp_path / "full" / "model.safetensors")
    assert {theirs[k].dtype for k in theirs} == {torch.bfloat16, torch.float32}
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    with autotp.GatherReplacedLayerParams(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def save_under_ddp(rank: int, world: int, ckpt: str) -> dict[str, torch.Tensor]:
    """One AdamW step of a tp=2 model under DDP over its DP group, as a user's loop holds it; saved through DDP."""
    from torch.nn.parallel import DistributedDataParallel

    model = autotp.wrap(tiny_model("llama"), world)
    ddp = DistributedDataParallel(model, process_group=autotp.dp_group(model))
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    ids = batch()
    ddp(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    autotp.save_checkpoint(ckpt, ddp, optimizer, step=1)
    return full_weights(model)


def resume_without_ddp(rank: int, world: int, ckpt: str) -> dict[str, torch.Tensor]:
    model = autotp.wrap(tiny_model("llama", seed=7), world)
    assert autotp.load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters())) == {"step": 1}
    return full_weights(model)


def test_a_checkpoint_saved_through_ddp_resumes_without_it_and_consolidates(tmp_path: Path) -> None:
    """DDP's `module.` prefix is not the model's: the checkpoint names tensors as the model inside does."""
    from safetensors.torch import load_file

    saved = run_ranks(save_under_ddp, 2, str(tmp_path / "ckpt"))[0]
    assert all(torch.equal(saved[n], t) for n, t in run_ranks(resume_without_ddp, 2, str(tmp_path / "ckpt"))[0].items())
    autotp.consolidate(tmp_path / "ckpt", tmp_path / "full")
    full = load_file(tmp_path / "full" / "model.safetensors")
    assert full.keys() == saved.keys()
    assert all(torch.equal(full[n], saved[n]) for n in full)


def save_lora(rank: int, world: int, ckpt: str) -> None:
    model, optimizer, _ = resume_layout("lora", world, False, seed=0)
    autotp.save_checkpoint(ckpt, model, optimizer)


def test_consolidate_of_a_lora_checkpoint_names_peft_and_the_way_out(tmp_path: Path) -> None:
    run_ranks(save_lora, 2, str(tmp_path / "ckpt"))
    with pytest.raises(autotp.CheckpointError) as err:
        autotp.consolidate(tmp_path / "ckpt", tmp_path / "full")
    message = str(err.value)
    assert "PEFT adapters (tensor base_model.model.model.layers.0." in message, message
    assert "autotp.load_checkpoint" in message and "merge_and_unload()" in message, message
    assert "peft_model.save_pretrained(DIR)" in message, message
    assert not (tmp_path / "full").exists()


def logits_at(rank: int, world: int, path: str) -> torch.Tensor:
    model = autotp.from_pretrained(path, world)
    with torch.no_grad():
        return model(batch()).logits


@pytest.mark.slow  # 4 ranks; resuming at another layout stays quick
def test_reshard_tp4_checkpoint_to_tp2_and_plain(tmp_path: Path) -> None:
    run_ranks(save_both, 4, str(tmp_path / "ckpt"), str(tmp_path / "full"))
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "full")
    with torch.no_grad():
        expected = plain(batch()).logits
    for logits in run_ranks(logits_at, 2, str(tmp_path / "full")):
        # fp32: tp=2 sums its partial matmuls in another order than one process does.
        assert (logits - expected).abs().max().item() <= 1e-5


@pytest.fixture
def sharded_checkpoint(tmp_path: Path) -> Path:
    tiny_model("llama").save_pretrained(tmp_path / "ck", max_shard_size="60KB")
    return tmp_path / "ck"


def test_missing_shard_file_is_named(sharded_checkpoint: Path) -> None:
    victim = sorted(sharded_checkpoint.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(
        autotp.CheckpointError, match=f"{victim.name}: listed in model.safetensors.index.json but missing"
    ):
        autotp.from_pretrained(sharded_checkpoint, 1)


def test_truncated_file_is_named(sharded_checkpoint: Path) -> None:
    victim = sorted(sharded_checkpoint.glob("model-*.safetensors"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 100])
    with pytest.raises(autotp.CheckpointError, match=f"{victim.name}: truncated"):
        autotp.from_pretrained(sharded_checkpoint, 1)


def test_corrupt_header_is_named(sharded_checkpoint: Path) -> None:
    victim = sorted(sharded_checkpoint.glob("model-*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    data[8:16] = b"\x00garbage"
    victim.write_bytes(bytes(data))
    with pytest.raises(autotp.CheckpointError, match=f"{victim.name}: corrupt safetensors header"):
        autotp.from_pretrained(sharded_checkpoint, 1)


def test_shape_that_disagrees_with_config_is_named(sharded_checkpoint: Path) -> None:
    config = json.loads((sharded_checkpoint / "config.json").read_text())
    config["intermediate_size"] = 128
    (sharded_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        autotp.CheckpointError,
        match=r"tensor model.layers.0.mlp.\w+_proj.weight has shape \(96, 64\), "
        r"the config implies \(128, 64\)",
    ):
        autotp.from_pretrained(sharded_checkpoint, 1)


def test_pickle_checkpoints_are_refused(tmp_path: Path) -> None:
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(autotp.CheckpointError, match="autotp loads only safetensors"):
        autotp.from_pretrained(tmp_path, 1)


SAVER = textwrap.dedent("""
    import sys, torch, autotp
    from transformers import LlamaConfig, AutoModelForCausalLM
    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=8000)
    model = autotp.wrap(AutoModelForCausalLM.from_config(config), 1)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    optimizer.step()
    autotp.save_checkpoint(sys.argv[1], model, optimizer, step=int(sys.argv[2]))
    print("saved", flush=True)
    if sys.argv[3] == "again":
        autotp.save_checkpoint(sys.argv[1], model, optimizer, overwrite=True, step=int(sys.argv[2]) + 1,
                               async_save=sys.argv[4] == "async")
        autotp.finish()
""")


@pytest.mark.slow  # a subprocess killed mid-save; test_io_faults.py's killed swaps stay quick
@pytest.mark.parametrize("how", ["sync", "async"])
def test_killed_save_keeps_the_previous_checkpoint(tmp_path: Path, how: str) -> None:
    target = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(
        [sys.executable, "-c", SAVER, str(target), "7", "again", how], stdout=subprocess.PIPE, env=env
    )
    assert proc.stdout.readline().strip() == b"saved"
    deadline = time.monotonic() + 60
    started = False
    while time.monotonic() < deadline and not started:  # the second save has begun writing: kill it
        started = any(d.is_dir() and any(d.rglob("*.distcp")) for d in tmp_path.glob(".ckpt.autotp-*"))
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert started, "the second save finished before it could be interrupted"
    meta = json.loads((target / "autotp_checkpoint.json").read_text())
    assert meta["state"] == {"step": 7}, "the previous checkpoint must still be the one in place"
    model = autotp.wrap(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target)), 1)
    assert autotp.load_checkpoint(target, model) == {"step": 7}


def test_existing_targets_need_overwrite(autotp_cli, tmp_path: Path) -> None:
    run_ranks(save_both, 2, str(tmp_path / "ckpt"), str(tmp_path / "full"))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("keep me")
    done = autotp_cli("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert done.returncode == 2 and "exists and is not empty; pass --overwrite" in done.stderr  # the CLI names its flag
    assert (tmp_path / "out" / "notes.txt").read_text() == "keep me"
    model, optimizer, _ = make(1)
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        autotp.save_checkpoint(tmp_path / "ckpt", model, optimizer, step=1)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "a refused save left files"
