"""Context parallelism's attention calls: the model's own attention function run on this rank's queries against the
gathered keys, through transformers' attention interface.

sdpa runs each of the rank's two chunks against only the keys before it, with an additive mask per chunk; eager
runs the rank's queries against every key; a flash (variable-length) function gets packed segments with
`cu_seq_lens`, one per (row, document, chunk), and no mask at all, as transformers' padding-free flash path takes
them. Each call is recomputed in backward (`torch.utils.checkpoint`), so a rank keeps only its own q, k, v.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .layout import LAYOUT_KWARG, Layout, gather_kv


def is_varlen(implementation: str) -> bool:
    """Whether an attention implementation takes packed variable-length segments (flash-attention's kind)."""
    return "flash" in implementation or "varlen" in implementation


class CPAttention:
    """The attention function registered with transformers under `name`: while a CP layout is set on the module's
    `autotp_context` it gathers K/V and masks; otherwise (generation with a cache, a gathered model) it is the
    model's own function (`original`, or the module's eager function) with transformers' mask."""

    def __init__(self, original: str, functions: dict[str, Callable]):
        self.original, self.functions = original, functions

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        inner = module.autotp_eager if self.original == "eager" else self.functions[self.original]
        context = module.autotp_context
        # the forward's layout comes down with transformers' keyword arguments, so a checkpointed decoder layer's
        # recomputation in backward finds it too; a model that does not pass them on has it from the context
        layout = kwargs.pop(LAYOUT_KWARG, None) or context.layout
        if layout is None:
            return inner(module, query, key, value, attention_mask, **kwargs)
        context.calls += 1
        if kwargs.get("sliding_window") is not None:
            raise NotImplementedError(
                f"{type(module).__name__}: sliding-window attention under context "
                f"parallelism is not supported (its band would be masked per chunk); use "
                f"cp_size=1"
            )
        eager, varlen = self.original == "eager", is_varlen(self.original)
        kwargs["is_causal"] = varlen  # flash: causal within each segment, aligned bottom-right

        def core(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, Any]:
            key, value = gather_kv(key, value, context.group)
            if varlen:
                return _segments_attention(inner, module, query, key, value, layout, kwargs)
            if eager:  # every key: a row that sees nothing averages over all of them, as one process's does
                return inner(
                    module, query, key, value, layout.additive(query.dtype, True, layout.local, layout.keys), **kwargs
                )
            return _two_chunks(inner, module, query, key, value, layout, kwargs)

        if not torch.is_grad_enabled():
            return core(query, key, value)
        # Recomputed in backward: autograd keeps this rank's q, k, v, not the gathered K/V nor the [S/C, S] mask, so
        # what a rank holds per layer falls as 1/C (the K/V all-gather runs again in backward, in layer order)
        return checkpoint(core, query, key, value, use_reentrant=False)


MASK_ELEMENTS = 1 << 26  # the most mask entries one sdpa call builds (256 MiB in fp32): long chunks go in blocks


def _two_chunks(
    inner: Callable,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Layout,
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """sdpa on blocks of this rank's two chunks, each block against only the keys up to its last query: the causal
    half of the [S/C, S] block, the same work on every rank, and never more than `MASK_ELEMENTS` mask entries at
    once (at 128k tokens a whole chunk's mask would take gigabytes). Keys are put in sequence order first."""
    order = layout.natural()
    key, value = key.index_select(2, order), value.index_select(2, order)
    step = layout.padded // (2 * layout.size)
    rows = max(
        1, MASK_ELEMENTS // (layout.padded * (1 if layout.docs is None and layout.kept is None else layout.batch))
    )
    device = layout.local.device
    outputs = []
    for chunk, start in enumerate((layout.rank * step, (2 * layout.size - 1 - layout.rank) * step)):
        for first in range(0, step, rows):
            last = min(first + rows, step)
            queries = torch.arange(start + first, start + last, device=device)
            end = start + last  # the block's last query sees keys up to itself
            mask = layout.additive(query.dtype, False, queries, torch.arange(end, device=device))
            at = slice(chunk * step + first, chunk * step + last)
            out, _ = inner(module, query[:, :, at], key[:, :, :end], value[:, :, :end], mask, **kwargs)
            outputs.append(out)
    return torch.cat(outputs, dim=1), None  # [B, S/C, H, D], as transformers' attention functions return


def _segments_attention(
    inner: Callable,
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: Layout,
    kwargs: dict,
) -> tuple[torch.Tensor, None]:
    """A flash (variable-length) function on packed segments: each (row, document, chunk) is one segment whose
    queries are the chunk's tokens of the document and whose keys run from the document's first token to the last
    query, so flash's bottom-right causal alignment is the causal mask. Padding queries get zeros (as transformers'
    unpadding gives them)."""
    batch, heads, count, dim = query.shape
    q_index, k_index, cu_q, cu_k, max_q, max_k = layout.segments()
    order = layout.natural()
    key, value = key.index_select(2, order), value.index_select(2, order)
    pack = lambda x, index: x.transpose(1, 2).flatten(0, 1).index_select(0, index)[None].transpose(1, 2)  # noqa: E731
    out, _ = inner(
        module,
        pack(query, q_index),
        pack(key, k_index),
        pack(value, k_index),
        None,
        cu_seq_lens_q=cu_q,
        cu_seq_lens_k=cu_k,
        max_length_q=max_q,
        max_length_k=max_k,
        **kwargs,
    )
    whole = out.new_zeros((batch * count, heads, dim)).index_copy(0, q_index, out[0])
    return whole.view(batch, count, heads, dim), None
