"""Spawn CPU ranks from one process (pytest, the sweep, verify): gloo on 127.0.0.1, a free port, one thread per rank.

Ranks are forked from the calling process, which has already imported torch and transformers, so
a 4-rank job starts in well under a second. A rank that hangs in a collective hits the gloo
timeout; the children are killed on the way out, even when the caller is interrupted.
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"{rank}.pt")
    except BaseException:
        (Path(out) / f"{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """Run `fn(rank, world, *args)` on `world` CPU ranks; returns each rank's result in rank order."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(_entry, args=(world, free_port(), fn, args, out), nprocs=world,
                                 join=False, start_method="fork")
        try:
            while not ctx.join(timeout=1):
                pass
        except mp.ProcessRaisedException:
            errors = sorted(Path(out).glob("*.err"))
            raise AssertionError("\n".join(f"--- {e.stem}:\n{e.read_text()}" for e in errors)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(Path(out) / f"{r}.pt", weights_only=False) for r in range(world)]
