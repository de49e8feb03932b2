"""The shared random stream: the same generator state on every rank of a group, and a check that it stays so.

Code computed redundantly on every TP rank (the residual stream) must draw the same random numbers
on every rank, or the replicas drift apart: `wrap` gives the TP group rank 0's generator state.
Code computed on shards (attention heads, MLP columns) should draw independent numbers per rank:
each sharded block runs under a seed drawn from the shared stream and offset by the TP rank, and
the shared stream is restored afterwards. The seed depends only on the shared stream's state, so
activation checkpointing (which replays that state) recomputes the same masks, and the state saved
by `save_checkpoint` covers both.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import Group, group_size, named_failure
from .collectives import all_reduce


def capture(cuda: bool | None = None) -> list[torch.Tensor]:
    """The CPU generator's state, and the current CUDA device's: by default when CUDA is initialised (before
    that nothing has drawn from it, and initialising it here would stop forked ranks from using it)."""
    cuda = torch.cuda.is_initialized() if cuda is None else cuda and torch.cuda.is_available()
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if cuda else [])


def restore(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def sync_replicated_stream(group: Group) -> None:
    """Give every rank of the TP group rank 0's CPU (and current CUDA) generator state."""
    if group_size(group) == 1:
        return
    box = [[s.tolist() for s in capture(cuda=True)]]  # CUDA too, initialised or not: ranks seeded apart diverge
    with named_failure(group, "broadcast of TP rank 0's random generator state"):
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    restore([torch.tensor(s, dtype=torch.uint8) for s in box[0]])


class StreamCheck:
    """Model forward pre-hook: stops, before anything changes, when the TP ranks' shared generators have drifted apart
    (`torch.manual_seed(rank)` after `wrap`, common in data-parallel scripts): replicated dropout masks, and the
    tokens `generate` samples, would differ between ranks, so replicated weights drift and ranks decode apart.

    One all-reduce of two integers on the first forward in each mode (training, eval), then every `every` forwards:
    a few tens of microseconds, amortised to under one per step. Left out of a `torch.compile`d forward, whose graph
    it would break (a host-side hash and `.item()`): there only eager forwards (evaluation, generate) are checked."""

    def __init__(self, group: Group, every: int = 64):
        self.group, self.every = group, every
        self.calls = 0
        self.modes: set[bool] = set()

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if torch.compiler.is_compiling():
            return
        self.calls += 1
        if module.training in self.modes and self.calls % self.every:
            return
        self.modes.add(module.training)
        device = next((x.device for x in (*args, *kwargs.values()) if torch.is_tensor(x)), torch.device("cpu"))
        digest = int.from_bytes(
            hashlib.blake2b(b"".join(s.numpy().tobytes() for s in capture()), digest_size=7).digest(), "little"
        )
        extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
        all_reduce(extremes, self.group, dist.ReduceOp.MAX)
        if extremes[0].item() != -extremes[1].item():
            raise RuntimeError(
                f"the random generators of the {group_size(self.group)} ranks of this TP group differ at "
                f"{type(module).__name__}'s forward: their dropout masks and sampled tokens would differ, so the "
                f"replicated weights drift and generation diverges. Something reseeded them apart after autotp.wrap "
                f"(torch.manual_seed(rank)?): seed before wrap, or seed the same on every TP rank: "
                f"torch.manual_seed(seed + autotp.dp_rank(model))"
            )
