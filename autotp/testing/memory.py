"""Activation memory as autograd holds it: the tensors saved for the backward that are still held."""

from __future__ import annotations

import weakref

import torch
from torch import nn


class KeptForBackward:
    """Counts the bytes of every tensor autograd saves inside `with kept.hooks:` (parameters excluded) that is still
    held when asked: a saved tensor whose node was freed meanwhile (a bypassed elementwise node, `autotp.tp.glu`) is
    not. Each storage counts once; an address freed and reused later is a new storage."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.saved: list[tuple[weakref.ref, int, int]] = []  # (tensor, storage address, storage bytes)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.saved.append((weakref.ref(tensor), storage.data_ptr(), storage.nbytes()))
        return tensor

    def bytes(self) -> int:
        return sum({address: size for ref, address, size in self.saved if ref() is not None}.values())
