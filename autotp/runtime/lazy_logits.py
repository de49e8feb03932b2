"""Logits gathered on first read: a ModelOutput whose `logits` is a shard (vocab) or a chunk (context) until used;
and logits computed on first use (`PendingLogits`, the chunked loss's stand-in).

A step that reads only the loss never gathers batch x seq x vocab; code that reads `logits` gets the full
tensor, once. Vocab and context parallelism both hand their gather in.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..compat.torch import subclass_alias


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
        """Gather the logits, in the forward's grad mode: read first under no_grad, they still carry the graph a
        later loss term on them needs, as one process's logits do."""
        pending = self.__dict__.get("autotp_pending")
        if pending is not None:
            with torch.inference_mode(False), torch.set_grad_enabled(self.__dict__["autotp_grad_mode"]):
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
    output.__dict__["autotp_grad_mode"] = torch.is_grad_enabled()  # the forward's
    return output


_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
}


# elementwise operations that a stand-in takes with a Python number, as Gemma 2's softcap and Cohere's logit_scale apply
# them, kept as the stand-in's `transforms` (each chunk applies them) rather than computing the logits
_SCALAR_OPS = {
    torch.Tensor.__truediv__,
    torch.Tensor.div,
    torch.div,
    torch.Tensor.__mul__,
    torch.Tensor.__rmul__,
    torch.Tensor.mul,
    torch.mul,
    torch.Tensor.tanh,
    torch.tanh,
}


class PendingLogits(torch.Tensor):
    """Logits not computed yet: an expanded zero (no memory) of their shape. Reading its shape, dtype or device costs
    nothing; multiplying or dividing it by a number or taking its tanh gives a stand-in with that step added to its
    `transforms`; any other operation computes the real logits once (`materialize`) and runs on them.

    `stale` says why the head can no longer compute the forward's logits (its weight changed since: an optimizer
    step), or None."""

    hidden: torch.Tensor
    head: Callable[[torch.Tensor], torch.Tensor]
    stale: Callable[[], str | None]
    transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...]
    grad_mode: bool
    computed: torch.Tensor | None

    @staticmethod
    def __new__(
        cls,
        hidden: torch.Tensor,
        head: Callable[[torch.Tensor], torch.Tensor],
        stale: Callable[[], str | None],
        width: int,
        dtype: Any,
        transforms: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = (),
    ):
        empty = torch.zeros((), dtype=dtype, device=hidden.device).expand(*hidden.shape[:-1], width)
        out = subclass_alias(cls, empty, hidden.requires_grad)
        out.hidden, out.head, out.stale, out.transforms, out.computed = hidden, head, stale, transforms, None
        out.grad_mode = torch.is_grad_enabled()  # the forward's
        return out

    def transform(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (of some tokens, from the head) through this stand-in's transforms."""
        for step in self.transforms:
            logits = step(logits)
        return logits

    def materialize(self) -> torch.Tensor:
        """The real logits, through the head and the transforms, computed once as the forward would have: in its grad
        mode, differentiable even when first read under no_grad (a later loss term reads them again, for its
        gradient); refused once the head changed, whose forward weights are gone."""
        if self.computed is None:
            why = self.stale()
            if why is not None:
                raise RuntimeError(why)
            with torch.inference_mode(False), torch.set_grad_enabled(self.grad_mode):
                self.computed = self.transform(self.head(self.hidden))
        return self.computed

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            return super().__torch_function__(func, types, args, kwargs)
        if func in _SCALAR_OPS and not kwargs:
            stand_ins = [a for a in args if isinstance(a, PendingLogits)]
            numbers = [a for a in args if not isinstance(a, PendingLogits)]
            if len(stand_ins) == 1 and stand_ins[0].computed is None and all(_number(n) for n in numbers):
                (pending,) = stand_ins
                step = lambda t: func(*(t if a is pending else a for a in args))  # noqa: E731
                width = pending.shape[-1]
                return PendingLogits(
                    pending.hidden, pending.head, pending.stale, width, pending.dtype, (*pending.transforms, step)
                )
        return func(*_real(args), **_real(kwargs))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _real(value: Any) -> Any:
    """`value` (an argument, or a list, tuple or dict of them) with every stand-in replaced by its real logits."""
    if isinstance(value, PendingLogits):
        return value.materialize()
    if isinstance(value, (list, tuple)):
        return type(value)(_real(x) for x in value)
    if isinstance(value, dict):
        return {k: _real(x) for k, x in value.items()}
    return value


def real_logits(logits: torch.Tensor) -> torch.Tensor:
    """`logits`, computed if they are a stand-in."""
    return logits.materialize() if isinstance(logits, PendingLogits) else logits
