"""Spawn CPU ranks from one process (pytest, the sweep, verify): gloo on 127.0.0.1, a free port, one thread per rank.

Ranks are forked from the calling process, which has already imported torch and transformers, so
a 4-rank job starts in well under a second (on a machine with a GPU they are spawned: see `_START`).
A rank that hangs in a collective hits the gloo timeout; the children are killed on the way out,
even when the caller is interrupted.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
# Forked ranks start in well under a second, but cannot use CUDA (or autograd's device threads) once the parent
# has; where a GPU is present they are spawned instead: slower to start, and `fn` must be importable.
_START = "spawn" if torch.cuda.is_available() else "fork"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str, backend: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"{rank}.pt")
    except BaseException:
        (Path(out) / f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, attempts: int = 3, backend: str = "gloo") -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` CPU ranks; returns each rank's result in rank order.

    `backend="nccl"` gives each rank a GPU (rank modulo the GPUs there); gloo ranks may still put
    tensors on a GPU, which gloo's CUDA support reduces.

    A free port can be taken by another process between choosing and binding it; that case alone
    is retried on a new port.
    """
    for attempt in range(1, attempts + 1):
        with tempfile.TemporaryDirectory() as out:
            ctx = mp.start_processes(
                _entry, args=(world, free_port(), fn, args, out, backend), nprocs=world, join=False, start_method=_START
            )
            try:
                while not ctx.join(timeout=1):
                    pass
            except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
                errors = {e.stem: e.read_text() for e in sorted(Path(out).glob("*.err"))}
                if attempt < attempts and any("address already in use" in t.lower() for t in errors.values()):
                    continue
                details = "\n".join(f"--- {rank}:\n{text}" for rank, text in errors.items()) or str(err)
                raise AssertionError(details) from None
            finally:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
            return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]
    raise ValueError(f"attempts must be at least 1, got {attempts}")
