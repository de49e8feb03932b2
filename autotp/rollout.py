"""`autotp.rollout`: weights to a running rollout engine through the engine's own weight-transfer API.

Why a face of its own: the implementation (`autotp.io.rollout`) imports vLLM, an optional dependency; this module
imports it only when called, so `import autotp` works without vLLM.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def vllm_sync(model: nn.Module, url: str, *, backend: str = "autotp-gloo", **kwargs: Any) -> Any:
    """vLLM's trainer engine for `model`, connected to the `vllm serve` server at `url`: call this once on every
    trainer rank, then `.send_weights()` on every trainer rank each round. `backend`: "autotp-gloo" (CPU) or
    "nccl" (GPUs); `kwargs`: `master_address`, `master_port`, `timeout_s`, and `export_weights`' `merge_lora`,
    `dtype`, `bucket_bytes`. Needs vLLM installed; docs/rl.md shows the server's flags. `pause=False` loads each
    round without pausing the server's generation (by default requests in flight finish on the old weights first)."""
    from .io.rollout.vllm_connect import vllm_sync as connect

    return connect(model, url, backend=backend, **kwargs)
