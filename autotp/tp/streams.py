"""Per-rank random streams inside TP spans (dropout on heads and columns), around tp's layers.

Each sharded block runs under a seed drawn from the shared stream (`autotp.runtime.rng`) and offset by
the TP rank, and the shared stream is restored afterwards; the seed depends only on the shared stream's
state, so activation checkpointing recomputes the same masks.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch import nn

from ..mesh import Group, group_rank, group_size
from ..runtime.forward_end import after_every_forward
from ..runtime.rng import StreamCheck, capture, restore
from .layers import LinearAllreduce, LinearLayer

_OFFSET = 2718281  # keeps rank r's block seeds away from rank 0's


class ShardedStream:
    """Runs one TP span under a per-rank seed drawn from the shared stream, then restores the shared one.

    A span starts at its first column layer (or a sharded module's entry) and ends when its row
    layer (or the module) returns, so a dropout applied to the block's reduced output (GPT-2's
    resid_dropout) still draws from the shared stream, as replicated code must. It ends also when the forward
    raised (`autotp.runtime.forward_end`): left on the rank's seed, the next replicated dropout would draw
    apart on each rank, and the next span would not start.
    """

    def __init__(self, rank: int):
        self.rank = rank
        self._saved: list | None = None

    def enter(self, module: nn.Module, *_) -> None:
        if self._saved is not None or not module.training:
            return
        seed = int(torch.randint(0, 2**62, (1,)).item())  # the same draw on every TP rank
        self._saved = capture()
        torch.manual_seed(seed + _OFFSET * (self.rank + 1))

    def leave(self, module: nn.Module, args, output):
        self.restore()
        return output

    def restore(self) -> None:
        """End the span: back on the shared stream (nothing to do outside a span)."""
        if self._saved is not None:
            restore(self._saved)
            self._saved = None

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Draw from the shared stream inside the span (dropout on a replicated tensor there), advancing it."""
        if self._saved is None:
            yield
            return
        mine = capture()
        restore(self._saved)
        try:
            yield
        finally:
            self._saved = capture()
            restore(mine)


@contextmanager
def shared_draws(layer: nn.Module) -> Iterator[None]:
    """Random draws made inside come from the TP group's shared stream, even inside `layer`'s TP span."""
    stream = getattr(layer, "autotp_stream", None)
    with stream.shared() if stream is not None else nullcontext():
        yield


def _has_dropout(block: nn.Module) -> bool:
    """Any dropout module or dropout-probability attribute above zero inside `block`."""
    for module in block.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        if any("dropout" in name and isinstance(value, float) and value > 0 for name, value in vars(module).items()):
            return True
    return False


def install_sharded_streams(model: nn.Module, blocks: list[str], regions: list[str], group: Group, state) -> None:
    """Per-rank streams for the TP spans (blocks, and the `regions`: experts modules) that draw random numbers at all (dropout), and the check that the
    shared stream stays shared (`StreamCheck`)."""
    if group_size(group) == 1:
        return
    model.register_forward_pre_hook(state.sharded_only(StreamCheck(group)), with_kwargs=True)
    rank = group_rank(group)
    for path in blocks:
        block = model.get_submodule(path)
        if not _has_dropout(block):
            continue
        stream = ShardedStream(rank)
        for module in block.modules():
            if isinstance(module, LinearLayer):
                module.register_forward_pre_hook(state.sharded_only(stream.enter))
            elif isinstance(module, LinearAllreduce):
                module.register_forward_hook(stream.leave)
            if isinstance(module, (LinearLayer, LinearAllreduce)):
                module.autotp_stream = stream  # LoRA's dropout on the replicated input draws from the shared one
        block.register_forward_hook(stream.leave)
        after_every_forward(model, path, stream.restore)  # a raise inside must not leave the rank's seed on
    for path in regions:
        module = model.get_submodule(path)
        if _has_dropout(module):
            stream = ShardedStream(rank)
            module.register_forward_pre_hook(state.sharded_only(stream.enter))
            module.register_forward_hook(stream.leave)
            after_every_forward(model, path, stream.restore)
