"""`autotp plan` and `autotp verify` from the command line, run in this process (conftest's `autotp_cli`;
tests/package/test_cli_errors.py runs `python -m autotp` itself)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import autotp
from autotp.cli import build, load_config
from autotp.testing.spawn import run_ranks

BROKEN_QWEN3 = '''
model_types = ["qwen3"]
[[attention]]
match = "model.layers.*.self_attn"
heads = "num_attention_heads"
kv_heads = "num_key_value_heads"
column = { q_proj = "q", k_proj = "k", v_proj = "v" }
row = { o_proj = "q" }
# head_norms left out on purpose: q_norm / k_norm gradients then miss their all-reduce
'''


def real_bytes(rank: int, world: int, model_type: str) -> int:
    torch.manual_seed(0)
    model = autotp.wrap(build(load_config(model_type)), world)
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "phi3", "mixtral"])
def test_plan_bytes_equal_the_real_bytes_after_wrap(autotp_cli, model_type: str) -> None:
    done = autotp_cli("plan", model_type, "--tp", "2", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["layers"] and info["collectives"]
    assert run_ranks(real_bytes, 2, model_type) == info["param_bytes_per_rank"]
    text = autotp_cli("plan", model_type, "--tp", "2")
    assert text.returncode == 0 and "collectives per training step" in text.stdout


def test_verify_passes_on_a_correct_model(autotp_cli) -> None:
    done = autotp_cli("verify", "qwen3", "--tp", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK:" in done.stdout


def test_verify_fails_and_names_the_parameter_when_a_reduction_is_skipped(autotp_cli, tmp_path: Path) -> None:
    policy = tmp_path / "broken.toml"
    policy.write_text(BROKEN_QWEN3)
    done = autotp_cli("verify", "qwen3", "--tp", "2", "--policy", str(policy))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "MISMATCH" in done.stdout and "_norm.weight" in done.stdout.split("MISMATCH")[1]


def test_plan_builds_the_task_the_model_type_has(autotp_cli) -> None:
    """No --task: a vision-language type is built as one, and both its sub-models show sharded."""
    done = autotp_cli("plan", "llava", "--tp", "2", "--json")
    assert done.returncode == 0, done.stderr
    paths = [layer["path"] for layer in json.loads(done.stdout)["layers"]]
    assert any(p.startswith("model.vision_tower.") for p in paths)
    assert any(p.startswith("model.language_model.") for p in paths)


def test_verify_seq2seq_task(autotp_cli) -> None:
    done = autotp_cli("verify", "bart", "--tp", "2", "--task", "seq2seq", "--steps", "1")
    assert done.returncode == 0 and "OK:" in done.stdout, done.stdout + done.stderr


def fsdp_bytes(rank: int, world: int, model_type: str) -> int:
    torch.manual_seed(0)
    model = autotp.fully_shard(autotp.wrap(build(load_config(model_type)), 2))
    return sum(p.to_local().numel() * p.element_size() for p in model.parameters())


def test_plan_prices_zero_stages_and_zero_3_is_what_fully_shard_holds(autotp_cli) -> None:
    done = autotp_cli("plan", "llama", "--tp", "2", "--dp", "2", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    zero = {int(k): v for k, v in info["zero_bytes_per_rank"].items()}
    params = max(info["param_bytes_per_rank"])
    assert zero[0]["total"] == 4 * params and zero[3]["total"] == 4 * params // 2
    assert zero[2]["params"] == params and zero[2]["grads"] == params // 2
    real = max(run_ranks(fsdp_bytes, 4, "llama"))  # FSDP splits each tensor by rows, so a rank may hold a few more
    assert zero[3]["params"] <= real <= 1.05 * zero[3]["params"], (real, zero[3])
    text = autotp_cli("plan", "llama", "--tp", "2", "--dp", "2", "--zero", "3")
    assert text.returncode == 0 and "zero 0:" in text.stdout and "zero 3:" in text.stdout and "zero 2:" not in text.stdout
