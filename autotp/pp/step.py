"""`autotp.forward_backward`: one training step's forward and backward, the same call at every layout."""

from __future__ import annotations

from typing import Any

from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..state import find_state
from .dimension import PipelineParallelism


def forward_backward(model: nn.Module, **batch: Any) -> Any:
    """Run the forward and the backward of the whole `batch`; return the model's output, whose `.loss` is, on every
    rank, the loss one process computes on the whole batch.

    At pp_size 1 (or on a model autotp did not wrap) this is `out = model(**batch); out.loss.backward()`. Under a
    pipeline it runs torch's schedule (`pp_schedule`) over `pp_microbatches` micro-batches, the batch's rows split
    evenly; the output then holds the loss only. Every rank is given the same whole batch. Then, as at every layout:
    `autotp.allreduce_gradients(model)` (it also sums a tied embedding's two copies) and `optimizer.step()`.
    """
    state = find_state(model)
    compiled = getattr(model, "_orig_mod", None) if state is None else None  # torch.compile(model)'s module
    inner = find_state(compiled) if isinstance(compiled, nn.Module) else None
    if inner is not None and inner.dim(PipelineParallelism) is not None:
        raise NotImplementedError(
            f"autotp.forward_backward(torch.compile(model)) at pp_size={inner.options.pp_size}: a pipeline runs the "
            f"model's own forward on each stage through torch's schedule, so a compiled whole model would never run; "
            f"pass the wrapped model itself (autotp.forward_backward(model, **batch)) and compile its decoder layers "
            f"instead (for layer in model.model.layers: layer.compile())"
        )
    pipeline = None if state is None else state.dim(PipelineParallelism)
    if pipeline is None:
        out = model(**batch)
        out.loss.backward()
        return out
    return CausalLMOutputWithPast(loss=pipeline.forward_backward(model, batch))
