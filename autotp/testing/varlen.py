"""flash-attention's variable-length attention, written with torch's SDPA: context parallelism's flash branch runs
through it where no flash kernel is installed (the CPU tests, and GPUs without flash-attn: benchmarks/gpu.py)."""

from __future__ import annotations

import torch
from torch import nn


def varlen_reference(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    is_causal: bool | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """flash-attention's variable-length function as transformers' flash path calls it ([B, H, S, D] in, [B, S, H,
    D] out; packed segments by `cu_seq_lens`, causal aligned bottom-right in each), one SDPA call per segment.
    Register it with `transformers.AttentionInterface.register(name, varlen_reference)` under a name containing
    "varlen" (autotp then treats it as a flash function) and set that name as the model's attention."""
    assert attention_mask is None and cu_seq_lens_q is not None and cu_seq_lens_k is not None and is_causal
    outputs = []
    for i in range(len(cu_seq_lens_q) - 1):
        qs, qe, ks, ke = (
            int(x) for x in (cu_seq_lens_q[i], cu_seq_lens_q[i + 1], cu_seq_lens_k[i], cu_seq_lens_k[i + 1])
        )
        mask = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=query.device).tril(diagonal=(ke - ks) - (qe - qs))
        outputs.append(
            nn.functional.scaled_dot_product_attention(
                query[:, :, qs:qe], key[:, :, ks:ke], value[:, :, ks:ke], attn_mask=mask, scale=scaling, enable_gqa=True
            )
        )
    return torch.cat(outputs, dim=2).transpose(1, 2), None
