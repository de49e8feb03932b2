"""Pipeline parallelism composed with FSDP2, sequence and context parallelism, LoRA and the Trainer: the rank workers
of tests/pp/test_pp_compose.py (a helper module beside them; the parity harness itself is `pp_workers.pp_parity`)."""

from __future__ import annotations

import torch.distributed as dist

from pp_workers import pp_parity


def counted_pp_parity(rank: int, world: int, *args: object) -> dict:
    """`pp_parity`, and how many reduce-scatters FSDP ran over its steps (`reduce_scatters`)."""
    calls = []
    reduce_scatter = dist.reduce_scatter_single

    def counted(*a: object, **k: object) -> object:
        calls.append(1)
        return reduce_scatter(*a, **k)

    dist.reduce_scatter_single = counted
    try:
        result = pp_parity(rank, world, *args)
    finally:
        dist.reduce_scatter_single = reduce_scatter
    return {**result, "reduce_scatters": len(calls)}


def pp_cases(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    """`pp_parity` for each (family, tp, pp, options) in one set of ranks (one start-up for several layouts)."""
    return [pp_parity(rank, world, *case) for case in cases]
