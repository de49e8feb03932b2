"""The README's torchrun lines run the example to completion on 2 and 4 CPU ranks, and on 2 "nodes" of 2 ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from autotp.testing.parity import LOSS_ATOL, PARAM_ATOL
from autotp.testing.spawn import free_port
from readme_commands import ROOT, readme_command, run, run_nodes

sys.path.insert(0, str(ROOT / "examples"))
from data import pattern_batch  # noqa: E402  (examples/ is on the path from here on)
from train import tiny_llama  # noqa: E402

pytestmark = pytest.mark.slow  # launches torchrun, as test_launchers.py does


@pytest.mark.parametrize(
    "line",
    [
        r"torchrun --nproc-per-node 2 examples/train\.py(?=\s)",  # the demo: tp=2
        r"torchrun --nproc-per-node 4 examples/train\.py --tp 2(?=\s)",  # 2 replicas x tp=2
    ],
)
def test_readme_torchrun_command_runs(line: str) -> None:
    assert "logits match" in run(readme_command(line), timeout=240)


@pytest.mark.parametrize("tp", [2, 4], ids=["tp-inside-each-node", "tp-across-the-nodes"])
def test_two_torchrun_nodes_train_as_one_process_and_save_what_one_process_loads(tmp_path: Path, tp: int) -> None:
    """The guides' 2-node launch (c10d rendezvous, node ranks given by it) as two torchrun agents of 2 CPU ranks on
    this machine, running examples/train.py. tp=2: TP inside each node, the 2 replicas across the nodes, as the
    guides lay it out; tp=4: one TP group spanning both nodes. Losses equal one process on the same global batches,
    and the model autotp.save_pretrained wrote loads in this process with the one-process model's weights."""
    steps, batch, seq = 3, 2, 32
    port = free_port()
    torchrun = [
        str(Path(sys.executable).with_name("torchrun")),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"autotp-{port}",
        "--local-addr",
        "127.0.0.1",
    ]  # both "nodes" are this machine, whatever its hostname resolves to
    script = [
        "examples/train.py",
        "--tp",
        str(tp),
        "--steps",
        str(steps),
        "--batch",
        str(batch),
        "--seq",
        str(seq),
        "--lr",
        "1e-3",
        "--adam-epsilon",
        "1e-6",
        "--output",
        str(tmp_path / "saved"),
        "--losses-out",
        str(tmp_path / "losses.json"),
    ]
    out = run_nodes([torchrun + script] * 2, tmp_path / "logs")
    assert "logits match" in out  # the example's own check, on global rank 0
    got = json.loads((tmp_path / "losses.json").read_text())["losses"]

    torch.manual_seed(0)  # as the example does: the same initial weights
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    replicas = 4 // tp
    vocab = model.config.vocab_size
    losses = []
    for step in range(steps):
        # the global batch: every replica's batch of the step (the example's seeds), together
        ids = torch.cat([pattern_batch(step * replicas + r, batch, seq, vocab) for r in range(replicas)])
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # fp32: the runs differ only in the order of sums (TP partials over gloo, the DP average of replica means); the
    # tolerances are autotp.testing.parity's for AdamW at lr 1e-3, eps 1e-6 (eps 1e-8 would turn the rounding noise
    # of near-zero gradients, as of rarely seen embedding rows, into full-size steps)
    assert len(got) == steps and max(abs(a - b) for a, b in zip(got, losses)) <= LOSS_ATOL, (got, losses)

    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", dtype=torch.float32)
    weights = dict(saved.named_parameters())
    worst = max((weights[n] - p).abs().max().item() for n, p in model.named_parameters())
    assert worst <= PARAM_ATOL, worst
    probe = pattern_batch(10_000, 2, seq, vocab)
    with torch.no_grad():
        diff = (saved(input_ids=probe).logits - model(input_ids=probe).logits).abs().max().item()
    assert diff <= 1e-4, diff  # logits of order 1 from weights within PARAM_ATOL (seen: 3e-6); the example's bound
