"""`model.generate` under a pipeline: greedy or sampled tokens as one process's, every rank stepping together."""

from __future__ import annotations

from typing import Any


class PipelineGenerate:
    """`model.generate` at pp > 1, always without a KV cache (`use_cache=False`): a cache would live in the stages'
    layers, spread over the ranks, and transformers' loop feeds it only the newest token. So each new token runs the
    whole sequence through the forward-only schedule, whose logits every rank of the pipeline receives: every rank
    picks the same token (the same generator state for sampling) and stops at the same step. Slow, and exact."""

    def __init__(self, generate: Any):
        self.generate = generate

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        kwargs["use_cache"] = False
        return self.generate(*args, **kwargs)
