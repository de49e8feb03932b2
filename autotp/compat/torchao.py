"""torchao, an optional dependency (`autotp[fp8]`): its classes recognised by the module they are defined in, without
importing it, and its float8 linears run in high precision while the planner checks a block's sharding."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


def is_torchao(cls: type) -> bool:
    """Whether `cls` (or a base) is defined in torchao."""
    return any(c.__module__ == "torchao" or c.__module__.startswith("torchao.") for c in cls.__mro__)


def is_float8_linear(module: nn.Module) -> bool:
    """Whether `module` is torchao's `Float8Linear` (`convert_to_float8_training`)."""
    return type(module).__name__ == "Float8Linear" and is_torchao(type(module))


@contextmanager
def high_precision(model: nn.Module) -> Iterator[None]:
    """`model`'s `Float8Linear` layers compute as `nn.Linear` meanwhile (copies made meanwhile too). The planner's
    emulation checks a sharding's arithmetic; float8 would round each emulated shard with its own scale, and its
    gap would hide that (sharded, autotp scales them as the whole tensor: `autotp.tp.float8`)."""
    layers = [m for m in model.modules() if is_float8_linear(m)]
    own = {id(layer): vars(layer).get("forward") for layer in layers}  # a forward set on the instance, kept
    for layer in layers:
        vars(layer)["forward"] = nn.Linear.forward.__get__(layer)
    try:
        yield
    finally:
        for layer in layers:
            vars(layer).pop("forward")
            if own[id(layer)] is not None:
                vars(layer)["forward"] = own[id(layer)]
