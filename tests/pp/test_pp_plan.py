"""`autotp plan --pp P`: each stage's parameter bytes (against what each rank trains after a real pipelined step),
the activations each schedule keeps in flight, the bubble and the bytes sent per step."""

from __future__ import annotations

import json

import pytest
import torch

import autotp
from autotp.cli import build, load_config
from autotp.testing.spawn import run_ranks


def trained_bytes(rank: int, world: int, specs: list[str]) -> dict[str, int]:
    """The bytes of the parameters this rank's stage trains (those a pipelined step gives a gradient), per model."""
    out = {}
    for spec in specs:
        torch.manual_seed(0)
        model = autotp.wrap(build(load_config(spec)), 1, pp_size=world, pp_microbatches=2)
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
        autotp.forward_backward(model, input_ids=ids, labels=ids)
        out[spec] = sum(p.numel() * p.element_size() for p in model.parameters() if p.grad is not None)
    return out


def test_stage_bytes_are_what_each_stage_trains(autotp_cli) -> None:
    """llama (head untied) and qwen2 (tied: the last stage holds the embedding's copy too) at pp 2."""
    specs = ["llama", "qwen2"]
    trained = run_ranks(trained_bytes, 2, specs)
    for spec in specs:
        done = autotp_cli("plan", spec, "--tp", "1", "--pp", "2", "--batch", "4", "--microbatches", "2", "--json")
        assert done.returncode == 0, done.stderr
        stages = json.loads(done.stdout)["pipeline"]["stages"]
        assert [s["param_bytes"] for s in stages] == [t[spec] for t in trained], (spec, stages, trained)
        assert [s["layers"] for s in stages] == [[0, 1], [1, 2]] and stages[0]["also"] == ["embedding"]


def test_schedules_in_flight_bubble_and_sends(autotp_cli, tmp_path) -> None:
    config = load_config("llama")
    config.num_hidden_layers = 4  # 2 stages per rank under Interleaved1F1B at pp 2
    config.save_pretrained(tmp_path)
    args = ("plan", str(tmp_path), "--tp", "1", "--pp", "2", "--batch", "8", "--microbatches", "4", "--seq", "16")
    done = autotp_cli(*args, "--json")
    assert done.returncode == 0, done.stderr
    pipeline = json.loads(done.stdout)["pipeline"]
    schedules = pipeline["schedules"]
    assert [schedules[s]["in_flight_microbatches"] for s in ("GPipe", "1F1B")] == [[4, 4], [2, 1]]
    # torch's Interleaved1F1B warm-up at P 2, M 4 (2 rounds of 2): 4 forwards on rank 0 and 2 on rank 1, plus one,
    # each through one of the rank's 2 stages
    assert schedules["Interleaved1F1B"]["in_flight_microbatches"] == [2.5, 1.5]
    assert schedules["1F1B"]["bubble"] == pytest.approx(1 / 5) and schedules["GPipe"]["bubble"] == pytest.approx(1 / 5)
    assert schedules["Interleaved1F1B"]["bubble"] == pytest.approx(1 / 9)
    hidden = 2 * 16 * config.hidden_size * 4  # one micro-batch's hidden states: 2 rows x 16 x hidden, fp32
    assert pipeline["sent_bytes_per_microbatch"] == hidden
    assert schedules["1F1B"]["sent_bytes_per_rank"] == [4 * hidden, 4 * hidden]  # forward from 0, gradients from 1
    assert schedules["Interleaved1F1B"]["sent_bytes_per_rank"] == [3 * 4 * hidden, 3 * 4 * hidden]  # 3 of 4 edges
    per_layer = pipeline["activation_bytes_per_layer_microbatch"]
    assert schedules["1F1B"]["activation_bytes_per_rank"] == [2 * 2 * per_layer, 1 * 2 * per_layer]
    text = autotp_cli(*args).stdout
    assert "1F1B: bubble 0.200; in flight per rank 2 / 1 micro-batches" in text, text
    assert "stage 1: layers 2-3 + final norm, head" in text, text


def test_bad_pipeline_input_is_one_line(autotp_cli) -> None:
    done = autotp_cli("plan", "llama", "--tp", "1", "--pp", "2", "--batch", "6", "--microbatches", "4")
    assert done.returncode == 2 and "batch 6 rows do not split into 4 micro-batches" in done.stderr, done.stderr
    done = autotp_cli("plan", "llama", "--tp", "1", "--pp", "3")
    assert done.returncode == 2 and "pp stages=3 need at least one decoder layer each" in done.stderr, done.stderr
    done = autotp_cli("plan", "t5", "--tp", "1", "--pp", "2")
    assert done.returncode == 2 and "encoder-decoder models are not cut" in done.stderr, done.stderr
