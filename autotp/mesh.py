"""The mesh: one rank grid pp x dp x cp x tp with named axes, a process group per axis and per flattened view.

`Mesh` is built once per wrap from one grid: TP innermost (consecutive ranks), CP next, DP next, PP outermost (so
pipeline stages can sit on different nodes); the
flattened view dp x cp (`dp_cp`) is where gradients average and FSDP shards. Every other module reads groups from
it by name; EP's edp x ep grid folds over the same ranks (`EXPERT_AXES`), and a new dimension is one more entry
of `AXIS_TABLE` here. `new_group` is collective over the world, so every function here that creates groups must
be called by every rank, in the same order. A TP or CP group of
`None` means that axis has size 1; the DP group is a real group at every size (one rank when there is one
replica), so a collective over it never reaches the world. Also here: which device a group's collectives use
(`device_of`) and the error a failed collective raises (`named_failure`), which every autotp collective goes
through.
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Iterable, Iterator, TypeAlias

import torch
import torch.distributed as dist

from .compat.torch import backend_timeout

Group: TypeAlias = dist.ProcessGroup | None

# How long a collective may wait for a peer before failing, when neither the user's
# init_process_group nor wrap(..., timeout=) says otherwise (torch's own default is 30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=5)

_AT_FINISH: list[Callable[[], None]] = []  # work in the background that `finish` must wait for (async saves)


def group_size(group: Group) -> int:
    """Size of a group; `None` (no tensor parallelism, or no torch.distributed) is size 1, never the world group."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Group) -> int:
    """This process's rank inside `group`; `None` (an axis of size 1, or no torch.distributed) is rank 0."""
    return 0 if group is None else dist.get_rank(group)


def device_of(group: Group) -> torch.device:
    """The device a collective over `group` needs: this process's current GPU under NCCL, else the CPU (no group,
    gloo). The one place that decides it, so a model, a mesh and a message buffer all land on the same device."""
    if group is not None and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def global_rank() -> int:
    """This process's rank in the world (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_global_rank0() -> bool:
    """Whether this process writes files and prints progress for the job (rank 0, or not distributed)."""
    return global_rank() == 0


def world_timeout() -> timedelta:
    """The timeout the default process group was created with, or `DEFAULT_TIMEOUT` without one (torch has no
    public getter: `autotp.compat.torch.backend_timeout` reads it)."""
    return backend_timeout() or DEFAULT_TIMEOUT


def new_group(ranks: list[int], timeout: timedelta, what: str, backend: str | None = None) -> dist.ProcessGroup:
    return dist.new_group(ranks, timeout=timeout, backend=backend, group_desc=f"autotp {what} {ranks}")


@contextmanager
def named_failure(
    group: dist.ProcessGroup, what: str, fix: str = "Every rank must run the same training step."
) -> Iterator[None]:
    """Re-raise a failed or timed-out collective with the group's ranks and `fix` (what to do) in the message."""
    try:
        yield
    except RuntimeError as err:
        raise RuntimeError(
            f"autotp: {what} over ranks {dist.get_process_group_ranks(group)} failed ({err}); a rank "
            f"of that group failed, hung or never called it. {fix}"
        ) from err


def build_subgroups(
    rank_sets: Iterable[tuple[int, ...]], mesh: Mesh, timeout: timedelta = DEFAULT_TIMEOUT
) -> dict[tuple[int, ...], Group]:
    """Process groups for sets of TP-group ranks (replica holders), in this rank's TP group.

    `new_group` is collective over the world, so every rank creates every TP group's subgroups, in the same order,
    from the mesh's grid (which knows every TP group, a user-supplied one too).
    """
    rank_sets = sorted(set(rank_sets))
    if not rank_sets or group_size(mesh.tp) == 1:
        return {}
    mine = tuple(dist.get_process_group_ranks(mesh.tp))
    out = {}
    for subset in rank_sets:
        for tp_ranks in mesh.rank_groups("tp"):
            group = new_group([tp_ranks[i] for i in subset], timeout, "replica group")
            if tp_ranks == mine:
                out[subset] = group
    return out


def launched_by_torchrun() -> bool:
    """True when torchrun / accelerate set the variables `init_process_group` reads."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


def init_from_env(timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialise torch.distributed from launcher variables: NCCL on GPUs (device from LOCAL_RANK), else gloo."""
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl", timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)


def at_finish(wait: Callable[[], None]) -> None:
    """Have `finish` call `wait` first (a higher tier's background work, such as an async checkpoint save)."""
    _AT_FINISH.append(wait)


def finish() -> None:
    """End a distributed script: wait for background saves, a barrier over the world, then `destroy_process_group`.
    Call it on every rank.

    A gloo worker thread drops its reference to a collective's tensors just after the caller's wait
    returns. If that rank's interpreter is already shutting down, the thread cannot take the GIL and the
    process aborts with "terminate called without an active exception" (a torch/CPython race, seen in
    about 1 of 6 four-rank runs that exit straight after a collective). The barrier holds no tensors
    and leaves the workers time to let go before anyone exits.
    """
    for wait in _AT_FINISH:
        wait()
    if dist.is_available() and dist.is_initialized():
        with named_failure(dist.group.WORLD, "autotp.finish's barrier", "Call autotp.finish on every rank."):
            dist.barrier()
        dist.destroy_process_group()


DP_CP = ("dp", "cp")  # the ranks holding the same shards: gradients average here, FSDP shards here


@dataclass(frozen=True)
class Axis:
    """One axis of the mesh, as messages and groups name it."""

    grid: str  # "dense": an axis of `grid` (pp x dp x cp x tp); "experts": of the folded grid `experts` (edp x ep)
    title: str  # in sentences: "world = data parallel x tensor parallel"
    label: str  # in group names: "TP group", "DP x CP group"
    compared_over: tuple[str, ...] | None  # the view over which wrap's ranks agree for this axis (`Mesh.compared`);
    # None: derived from the others (edp is the world over ep), so neither compared nor shown by `Mesh.__repr__`


AXIS_TABLE = {  # every axis of the mesh, outermost first within each grid; a new dimension is one more entry here
    "pp": Axis("dense", "pipeline parallel", "PP", ("pp",)),
    "dp": Axis("dense", "data parallel", "DP", DP_CP),
    "cp": Axis("dense", "context parallel", "CP", ("cp",)),
    "tp": Axis("dense", "tensor parallel", "TP", ("tp",)),
    "epp": Axis("experts", "pipeline stage of the experts", "expert-PP", None),  # edp stays inside a stage
    "edp": Axis("experts", "expert data parallel", "expert-DP", None),
    "ep": Axis("experts", "expert parallel", "EP", ("ep",)),
}
AXES = tuple(name for name, axis in AXIS_TABLE.items() if axis.grid == "dense")  # the grid's axes, outermost first
EXPERT_AXES = tuple(name for name, axis in AXIS_TABLE.items() if axis.grid == "experts")  # the experts' grid folded
# over the same ranks: ep consecutive ranks (TP ranks first)
_VIEWS = [(axis,) for axis in reversed(AXES)] + [DP_CP]  # the groups every mesh has, in the order they are made


@dataclass(frozen=True)
class Mesh:
    """This rank's view of the rank grid: `grid[p, d, c, t]` is the global rank at those coordinates, and `groups`
    holds this rank's group along each axis or flattened view (keyed by the axes' names).

    autotp lays the grid out as rank ((p * dp + d) * cp + c) * tp + t; around a user's `tp_group` the grid is that group's
    ranks in their order, one row per TP group. `grid` is None without torch.distributed, or for a tp 1 wrap,
    which runs no collective (then `dp` is the world)."""

    grid: torch.Tensor | None = None
    groups: dict[tuple[str, ...], Group] = field(default_factory=dict)
    experts: torch.Tensor | None = None  # the folded expert grid, edp x ep (None at ep 1)

    def group(self, *axes: str) -> Group:
        """The group along `axes` (one axis, or a flattened view such as ("dp", "cp")); None for a size-1 TP or CP."""
        return self.groups.get(tuple(axes))

    @property
    def tp(self) -> Group:
        return self.group("tp")

    @property
    def cp(self) -> Group:
        return self.group("cp")

    @property
    def dp(self) -> Group:
        """The data-parallel replicas: the ranks at this rank's TP and CP coordinates, reading different batches."""
        return self.group("dp")

    @property
    def dp_cp(self) -> Group:
        """DP x CP: every rank holding this rank's shards. Gradients are averaged (summed over CP) and FSDP shards here."""
        return self.group(*DP_CP)

    def size(self, *axes: str) -> int:
        return group_size(self.group(*axes))

    def rank_groups(self, *axes: str) -> list[tuple[int, ...]]:
        """Every group along `axes` in the world, as global ranks, in the order every rank creates them."""
        grid, names = (self.experts, EXPERT_AXES) if axes[0] in EXPERT_AXES else (self.grid, AXES)
        assert grid is not None  # always: asked only of a mesh over the world (`build_mesh`; experts at ep > 1)
        names = names[len(names) - grid.dim() :]  # the experts' grid has no epp axis at pp 1
        rest = [a for a in names if a not in axes]
        order = [names.index(a) for a in rest] + [names.index(a) for a in axes]
        width = math.prod(grid.shape[names.index(axis)] for axis in axes)
        return [tuple(row) for row in grid.permute(order).reshape(-1, width).tolist()]

    def compared(self) -> list[tuple[str, Group]]:
        """This rank's group for each axis that wrap's ranks compare their configs, options and plans over
        (`autotp.runtime.agreement.check_agreement`), labelled, innermost first; together they span the world."""
        innermost = [*reversed(AXES), *reversed(EXPERT_AXES)]
        return [
            (AXIS_TABLE[name].label, self.group(*over))
            for name in innermost
            if (over := AXIS_TABLE[name].compared_over) is not None
        ]

    def __repr__(self) -> str:
        sizes = ", ".join(
            f"{name}={self.size(name)}" for name, axis in AXIS_TABLE.items() if axis.compared_over is not None
        )
        return f"Mesh({sizes})"


def build_mesh(sizes: dict[str, int], timeout: timedelta, tp_group: Group = None) -> Mesh:
    """This rank's mesh over the world for `sizes` (every axis but DP, by name: `WrapOptions.sizes`), DP taking the
    rest, or around the user's `tp_group` (every other axis 1). Collective: every rank calls it with the same sizes,
    which `autotp.runtime.agreement.check_sizes` made sure of."""
    world = dist.get_world_size()
    check_world(sizes, world, dense=tp_group is None)
    grid = _grid_around(tp_group) if tp_group is not None else dense_grid(sizes, world)
    ep = sizes.get("ep", 1)
    mesh = Mesh(grid, experts=expert_grid(sizes, world))
    made: dict[tuple[int, ...], Group] = {}
    for axes in _VIEWS + ([("ep",), ("edp",)] if ep > 1 else []):
        if axes == ("tp",) and tp_group is not None:
            mesh.groups[axes] = tp_group
        elif axes in (("dp",), DP_CP, ("ep",), ("edp",)) or grid.shape[AXES.index(axes[0])] > 1:
            mesh.groups[axes] = _view_group(mesh, axes, timeout, made)
    return mesh


def dense_grid(sizes: dict[str, int], world: int) -> torch.Tensor:
    """The dense grid pp x dp x cp x tp over `world` ranks: rank ((p * dp + d) * cp + c) * tp + t, TP innermost, DP
    taking the rest."""
    given = math.prod(sizes.get(axis, 1) for axis in AXES if axis != "dp")
    return torch.arange(world).reshape(*[world // given if axis == "dp" else sizes.get(axis, 1) for axis in AXES])


def expert_grid(sizes: dict[str, int], world: int) -> torch.Tensor | None:
    """The experts' grid edp x ep folded over the same `world` ranks: EP groups of `ep` consecutive ranks (so TP ranks
    first), expert-DP strided across them; None at ep 1. Under a pipeline, epp x edp x ep: expert-DP inside each
    stage (epp: the pp stages, of consecutive ranks, whose experts are other layers')."""
    ep, pp = sizes.get("ep", 1), sizes.get("pp", 1)
    if ep == 1:
        return None
    grid = torch.arange(world).reshape(pp, world // (pp * ep), ep)
    return grid if pp > 1 else grid[0]


def check_world(sizes: dict[str, int], world: int, dense: bool = True) -> None:
    """Raise, naming the sizes, unless a mesh of `sizes` (`WrapOptions.sizes`) fits `world` ranks: the dense grid's
    sizes (`dense`: not around a user's tp_group) and ep_size must each divide it. `build_mesh` and `autotp plan`
    (at world = pp x dp x cp x tp) both refuse here, so the planner accepts exactly the layouts wrap does."""
    shape = [sizes.get(axis, 1) for axis in AXES if axis != "dp"]
    if dense and world % math.prod(shape):
        named = " x ".join(f"{axis}_size={n}" for axis, n in sizes.items() if n > 1 or axis == "tp")
        shown = [axis for axis in AXES if axis == "dp" or axis == "tp" or sizes.get(axis, 1) > 1]
        raise ValueError(
            f"{named} must divide the world size {world} (world = "
            + " x ".join(AXIS_TABLE[axis].title for axis in shown)
            + ")"
        )
    ep = sizes.get("ep", 1)
    if world % ep:
        raise ValueError(
            f"ep_size={ep} must divide the world size {world}: the experts are split over ep_size "
            f"consecutive ranks and the rest of the world holds copies of them (expert data parallel)"
        )
    pp = sizes.get("pp", 1)
    if ep > 1 and (world // pp) % ep:
        raise ValueError(
            f"ep_size={ep} must divide the {world // pp} ranks of a pipeline stage (world {world} / pp_size={pp}): "
            f"an EP group splits the experts of its stage's layers"
        )


def world_mesh() -> Mesh:
    """A tp 1 wrap's mesh: no collective at wrap, so some ranks only may wrap; the DP group is the world."""
    world = dist.group.WORLD if dist.is_initialized() else None
    return Mesh(None, {} if world is None else {("dp",): world, DP_CP: world})


def _view_group(mesh: Mesh, axes: tuple[str, ...], timeout: timedelta, made: dict[tuple[int, ...], Group]) -> Group:
    """Create every group along `axes` (the same ranks as a view made before share its group); return this rank's."""
    rank, mine = dist.get_rank(), None
    for ranks in mesh.rank_groups(*axes):
        if ranks not in made:
            made[ranks] = new_group(list(ranks), timeout, " x ".join(AXIS_TABLE[a].label for a in axes) + " group")
        if rank in ranks:
            mine = made[ranks]
    return mine


def _grid_around(tp_group: dist.ProcessGroup) -> torch.Tensor:
    """The grid whose TP groups are the user's (learnt from every rank: one all-gather); other axes 1."""
    mine = tuple(dist.get_process_group_ranks(tp_group))
    everyone: list = [None] * dist.get_world_size()
    with named_failure(
        dist.group.WORLD,
        "learning every rank's tp_group to build the mesh around it",
        "Every rank must call wrap with its own tp_group.",
    ):
        dist.all_gather_object(everyone, mine)
    groups = sorted(set(everyone))
    return torch.tensor(groups).reshape(*[len(groups) if a == "dp" else len(mine) if a == "tp" else 1 for a in AXES])
