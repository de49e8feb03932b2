"""Bad input to `autotp plan|verify|consolidate`: one line on stderr, exit code 2, never a traceback.

The commands run in this process (`autotp.cli.main`, through conftest's `autotp_cli`); one test runs
`python -m autotp` itself, for the exit code the shell sees.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import autotp
from autotp.cli import build_parser, cli_wording, main
from autotp.testing import run_ranks
from ep_workers import moe_model
from models import tiny_model


def one_line_error(done, command: str) -> str:
    """The single stderr line of a command refused with exit code 2 (a `CliResult` or a finished subprocess)."""
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"autotp {command}: "), lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "content, expected",
    [
        ("garbage {", "not a JSON config"),
        (json.dumps({"hidden_size": 64}), "no model_type"),
        (json.dumps({"model_type": "no_such_type"}), "unknown model_type 'no_such_type'"),
    ],
)
def test_plan_refuses_a_file_that_is_not_a_config(autotp_cli, tmp_path: Path, content: str, expected: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(content)
    line = one_line_error(autotp_cli("plan", str(config), "--tp", "2"), "plan")
    assert str(config) in line and expected in line


def test_plan_refuses_an_unknown_model_type(autotp_cli) -> None:
    line = one_line_error(autotp_cli("plan", "no_such_type", "--tp", "2"), "plan")
    assert "no_such_type" in line and "not a transformers model type" in line


def test_plan_refuses_a_directory_without_config(autotp_cli, tmp_path: Path) -> None:
    line = one_line_error(autotp_cli("plan", str(tmp_path), "--tp", "2"), "plan")
    assert "without config.json" in line


@pytest.mark.parametrize("command", ["plan", "verify"])
def test_a_model_without_a_text_head_is_refused(autotp_cli, command: str) -> None:
    line = one_line_error(autotp_cli(command, "vit", "--tp", "2"), command)
    assert "'vit' has no AutoModelForCausalLM class" in line and "--task" in line


def test_a_task_the_model_lacks_is_refused(autotp_cli) -> None:
    line = one_line_error(autotp_cli("plan", "llama", "--tp", "2", "--task", "seq2seq"), "plan")
    assert "'llama' has no AutoModelForSeq2SeqLM class" in line


def test_plan_names_a_policy_file_that_is_not_toml(autotp_cli, tmp_path: Path) -> None:
    policy = tmp_path / "broken.toml"
    policy.write_text("model_types = [")
    line = one_line_error(autotp_cli("plan", "llama", "--tp", "2", "--policy", str(policy)), "plan")
    assert str(policy) in line and "not valid TOML" in line


@pytest.mark.parametrize("command, tp", [("plan", "0"), ("plan", "-1"), ("verify", "0"), ("verify", "-1")])
def test_tp_below_one_is_a_usage_error(capsys: pytest.CaptureFixture[str], command: str, tp: str) -> None:
    with pytest.raises(SystemExit) as stopped:  # argparse's usage error
        main([command, "llama", "--tp", tp])
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last == f"autotp {command}: error: argument --tp: must be at least 1, got {tp}"


def test_consolidate_names_the_missing_metadata_key(autotp_cli, tmp_path: Path) -> None:
    (tmp_path / "autotp_checkpoint.json").write_text(json.dumps({"format": "autotp-checkpoint/1"}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    line = one_line_error(autotp_cli("consolidate", str(tmp_path), str(tmp_path / "out")), "consolidate")
    assert str(tmp_path / "autotp_checkpoint.json") in line and "'tp_size'" in line


def test_consolidate_refuses_a_checkpoint_without_config(autotp_cli, tmp_path: Path) -> None:
    meta = {"format": "autotp-checkpoint/1", "tp_size": 2, "world_size": 2, "partitions": {}}
    (tmp_path / "autotp_checkpoint.json").write_text(json.dumps(meta))
    line = one_line_error(autotp_cli("consolidate", str(tmp_path), str(tmp_path / "out")), "consolidate")
    assert "no config.json" in line


def test_consolidate_refuses_a_missing_directory(autotp_cli, tmp_path: Path) -> None:
    line = one_line_error(autotp_cli("consolidate", str(tmp_path / "absent"), str(tmp_path / "out")), "consolidate")
    assert f"{tmp_path / 'absent'}: no such directory" in line


def test_every_option_and_positional_has_help() -> None:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == {"plan", "verify", "consolidate"}
    for name, p in [("autotp", parser), *sub.choices.items()]:
        for action in p._actions:
            if not isinstance(action, argparse._HelpAction):
                assert action.help, f"{name}: {action.dest} has no help text"


def test_verify_says_so_when_nothing_is_sharded(autotp_cli, tmp_path: Path) -> None:
    # a policy of the user's with no rule keeps every block of XLNet whole (the shipped policy splits its feed-forward)
    policy = tmp_path / "whole.toml"
    policy.write_text('description = "XLNet kept whole"\nmodel_types = ["xlnet"]\n')
    done = autotp_cli("verify", "xlnet", "--tp", "2", "--steps", "1", "--policy", str(policy))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NOTHING SHARDED: every layer of xlnet stays replicated at tp=2" in done.stdout
    assert "OK:" not in done.stdout


@pytest.mark.slow  # a fresh interpreter importing torch and transformers; the same messages are checked in-process above
def test_python_m_autotp_reports_bad_input_in_one_line_with_exit_code_2() -> None:
    """The module entry point itself (`python -m autotp`): main's exit code reaches the shell, no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "autotp", "plan", "no_such_type", "--tp", "2"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    line = one_line_error(done, "plan")
    assert "no_such_type" in line and "not a transformers model type" in line


# --- the command line names its own flags -----------------------------------------------------------------------------


def test_cli_messages_name_the_flags_not_the_keyword_arguments(autotp_cli, tmp_path: Path) -> None:
    model = autotp.wrap(tiny_model("llama"), tp_size=1)  # tp 1: no process group
    autotp.save_checkpoint(tmp_path / "ckpt", model, torch.optim.AdamW(model.parameters()))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept.txt").write_text("kept")
    refused = autotp_cli("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"))
    assert (
        refused.returncode == 2 and "pass --overwrite to replace it" in refused.stderr and "=True" not in refused.stderr
    )
    assert autotp_cli("consolidate", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--overwrite").returncode == 0
    uneven = autotp_cli("plan", "llama", "--tp", "3")
    assert uneven.returncode == 2 and "over --tp 3" in uneven.stderr and "tp_size" not in uneven.stderr, uneven.stderr


def test_cli_max_shard_size_is_checked_by_the_parser(capsys, tmp_path: Path) -> None:
    from autotp.cli import main

    with pytest.raises(SystemExit):
        main(["consolidate", str(tmp_path), str(tmp_path / "out"), "--max-shard-size", "5 gigs"])
    err = capsys.readouterr().err
    assert "argument --max-shard-size: a size such as 5GB" in err and "'5 gigs'" in err, err


# --- plan refuses the layouts wrap refuses ------------------------------------------------------------------------------


def wrap_refusal(rank: int, world: int, tp: int, ep: int) -> str:
    """wrap's own refusal of tp x ep on this world, the model left as it was."""
    model = moe_model("qwen3_moe")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError) as err:
        autotp.wrap(model, tp, ep_size=ep, timeout=20)
    assert not autotp.tp.apply.parallel_layers(model)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp, ep, dp", [(1, 2, 3), (2, 4, 1)], ids=["ep2-world3", "ep4-world2"])
def test_plan_refuses_an_ep_layout_wrap_refuses_with_wraps_error(autotp_cli, tp: int, ep: int, dp: int) -> None:
    """Before, `plan --ep 2 --dp 3` (world 3) and `--tp 2 --ep 4 --dp 1` (world 2) printed a plan that wrap refuses."""
    refusals = set(run_ranks(wrap_refusal, tp * dp, tp, ep))
    assert len(refusals) == 1 and f"ep_size={ep} must divide the world size {tp * dp}" in next(iter(refusals))
    line = one_line_error(autotp_cli("plan", "qwen3_moe", "--tp", str(tp), "--ep", str(ep), "--dp", str(dp)), "plan")
    assert line == f"autotp plan: {cli_wording(next(iter(refusals)))}", line
    assert f"--ep {ep} must divide the world size {tp * dp}" in line
