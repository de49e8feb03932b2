"""`vllm_sync`: the handshake between a wrapped model and a `vllm serve` server, returning vLLM's own trainer
engine, so each round is one `engine.send_weights()` on every trainer rank.

Why: vLLM's trainer side needs a source, a control client, a backend's init info with an explicit rank, a free
port and the engine's world size; each user would write the same dozen lines. The server must run with
`VLLM_SERVER_DEV_MODE=1` (its weight-transfer routes) and `--weight-transfer-config '{"backend": "autotp-gloo"}'`
(or `nccl` on GPUs, with `backend="nccl"` here), and `AUTOTP_SYNC_TOKEN` (the shared secret) in its environment.
"""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

import requests
import torch.distributed as dist
from torch import nn
from vllm.distributed.weight_transfer import (
    TrainerWeightTransferEngine,
    WeightTransferTrainerFactory,
)

from .vllm_channel import BACKEND, TOKEN_ENV
from .vllm_client import EngineClient
from .vllm_gloo import AutotpGlooTrainerInitInfo, register
from .vllm_source import AutotpWeightSource


def vllm_sync(
    model: nn.Module,
    url: str,
    *,
    backend: str = BACKEND,
    master_address: str | None = None,
    master_port: int | None = None,
    timeout_s: float = 300.0,
    token: str | None = None,
    pause: bool = True,
    **export_kwargs,
) -> TrainerWeightTransferEngine:
    """Connect the trainer to the vLLM server at `url`: call it on every trainer rank, once (again after a failed
    round), then `.send_weights()` on every rank each round.

    Rank 0 of the default group (a TP rank 0, which `export_weights` hands the tensors) sends; the other ranks
    take part in the gathers. `export_kwargs` are `merge_lora`, `dtype`, `bucket_bytes` (`export_weights`' own).
    `master_address` / `master_port`: where rank 0 hosts the transfer group's store (default: this host's address
    toward the server, a free port); the store listens on that address alone. `timeout_s`: how long anyone waits
    on another side before failing (the trainer ranks on each other too, during a round).
    `token`: the shared secret the server's workers check on every init and round ("autotp-gloo"; default: this
    process's `AUTOTP_SYNC_TOKEN`); it must equal the server's `AUTOTP_SYNC_TOKEN`.
    `pause`: load each round with the server's generation paused (`/pause?mode=wait`, then `/resume`), so every
    request comes out of one round's weights; False for a caller that drains the engine itself.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    token = token or os.environ.get(TOKEN_ENV, "")
    if backend == BACKEND and not token:
        raise ValueError(
            f"autotp.rollout.vllm_sync: no token: pass token= or set {TOKEN_ENV}, the shared secret "
            f"the server's environment holds as {TOKEN_ENV} (its workers refuse rounds without it)"
        )
    source = AutotpWeightSource(model, timeout_s=timeout_s, **export_kwargs)
    client = EngineClient(url, timeout=timeout_s, pause=pause)
    register()
    world = address = port = None  # read on the sender only: the others never touch the transfer group
    if rank == 0:
        world = 1 + requests.get(f"{url.rstrip('/')}/get_world_size", timeout=timeout_s).json()["world_size"]
        address = master_address or _address_toward(url)
        port = master_port or _free_port()
    if backend == BACKEND:
        info = AutotpGlooTrainerInitInfo(
            address or "",
            port or 0,
            world or 0,
            timeout_s=timeout_s,
            bucket_bytes=source.bucket_bytes,
            token=token,
            rank=rank,
        )
    elif backend == "nccl":
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        info = NCCLTrainerInitInfo(address or "", port or 0, world or 0, rank=rank)
    else:
        raise ValueError(f"autotp.rollout.vllm_sync(backend={backend!r}): {BACKEND!r} (CPU) or 'nccl' (GPUs)")
    return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def _address_toward(url: str) -> str:
    """This host's address on the route to the server (no packet is sent): where the workers reach the store."""
    parsed = urlparse(url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((parsed.hostname, parsed.port or 80))
        return probe.getsockname()[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]
