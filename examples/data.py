"""A synthetic, learnable language-modelling dataset shared by the examples (no download)."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset


def pattern_batch(seed: int, batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Counting sequences with a per-row stride: predictable after a few tokens, so the loss falls."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq)) % vocab


class PatternDataset(Dataset):
    """`size` sequences of `pattern_batch`, as dicts a Trainer can collate."""

    def __init__(self, size: int, seq: int, vocab: int, seed: int = 0):
        self.ids = pattern_batch(seed, size, seq, vocab)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}
