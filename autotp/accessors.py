"""The accessors: a wrapped model's groups, ranks and sizes along each axis of its mesh (`autotp.mesh`).

`group`, `rank` and `size` take an axis by name (`autotp.mesh.AXIS_TABLE`); the named ones (`tp_group`, `ep_size`,
...) are aliases of them. Each takes the model; without one it uses the only wrapped model alive in the process
(`autotp.state.state_of`), and refuses when there are several rather than guess.
"""

from __future__ import annotations

from torch import nn

from .mesh import AXIS_TABLE, DP_CP, Group, group_rank, group_size
from .state import state_of

# The axes a user asks for, and the flattened view DP x CP; not edp, which is no group at ep 1 (the experts' copies
# then span the whole world, so None there would read as size 1).
_ACCESSIBLE: list[tuple[str, ...]] = [
    (name,) for name, axis in AXIS_TABLE.items() if axis.compared_over is not None
] + [DP_CP]


def group(model: nn.Module | str | None = None, *axes: str) -> Group:
    """This rank's group along an axis of `model`'s mesh: `group(model, "ep")`, or `group("ep")` for the only wrapped
    model alive; `group(model, "dp", "cp")` for DP x CP. None for an axis of size 1, but for "dp" and DP x CP: groups
    at every size (None only for a tp_size=1 wrap without torch.distributed initialised). An unknown axis is refused
    with the valid ones named."""
    if isinstance(model, str):  # group("ep"): no model given
        return group(None, model, *axes)
    if axes not in _ACCESSIBLE:
        valid = ", ".join(repr(view[0]) for view in _ACCESSIBLE if len(view) == 1)
        raise ValueError(
            f"no axis {', '.join(map(repr, axes)) or '(none given)'} in autotp's mesh: name one of {valid}, "
            f"or {', '.join(map(repr, DP_CP))} for DP x CP"
        )
    return state_of(model).mesh.group(*axes)


def rank(model: nn.Module | str | None = None, *axes: str) -> int:
    """This rank's index in `group(model, *axes)`; 0 where that is None."""
    return group_rank(group(model, *axes))


def size(model: nn.Module | str | None = None, *axes: str) -> int:
    """The number of ranks in `group(model, *axes)`; 1 where that is None."""
    return group_size(group(model, *axes))


def tp_group(model: nn.Module | None = None) -> Group:
    """The TP group of `model` (or of the only wrapped model alive in this process); None when tp=1."""
    return group(model, "tp")


def dp_group(model: nn.Module | None = None) -> Group:
    """The data-parallel group: the replicas reading different batches (same TP and CP rank); this rank alone when
    there is one replica, so `dist.all_reduce(x, group=dp_group(model))` works at every size. Without context
    parallelism it is also the group holding the same shards, for `DistributedDataParallel(model,
    process_group=dp_group(model))`; with it, use `dp_cp_group`. None only for a tp_size=1 wrap without
    torch.distributed initialised."""
    return group(model, "dp")


def dp_cp_group(model: nn.Module | None = None) -> Group:
    """The ranks holding the same shards, DP x CP: gradients are averaged over it (`allreduce_gradients`, DDP's
    `process_group`), and `autotp.fully_shard` shards over it. Equals `dp_group` at cp_size 1."""
    return group(model, *DP_CP)


def cp_group(model: nn.Module | None = None) -> Group:
    """The context-parallel group: the ranks splitting one sequence; None at cp_size 1."""
    return group(model, "cp")


def cp_rank(model: nn.Module | None = None) -> int:
    return rank(model, "cp")


def cp_size(model: nn.Module | None = None) -> int:
    return size(model, "cp")


def tp_rank(model: nn.Module | None = None) -> int:
    return rank(model, "tp")


def tp_size(model: nn.Module | None = None) -> int:
    return size(model, "tp")


def dp_rank(model: nn.Module | None = None) -> int:
    return rank(model, "dp")


def dp_size(model: nn.Module | None = None) -> int:
    return size(model, "dp")


def ep_group(model: nn.Module | None = None) -> Group:
    """The expert-parallel group: the ranks splitting each MoE layer's experts (`autotp.ep`); None at ep_size 1."""
    return group(model, "ep")


def ep_rank(model: nn.Module | None = None) -> int:
    return rank(model, "ep")


def ep_size(model: nn.Module | None = None) -> int:
    return size(model, "ep")


def pp_group(model: nn.Module | None = None) -> Group:
    """The pipeline-parallel group: the ranks holding the stages of one pipeline; None at pp_size 1."""
    return group(model, "pp")


def pp_rank(model: nn.Module | None = None) -> int:
    """This rank's stage (its first, under a looped schedule)."""
    return rank(model, "pp")


def pp_size(model: nn.Module | None = None) -> int:
    return size(model, "pp")
