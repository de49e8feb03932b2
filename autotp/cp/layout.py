"""Context parallelism's attention data: the zigzag split of the sequence, the K/V all-gather, masks per query chunk.

Each CP rank holds two of 2C equal chunks of the sequence, r and 2C-1-r ("zigzag"), so under a causal mask
every rank attends over the same number of (query, key) pairs. Attention all-gathers K and V over the CP group
(Llama 3's way: K/V are small under GQA, and one collective per layer needs no ring schedule) and runs the
model's own attention function (sdpa or eager, through transformers' attention interface) on this rank's
queries against every key, with a mask of [S/C, S] built from the global positions: causal, packed documents
(position ids restarting, as TRL packs) and padding. A whole [S, S] mask is never built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import Group, group_rank, group_size
from ..runtime.seq_collectives import all_gather_dim0, start_all_gather

LAYOUT_KWARG = "autotp_cp_layout"  # the forward keyword argument carrying a CP forward's `Layout` down to attention


def zigzag(length: int, size: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The sequence indices CP rank `rank` of `size` holds: chunks rank and 2 size - 1 - rank of 2 size."""
    step = length // (2 * size)
    first = torch.arange(rank * step, (rank + 1) * step, device=device)
    return torch.cat([first, torch.arange((2 * size - 1 - rank) * step, (2 * size - rank) * step, device=device)])


def gather_kv(key: torch.Tensor, value: torch.Tensor, group: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [B, H, S/C, D] of every CP rank, joined in rank order [B, H, S, D]; one collective, whose
    backward reduce-scatters (each rank's key gradient sums the contributions of every rank's queries)."""
    size = group_size(group)
    if size == 1:
        return key, value
    joined = all_gather_dim0(torch.stack([key, value]), group, of=" of context-parallel keys and values")
    both = joined.unflatten(0, (size, 2)).permute(1, 2, 3, 0, 4, 5)  # [2, B, H, C, s, D]
    both = both.flatten(3, 4)  # [2, B, H, C s, D]: ranks' chunks one after another
    return both[0], both[1]


@dataclass
class Layout:
    """How this forward's batch is split over the CP group, and what its attention masks are built from.

    `length` is the sequence the script passed, `padded` that length rounded up to a multiple of 2 C (the padding
    goes at the end, where a causal mask hides it from every real token). `local` holds this rank's sequence
    indices, `keys` the sequence index of each gathered key (ranks' chunks in rank order), `docs` each token's
    document (packed sequences) and `kept` which tokens are not padding: O(S) state. The [S/C, S] mask is built
    from them inside each layer's attention and never kept for the backward (`CPAttention`)."""

    length: int
    padded: int
    size: int
    rank: int
    local: torch.Tensor
    keys: torch.Tensor
    docs: torch.Tensor | None = None  # [B or 1, padded]
    kept: torch.Tensor | None = None  # [B, padded] bool
    batch: int = 1
    packed: tuple | None = field(default=None, repr=False)  # `segments`, built on first use

    def split(self, x: torch.Tensor, pad: Any = 0) -> torch.Tensor:
        """This rank's tokens of a [B, S, ...] tensor (the script's whole sequence), padded first if needed."""
        if self.padded > self.length:
            extra = x.new_full((x.shape[0], self.padded - self.length, *x.shape[2:]), pad)
            x = torch.cat([x, extra], dim=1)
        return x.index_select(1, self.local.to(x.device))

    def allowed(self, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[B or 1, 1, len(queries), len(keys)] bool: which keys (sequence indices) each query sees (causal, same
        document, not padding). A query that sees nothing (left padding) stays so: sdpa then gives it zeros,
        eager's all-minimum row a uniform average, each as on one process."""
        allowed = (keys[None, :] <= queries[:, None])[None]  # causal, on sequence indices
        if self.docs is not None:
            allowed = allowed & (self.docs[:, queries, None] == self.docs[:, None, keys])
        if self.kept is not None:
            allowed = allowed & self.kept[:, None, keys]
        return allowed.unsqueeze(1)

    def additive(self, dtype: torch.dtype, eager: bool, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """The mask as a float added to the scores. sdpa: -inf where masked, as torch reads a bool mask (which it
        would convert anyway). Eager: the dtype's minimum, as transformers builds it; the padding autotp added
        weighs nothing even in a row that sees nothing."""
        zero = torch.zeros((), dtype=dtype, device=self.local.device)
        mask = zero.masked_fill(~self.allowed(queries, keys), torch.finfo(dtype).min if eager else float("-inf"))
        return mask.masked_fill((keys >= self.length).view(1, 1, 1, -1), float("-inf"))

    def natural(self) -> torch.Tensor:
        """Where each sequence index sits among the gathered keys (which come in rank order)."""
        return torch.argsort(self.keys)

    def segments(self) -> tuple:
        """(query rows, key rows, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k) of flash's packed
        segments: one per (row, document, chunk), its queries the chunk's real tokens of the document and its keys
        from the document's first token to the last query; rows index [B * S/C] queries and [B * S] keys."""
        if self.packed is None:
            self.packed = _segments(self)
        return self.packed


def documents(position_ids: torch.Tensor) -> torch.Tensor | None:
    """Document index of each token where position ids restart (transformers' packed-sequence rule: a step other
    than +1 starts a document); None for one document per row."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    docs = (step != 1).long().cumsum(-1)
    if torch.compiler.is_compiling():  # no host sync in a compiled forward: one document is masked as such
        return docs
    return None if bool((docs[:, -1] == 0).all()) else docs


def segment_documents(cu_seq_lens: torch.Tensor, batch: int, length: int, padded: int) -> torch.Tensor | None:
    """Document index of each token [B, padded] from a padding-free batch's `cu_seq_lens` (segment starts over the
    flattened batch, as flash's variable-length path reads them; the padding continues the last); None for one
    document per row."""
    tokens = torch.arange(batch * length, device=cu_seq_lens.device)
    docs = torch.searchsorted(cu_seq_lens[1:].long(), tokens, right=True).view(batch, length)
    docs = torch.cat([docs, docs[:, -1:].expand(-1, padded - length)], dim=1)
    return None if bool((docs == docs[:, :1]).all()) else docs


def padded_length(length: int, size: int, multiple: int = 1) -> int:
    """The sequence length padded to two chunks per CP rank, each a multiple of `multiple`."""
    unit = 2 * size * multiple
    return -(-length // unit) * unit


def build_layout(
    length: int,
    group: Group,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    device: torch.device,
    batch: int = 1,
    multiple: int = 1,
    cu_seq_lens: torch.Tensor | None = None,
) -> Layout:
    """The split of one forward. `position_ids` [B or 1, S] and `attention_mask` [B, S] (1: a token, 0: padding)
    are the whole sequence's; each chunk's length is made a multiple of `multiple` (sequence parallelism's tp).
    Documents are where the positions restart, or, given a padding-free batch's `cu_seq_lens` (which flash reads in
    their place), its segments."""
    size, rank = group_size(group), group_rank(group)
    padded = padded_length(length, size, multiple)
    local = zigzag(padded, size, rank, device)
    keys = torch.cat([zigzag(padded, size, r, device) for r in range(size)])
    docs = kept = None
    if cu_seq_lens is not None:
        docs = segment_documents(cu_seq_lens.to(device), batch, length, padded)
    elif position_ids is not None:
        docs = documents(pad_positions(position_ids.to(device), padded))
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(
                f"context parallelism takes a 2-D attention mask [batch, seq] (1: token, 0: padding), got "
                f"shape {tuple(attention_mask.shape)}; a 4-D mask would be [S, S], which CP never builds"
            )
        kept = nn.functional.pad(attention_mask.to(device, torch.bool), (0, padded - length), value=False)
    return Layout(length, padded, size, rank, local, keys, docs, kept, batch)


def pad_positions(position_ids: torch.Tensor, padded: int) -> torch.Tensor:
    """[B, S] positions extended to `padded`, continuing the last document over the padding."""
    extra = padded - position_ids.shape[-1]
    if not extra:
        return position_ids
    last = position_ids[:, -1:]
    return torch.cat([position_ids, last + torch.arange(1, extra + 1, device=position_ids.device)], dim=-1)


def _segments(layout: Layout) -> tuple:
    """`Layout.segments`, built on the host (one pass over the tokens)."""
    step, whole, device = layout.padded // (2 * layout.size), layout.padded, layout.local.device
    starts = [int(layout.local[0]), int(layout.local[step])]
    q_rows: list[int] = []
    k_rows: list[int] = []
    lengths: list[tuple[int, int]] = []
    for b in range(layout.batch):
        docs = layout.docs[b % layout.docs.shape[0]].tolist() if layout.docs is not None else [0] * whole
        kept = layout.kept[b].tolist() if layout.kept is not None else [True] * whole
        kept = [k and p < layout.length for p, k in enumerate(kept)]
        first: dict[int, int] = {}
        for p in range(whole):
            if kept[p]:
                first.setdefault(docs[p], p)
        for chunk, start in enumerate(starts):
            p = start
            while p < start + step:
                end = p
                while end < start + step and docs[end] == docs[p]:
                    end += 1
                real = [t for t in range(p, end) if kept[t]]
                if real:
                    begin = first[docs[p]]
                    if not all(kept[begin : real[-1] + 1]):
                        raise NotImplementedError(
                            "flash attention under context parallelism takes padding only "
                            "around documents, not inside one; use sdpa"
                        )
                    q_rows += [b * 2 * step + chunk * step + t - start for t in real]
                    k_rows += [b * whole + t for t in range(begin, real[-1] + 1)]
                    lengths.append((len(real), real[-1] + 1 - begin))
                p = end
    cu = (
        [
            torch.tensor([0, *lens], dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
            for lens in zip(*lengths)
        ]
        if lengths
        else [torch.zeros(1, dtype=torch.int32, device=device)] * 2
    )
    longest = [max(lens) for lens in zip(*lengths)] if lengths else [0, 0]
    rows = [torch.tensor(r, dtype=torch.long, device=device) for r in (q_rows, k_rows)]
    return rows[0], rows[1], cu[0], cu[1], longest[0], longest[1]


class _GatherSequence(torch.autograd.Function):  # not `all_gather_dim0`: its backward is no reduce-scatter
    """A [B, S/C, ...] tensor back into the whole sequence: all-gather forward, this rank's tokens (times C, as the
    loss's backward) backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layout: Layout, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.layout = layout
        parts = start_all_gather(x, group, of=" of the output's context-parallel sequence")()  # [C B, S/C, ...]
        joined = parts.unflatten(0, (layout.size, x.shape[0])).movedim(0, 1).flatten(1, 2)  # [B, S, ...] in rank order
        whole = torch.empty_like(joined).index_copy_(1, layout.keys.to(x.device), joined)
        return whole[:, : layout.length]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layout = ctx.layout
        return layout.split(grad) * layout.size, None, None


def gather_sequence(x: torch.Tensor, layout: Layout, group: Group) -> torch.Tensor:
    """A [B, S/C, ...] tensor of a forward split as `layout`, as the whole [B, S, ...] sequence (differentiable)."""
    return x if group_size(group) == 1 else _GatherSequence.apply(x, layout, group)
