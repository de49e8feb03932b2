"""Random draws under a pipeline (dropout, LoRA's dropout, a router's jitter noise), seeded per stage and
micro-batch.

One process draws one mask over the whole batch and model; a pipeline runs each stage's micro-batches apart, in the
schedule's order, so it cannot draw the same numbers: its masks are other ones, of the same distribution. What it
keeps: each run of the schedule takes one seed from the shared random stream (equal on the TP and CP ranks of a
stage: `autotp.runtime.rng`), and each stage's forward of micro-batch m draws from the generator seeded by that seed,
the stage and m. So a run seeded alike repeats itself bit for bit, the TP ranks of a stage draw the same masks (their
replicated activations stay equal), the draws do not depend on the schedule's order, and a step's counting pass for
the load-balancing loss (`autotp.pp.router`) routes as its training pass does (the same jitter). Activation
checkpointing's recomputation restores the generator state its forward saw (torch's `preserve_rng_state`), so it
draws the same masks. In eval mode nothing is seeded: the model draws from the stream as it would.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ..runtime.rng import capture, restore
from .sharded import SyncOnLast

_MIX = 1_000_003  # a prime: (seed, stage, micro-batch) -> distinct seeds


class Draws:
    """The seed of the schedule's current run (None in eval mode: no seeding), and whether the run drew at all."""

    seed: int | None = None
    drew = False

    def start(self, training: bool) -> None:
        """At each run of the schedule, when training: the seed the shared stream's next draw gives, the stream left
        as it is until the run has drawn (`finish`)."""
        self.seed, self.drew = None, False
        if training:
            saved = capture()
            self.seed = int(torch.randint(0, 2**62, (1,)).item())
            restore(saved)

    def finish(self) -> None:
        """After the run: the stream advanced by the seed's draw if the run drew random numbers (a model that draws
        none leaves it as one process's, for the user's own draws; the next run that draws takes another seed)."""
        if self.seed is not None and self.drew:
            torch.randint(0, 2**62, (1,))

    @contextmanager
    def chunk(self, stage: int, microbatch: int) -> Iterator[None]:
        """Stage `stage`'s forward of micro-batch `microbatch` draws from its own seed; the stream is restored after."""
        if self.seed is None:
            yield
            return
        saved = capture()  # the CPU generator, and the current CUDA device's once CUDA runs
        seed = ((self.seed * _MIX + stage) * _MIX + microbatch) % 2**63
        torch.default_generator.manual_seed(seed)
        if len(saved) > 1:
            torch.cuda.manual_seed(seed)
        seeded = capture(cuda=len(saved) > 1)
        try:
            yield
        finally:
            self.drew = self.drew or any(not torch.equal(a, b) for a, b in zip(capture(cuda=len(saved) > 1), seeded))
            restore(saved)


class SeededStage(SyncOnLast):
    """A pipeline stage whose forward of each micro-batch draws from its own seed (`Draws.chunk`)."""

    def __init__(self, *args: Any, draws: Draws, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.draws = draws

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self.draws.chunk(self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
