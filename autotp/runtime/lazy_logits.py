"""Logits gathered on first read: a ModelOutput whose `logits` is a shard (vocab) or a chunk (context) until used.

A step that reads only the loss never gathers batch x seq x vocab; code that reads `logits` gets the full
tensor, once. Vocab and context parallelism both hand their gather in.
"""

from __future__ import annotations

from typing import Callable

import torch


class _LazyLogits:
    """Mixed into a ModelOutput's class: `logits` (as attribute, key, index, or in `values()` / `items()` /
    `to_tuple()`) is gathered on first read and kept; assigning it replaces it."""

    @property
    def logits(self) -> torch.Tensor | None:
        self.autotp_resolve()
        return self.__dict__.get("logits")

    @logits.setter
    def logits(self, value: torch.Tensor | None) -> None:
        self.__dict__["autotp_pending"] = None
        self.__dict__["logits"] = value

    def autotp_resolve(self) -> None:
        pending = self.__dict__.get("autotp_pending")
        if pending is not None:
            self["logits"] = pending()  # type: ignore[index]  # mixed into a ModelOutput, an OrderedDict

    def __getitem__(self, key):
        if not isinstance(key, str) or key == "logits":
            self.autotp_resolve()
        return super().__getitem__(key)

    def values(self):
        self.autotp_resolve()
        return super().values()

    def items(self):
        self.autotp_resolve()
        return super().items()


_LAZY: dict[type, type] = {}


def lazy_logits(output, gather: Callable[[], torch.Tensor]):
    """`output` (a ModelOutput holding a logit shard) made to gather its logits with `gather` when first read."""
    cls = type(output)
    if isinstance(output, _LazyLogits):  # a model whose forward called another wrapped forward
        cls = cls.__mro__[2]
    if cls not in _LAZY:
        _LAZY[cls] = type(
            cls.__name__, (_LazyLogits, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        )
    output.__class__ = _LAZY[cls]
    output.__dict__["autotp_pending"] = gather
    return output
