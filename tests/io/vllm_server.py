"""One `vllm serve` of a tiny model (a Llama unless given a config) for a test module (vLLM's own venv only): the
model is written, the server started with the autotp-gloo backend and its RL routes, polled until healthy, and
stopped when the module ends."""

from __future__ import annotations

import os
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

from autotp.testing.spawn import free_port

START_TIMEOUT_S = 240  # inside the first test's 300 s timeout (observed: 30 to 70 s)
EMPTY_DIGEST = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"  # sha256 of no bytes


@contextmanager
def serve(vocab: int, *extra: str, env: dict[str, str] | None = None, label: str = "",
          config: PretrainedConfig | None = None) -> Iterator[tuple[str, str]]:
    """(url, initial model dir) of a running engine of `config` (default: a tiny Llama of `vocab` tokens); head_dim
    32, as vLLM's CPU attention refuses 16."""
    with tempfile.TemporaryDirectory() as tmp:
        config = config or LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=vocab,
                                       max_position_embeddings=256, tie_word_embeddings=False)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(f"{tmp}/model")
        port = free_port()
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", f"{tmp}/model",
                   "--port", str(port), "--dtype", "float32", "--skip-tokenizer-init", "--max-model-len", "256",
                   "--enforce-eager", *extra, "--weight-transfer-config", '{"backend": "autotp-gloo"}']
        environment = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
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
            yield url, f"{tmp}/model"
        finally:
            server.terminate()
            server.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        return requests.get(f"{url}/health", timeout=5).ok
    except requests.ConnectionError:
        return False
