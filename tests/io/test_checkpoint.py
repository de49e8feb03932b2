"""`save_pretrained`: a full HF checkpoint that plain transformers loads, written atomically."""

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
from transformers import AutoModelForCausalLM

import autotp
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model


def train_and_save(rank: int, world: int, family: str, target: str, max_shard_size: str) -> dict | None:
    model = autotp.wrap(tiny_model(family), world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = batch()
    model(ids, labels=ids).loss.backward()
    opt.step()  # so the saved weights are not the ones a seed would rebuild
    autotp.save_pretrained(model, target, max_shard_size=max_shard_size)
    with autotp.GatherReplacedLayerParams(model):
        gathered = {k: v.clone() for k, v in model.state_dict().items()}
    return gathered if rank == 0 else None


@pytest.mark.parametrize("max_shard_size", ["5GB", "60KB"])
@pytest.mark.parametrize(
    "family,tp",
    [("llama", 2), pytest.param("gemma", 4, marks=pytest.mark.slow), pytest.param("qwen3", 4, marks=pytest.mark.slow)],
)
def test_save_loads_in_plain_transformers(tmp_path: Path, family: str, tp: int, max_shard_size: str) -> None:
    target = tmp_path / "out"
    gathered = run_ranks(train_and_save, tp, family, str(target), max_shard_size)[0]
    loaded, info = AutoModelForCausalLM.from_pretrained(target, output_loading_info=True)
    assert not any(info.values()), f"loading info not clean: {info}"
    state = loaded.state_dict()
    assert set(state) == set(gathered)
    for key, tensor in gathered.items():
        assert torch.equal(state[key], tensor), f"{key} differs after reload"

    # The files and index are laid out exactly as transformers lays out the same (unwrapped) model.
    expected = tmp_path / "by_transformers"
    plain = tiny_model(family)
    plain.load_state_dict(gathered)
    plain.save_pretrained(expected, max_shard_size=max_shard_size)

    def weights(d: Path) -> list[str]:
        return sorted(p.name for p in d.iterdir() if "safetensors" in p.name)

    assert weights(target) == weights(expected)
    if max_shard_size == "60KB":
        assert len(weights(target)) > 2, "the small shard size should force several files"
        ours, theirs = (json.loads((d / "model.safetensors.index.json").read_text()) for d in (target, expected))
        assert ours == theirs
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "temporary directory left behind"


def refuse_existing(rank: int, world: int, target: str) -> str:
    model = autotp.wrap(tiny_model("llama"), world)
    with pytest.raises(FileExistsError) as err:
        autotp.save_pretrained(model, target)
    autotp.save_pretrained(model, target, overwrite=True)
    return str(err.value)


def test_existing_directory_needs_overwrite(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    messages = run_ranks(refuse_existing, 2, str(target))
    assert all("overwrite=True" in m and str(target) in m for m in messages)
    assert not (target / "keep.txt").exists() and (target / "config.json").exists()


SAVER = textwrap.dedent("""
    import sys, torch, autotp
    from transformers import LlamaConfig, AutoModelForCausalLM
    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=8000)
    model = autotp.wrap(AutoModelForCausalLM.from_config(config), 1)
    print("ready", flush=True)
    autotp.save_pretrained(model, sys.argv[1], max_shard_size="4MB")
""")


@pytest.mark.slow  # a subprocess killed mid-save; test_io_faults.py's killed swaps stay quick
def test_crash_midway_leaves_no_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(target)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"ready"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until some shards are on disk, then kill hard
        partial = [f for d in tmp_path.glob(".out.autotp-*") for f in d.glob("*.safetensors")]
        if len(partial) >= 2:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(partial) >= 2, "the save finished before it could be interrupted"
    assert not target.exists(), "a killed save left the target directory in place"
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(target)


def test_into_existing_keeps_other_files_and_replaces_model_files(tmp_path: Path) -> None:
    target = tmp_path / "run"
    target.mkdir()
    (target / "trainer_state.json").write_text("{}")
    (target / "model-00001-of-00009.safetensors").write_text("stale shard of an earlier save")
    model = autotp.wrap(tiny_model("llama"), 1)
    autotp.save_pretrained(model, target, into_existing=True)
    assert (target / "trainer_state.json").read_text() == "{}"
    assert not (target / "model-00001-of-00009.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], "staging directory left behind"


# Transformers' own method on a wrapped model.


def hf_save(rank: int, world: int, target: str) -> dict | None:
    model = autotp.wrap(tiny_model("gemma"), world)
    with pytest.raises(ValueError) as err:
        model.save_pretrained(target, safe_serialization=False)
    refused_before_writing = not Path(target).exists()
    model.save_pretrained(target)  # transformers' method, as a user would call it, on every rank
    with autotp.GatherReplacedLayerParams(model):
        full = {k: v.clone() for k, v in model.state_dict().items()}
    return {"full": full, "error": str(err.value), "clean": refused_before_writing} if rank == 0 else None


def test_plain_save_pretrained_writes_the_full_checkpoint(tmp_path: Path) -> None:
    report = run_ranks(hf_save, 2, str(tmp_path / "out"))[0]
    assert report["clean"] and "safe_serialization" in report["error"]
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in report["full"].items())
