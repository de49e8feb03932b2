"""`autotp plan` and `autotp verify` from the command line, run in this process (conftest's `autotp_cli`;
tests/package/test_cli_errors.py runs `python -m autotp` itself)."""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path

import pytest
import torch

import autotp
from autotp.cli import build, load_config
from autotp.testing.spawn import run_ranks

BROKEN_QWEN3 = """
model_types = ["qwen3"]
[[attention]]
match = "model.layers.*.self_attn"
heads = "num_attention_heads"
kv_heads = "num_key_value_heads"
column = { q_proj = "q", k_proj = "k", v_proj = "v" }
row = { o_proj = "q" }
# head_norms left out on purpose: q_norm / k_norm gradients then miss their all-reduce
"""


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
    assert (
        text.returncode == 0 and "zero 0:" in text.stdout and "zero 3:" in text.stdout and "zero 2:" not in text.stdout
    )


# --- autotp plan / verify: progress, --dtype, no relayed transformers warnings -----------------------------------


class TransformersRelay(logging.Handler):
    """Collects what transformers logs (its library logger does not propagate, so caplog never sees it)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_cli(capsys, monkeypatch, *argv: str) -> tuple[int, str, str, list[str]]:
    """`autotp.cli.main(argv)` in this process, its stderr a terminal (progress is shown only there): (exit code,
    stdout, stderr, what transformers logged or warned)."""
    from autotp.cli import main

    relay, library = TransformersRelay(), logging.getLogger("transformers")
    library.addHandler(relay)
    capsys.readouterr()
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            code = main(list(argv))
    finally:
        library.removeHandler(relay)
    out, err = capsys.readouterr()
    relayed = relay.messages + [str(w.message) for w in caught if "/transformers/" in w.filename]
    return code, out, err, relayed


@pytest.mark.timeout(120)
def test_plan_shows_progress_and_relays_no_transformers_warnings(capsys, monkeypatch) -> None:
    code, out, err, relayed = run_cli(
        capsys, monkeypatch, "plan", "bert", "--tp", "2"
    )  # BERT warned about is_decoder 3 times
    assert code == 0 and relayed == [], relayed
    assert "autotp plan: building bert on the meta device in float32" in err and "planning at tp 2" in err, err
    assert "sizes in float32 (--dtype)" in out


@pytest.mark.timeout(120)
def test_plan_sizes_follow_dtype_not_the_configs_torch_dtype(capsys, monkeypatch, tmp_path: Path) -> None:
    """A released config says torch_dtype bfloat16: the default sizes stay float32, and --dtype chooses."""
    import json

    from transformers import AutoModelForCausalLM

    from autotp.testing import tiny_config

    config = tiny_config("llama")
    config.dtype = torch.bfloat16
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(tiny_config("llama")).parameters())
    sizes = {}
    for dtype in ("default", "bfloat16", "float16", "float32"):
        code, out, _, _ = run_cli(
            capsys,
            monkeypatch,
            "plan",
            str(tmp_path),
            "--tp",
            "2",
            "--json",
            *(["--dtype", dtype] if dtype != "default" else []),
        )
        info = json.loads(out)
        sizes[dtype] = (code, info["dtype"], info["unsharded_param_bytes"])
    assert sizes == {
        "default": (0, "float32", 4 * numel),
        "float32": (0, "float32", 4 * numel),
        "bfloat16": (0, "bfloat16", 2 * numel),
        "float16": (0, "float16", 2 * numel),
    }, sizes


@pytest.mark.timeout(180)
def test_verify_shows_progress_and_relays_no_transformers_warnings(capsys, monkeypatch) -> None:
    """The ranks are forked: what they log is not collected here, only what this process does before them."""
    code, out, err, relayed = run_cli(capsys, monkeypatch, "verify", "bert", "--tp", "2", "--steps", "1")
    assert code == 0 and "OK:" in out and relayed == [], (out, relayed)
    assert "autotp verify: building bert" in err and "training 1 steps on 2 CPU ranks" in err, err


def ep_bytes(rank: int, world: int, model_type: str) -> int:
    torch.manual_seed(0)
    model = autotp.wrap(build(load_config(model_type)), world, ep_size=world)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_plan_ep_bytes_equal_the_real_bytes_after_wrap(autotp_cli) -> None:
    """`--ep 2` at tp 2: each rank's bytes (TP-sharded dense layers, half the experts whole) as wrap leaves them, and
    the token all-to-alls of one step: 4 per MoE layer (out and back, forward and backward)."""
    done = autotp_cli("plan", "qwen3_moe", "--tp", "2", "--ep", "2", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    experts = info["experts"]
    assert run_ranks(ep_bytes, 2, "qwen3_moe") == experts["param_bytes_per_rank"]
    assert experts["expert_bytes_per_rank"] * 2 == experts["expert_bytes"]
    config = load_config("qwen3_moe")
    rows = 4 * 128 // 2 * config.num_experts_per_tok * config.hidden_size * 4  # batch x seq over tp 2, fp32
    assert experts["all_to_alls_per_step"] == 4 * config.num_hidden_layers
    assert experts["all_to_all_bytes_per_step"] == 4 * config.num_hidden_layers * rows // 2
    assert not [c for c in info["collectives"] if "experts" in c["where"]]  # no TP reductions of the experts
    text = autotp_cli("plan", "qwen3_moe", "--tp", "2", "--ep", "2")
    assert text.returncode == 0 and "at tp 2 x ep 2: experts" in text.stdout


def test_plan_at_ep_prices_the_experts_split_by_expert(autotp_cli) -> None:
    """`--tp 1 --ep 2 --dp 4`: the per-rank bytes, the training state and every ZeRO row hold half the experts
    (FSDP shards them over expert-DP, 4 / 2 = 2 ranks; the dense layers over DP 4), and the text shows the experts
    whole, split by expert, where the plan at ep 1 would slice each by width."""
    done = autotp_cli("plan", "qwen3_moe", "--tp", "1", "--ep", "2", "--dp", "4", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    experts = info["experts"]
    held = experts["param_bytes_per_rank"][0]
    assert info["param_bytes_per_rank"] == [held] and info["train_state_bytes_per_rank"] == [4 * held]
    assert held < info["unsharded_param_bytes"] - experts["expert_bytes_per_rank"] // 2
    dense, mine = held - experts["expert_bytes_per_rank"], experts["expert_bytes_per_rank"]
    zero = {int(k): v for k, v in info["zero_bytes_per_rank"].items()}
    assert zero[0]["total"] == 4 * held and "allreduce_gradients" in zero[0]["runs"]
    assert zero[3]["total"] == 4 * (-(-dense // 4) + -(-mine // 2)), zero[3]
    text = autotp_cli("plan", "qwen3_moe", "--tp", "1", "--ep", "2", "--dp", "4")
    assert "whole experts per rank (split by expert over ep 2)" in text.stdout, text.stdout
    assert "width" not in text.stdout and "experts over ep 2 x expert-DP 2" in text.stdout, text.stdout
