"""One `vllm serve` of a tiny model (a Llama unless given a config) for a test module (vLLM's own venv only): the
model is written, the server started with the autotp-gloo backend and its RL routes, polled until healthy, and
stopped when the module ends."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PretrainedConfig

import autotp
from autotp.rollout import vllm_sync
from autotp.testing.spawn import free_port
from models import batch

TOKEN_ENV = "AUTOTP_SYNC_TOKEN"  # the weight channel's shared secret (autotp.io.rollout.vllm_channel.TOKEN_ENV)
START_TIMEOUT_S = 240  # inside the first test's 300 s timeout (observed: 30 to 70 s)
EMPTY_DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes


@contextmanager
def serve(
    vocab: int, *extra: str, env: dict[str, str] | None = None, label: str = "", config: PretrainedConfig | None = None
) -> Iterator[tuple[str, str]]:
    """(url, initial model dir) of a running engine of `config` (default: a tiny Llama of `vocab` tokens); head_dim
    32, as vLLM's CPU attention refuses 16. The server's log is `server.log` beside the model dir. A fresh token is
    in the server's environment and, meanwhile, this process's (the trainer ranks forked from here read it)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = config or LlamaConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=vocab,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(f"{tmp}/model")
        port = free_port()
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            f"{tmp}/model",
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--skip-tokenizer-init",
            "--max-model-len",
            "256",
            "--enforce-eager",
            *extra,
            "--weight-transfer-config",
            '{"backend": "autotp-gloo"}',
        ]
        token, before = secrets.token_hex(16), os.environ.get(TOKEN_ENV)
        environment = {
            **os.environ,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            TOKEN_ENV: token,
            **(env or {}),
        }
        started = time.monotonic()
        with open(f"{tmp}/server.log", "w") as log:
            server = subprocess.Popen(command, env=environment, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            while not _healthy(url):
                if server.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                    pytest.fail(f"vLLM did not start:\n{Path(tmp, 'server.log').read_text()[-4000:]}")
                time.sleep(2)
            print(f"\nvLLM engine{label} start-up: {time.monotonic() - started:.1f} s")
            os.environ[TOKEN_ENV] = token
            yield url, f"{tmp}/model"
        finally:
            server.terminate()
            server.wait(timeout=60)
            if before is None:
                os.environ.pop(TOKEN_ENV, None)
            else:
                os.environ[TOKEN_ENV] = before


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).ok
    except requests.ConnectionError:
        return False


# What the engine tests read and run, beside the engine (each module's prompts are these).
PROMPTS = [[1, 5, 9, 22], [300, 17, 4, 88, 250, 6], [42, 42, 7]]
NEW_TOKENS = 8
LR = 0.05


def digests(url: str) -> dict[str, str]:
    """vLLM's per-tensor sha256 of the engine's weights, less the empty ones: its CPU build drops each linear layer's
    weight once packed for oneDNN, so these cover the embedding, the norms, the LM head and (in a MoE) the
    experts; the completions and log-probs cover the linear layers."""
    response = requests.post(f"{url}/weight_checker", json={"action": "checksum"}, timeout=60)
    response.raise_for_status()
    return {name: digest for name, digest in response.json()["checksums"].items() if digest != EMPTY_DIGEST}


def reload(url: str, path: str) -> None:
    """The engine's own loader reads a transformers checkpoint into the running engine."""
    response = requests.post(
        f"{url}/collective_rpc", timeout=120, json={"method": "reload_weights", "kwargs": {"weights_path": path}}
    )
    response.raise_for_status()


def completions(url: str) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and prompt log-probs (of tokens 1...) for each prompt, from the engine."""
    out, model = [], requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    for prompt in PROMPTS:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 0,
            "return_token_ids": True,
            "prompt_logprobs": 0,
        }
        response = requests.post(f"{url}/v1/completions", json=body, timeout=120)
        response.raise_for_status()
        choice = response.json()["choices"][0]
        logprobs = [entry[str(token)]["logprob"] for token, entry in zip(prompt[1:], choice["prompt_logprobs"][1:])]
        out.append((choice["token_ids"], logprobs))
    return out


def reference(model: torch.nn.Module) -> list[tuple[list[int], list[float]]]:
    """The same from transformers on the one-process model."""
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            tokens = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt) :]
            logits = model(input_ids=ids).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            out.append((tokens.tolist(), logprobs.tolist()))
    return out


def against(url: str, ref: torch.nn.Module) -> dict:
    """The engine's greedy tokens (and transformers'), its prompt log-probs, and their largest distance from
    transformers' on the one-process `ref`."""
    got, expected = completions(url), reference(ref)
    return {
        "tokens": ([t for t, _ in got], [t for t, _ in expected]),
        "logprobs": [g for _, g in got],
        "logprob_error": max(abs(a - b) for (_, g), (_, e) in zip(got, expected) for a, b in zip(g, e)),
    }


def refusal(model: torch.nn.Module, url: str) -> str:
    """The error `send_weights` of `model` raises (a round the engine should refuse), on a fresh connection; "sent"
    if the round went in."""
    engine = vllm_sync(model, url, timeout_s=30)
    try:
        engine.send_weights()
    except Exception as error:  # noqa: BLE001 (the caller checks what it names)
        return f"{type(error).__name__}: {error}"
    return "sent"


def train(model: torch.nn.Module, steps: int, wrapped: bool, vocab: int) -> None:
    """`steps` SGD steps on one batch, every DP replica on the same rows (so one process's steps are the same)."""
    ids = batch(vocab=vocab)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        if wrapped:
            autotp.allreduce_gradients(model)
        optimizer.step()
        optimizer.zero_grad()


def train_and_send(
    model: torch.nn.Module, ref: torch.nn.Module | None, engine, steps: int, vocab: int, before_send=None
) -> float:
    """One round: `steps` on the trainer and on the one-process `ref` (rank 0's), `before_send()` if given, then
    the engine's `send_weights`; its seconds."""
    train(model, steps, True, vocab)
    if ref is not None:
        train(ref, steps, False, vocab)
    if before_send is not None:
        before_send()
    started = time.monotonic()
    engine.send_weights()
    return time.monotonic() - started
