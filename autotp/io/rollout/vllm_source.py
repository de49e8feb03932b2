"""autotp's model as a vLLM `WeightSource`: the engine's trainer-side backends (vLLM's NCCL, autotp's gloo) iterate
it each round and read its `metadata()` to size what the engine receives.

Why: vLLM's own `ModuleSource` walks `named_parameters()`, which under autotp are TP shards under the model's own
names (not the checkpoint's, LoRA unmerged). `export_weights` already yields transformers' checkpoint names, LoRA
merged, gathered bucket by bucket; this wraps it in the engine's protocol. Iteration is a collective over the TP
group (over every rank under `fully_shard`): every trainer rank iterates it each round, and the TP rank 0 ranks get
the tensors (the others get none), so only global rank 0 (vLLM's sender) may be the one that sends. Under a
pipeline every stage sends its tensors on to PP rank 0 (`autotp.pp.stage_tensors`), so rank 0 still gets all of them.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import nn
from vllm.distributed.weight_transfer import ParamMeta, WeightSource

from ...compat.peft import peft_inner
from ...compat.torch import gloo_timeouts_at_most
from ...state import outside_module_holders
from ..hf.parts import saved_layout
from .export import export_weights, exported_tensors


class AutotpWeightSource(WeightSource):
    """`export_weights(model, merge_lora=, dtype=, bucket_bytes=)` each time it is iterated, as vLLM's
    `WeightSource`. `target=` (an engine's TP rows) is not taken: vLLM's loaders cut full checkpoint tensors
    themselves. `timeout_s`: while it is iterated, the most any of this rank's gloo groups waits on another rank
    (`vllm_sync`'s), so a trainer rank stalled mid-round fails the others within it."""

    def __init__(
        self,
        model: nn.Module,
        *,
        merge_lora: bool = True,
        dtype: torch.dtype | None = None,
        bucket_bytes: int = 256 << 20,
        timeout_s: float | None = None,
    ) -> None:
        self.model, self.merge_lora, self.dtype, self.bucket_bytes = model, merge_lora, dtype, bucket_bytes
        self.timeout_s = timeout_s

    def metadata(self) -> list[ParamMeta]:
        """Every tensor the export yields, in its order, with its full shape and wire dtype; read from the shards'
        recorded full shapes, so nothing is gathered (the same list on every rank)."""
        root = peft_inner(outside_module_holders(self.model))
        layout = saved_layout(root, exported_tensors(root, self.merge_lora)[1])  # at pp > 1 collective over PP
        return [ParamMeta(name, self.dtype or saved.dtype, tuple(saved.shape)) for name, saved in layout.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        with gloo_timeouts_at_most(self.timeout_s):  # the training group's (often 30 min) would bound a stall
            yield from export_weights(
                self.model, merge_lora=self.merge_lora, dtype=self.dtype, bucket_bytes=self.bucket_bytes
            )

    def held_names(self) -> None:
        """None: every tensor. Under TP each exporting rank takes part in every tensor's gather, so none holds a
        part of the model alone (vLLM's meaning of the question: pipeline or expert parallel producers)."""
        return None
