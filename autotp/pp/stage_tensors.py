"""Every pipeline stage's tensors as one model's, for `save_pretrained` and `export_weights` at pp > 1.

Why: each rank holds its own stages' tensors only (its decoder layers, the embedding on the first stage, the final
norm and the head on the last: `autotp.pp.cut.owner`), so no rank knows the whole model's names. `stage_tensors`
learns every stage's names, full shapes and dtypes in one all-gather over the PP group and lists them in one
process's order, the tensors of other stages as one-element stand-ins expanded to their full shape (a layout is
computed from them; nothing is allocated). Names that hold one tensor on any rank (a tied head), or in the whole
model as wrapped (a block that layers on two stages share: Zamba's), hold one tensor or stand-in too, so
transformers' own rule drops the tied aliases. Each tensor is then gathered over TP on the stage that owns it,
as at pp 1, and `StageTensors.forward` sends it from there to PP rank 0, one message per tensor (save) or bucket
(export): no rank holds more than that beyond its own shards. The pipeline's `collect` hook
(`autotp.runtime.dimension.Collected`), which `autotp.io.hf.save` and `autotp.io.rollout.export` call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..compat.hf_conversion import SavedPart
from ..mesh import Group, device_of, group_rank, group_size, named_failure
from ..runtime.dimension import Like
from ..runtime.shards import full_shape
from ..state import TPState
from .cut import Cut, owner

_TAG = 0x41545050  # apart from the streaming gather's, the row gather's and a user's point-to-point tags
_ALIGN = 16  # every tensor starts on this many bytes of a message, so it can be viewed as any dtype


class StageTensors:
    """`params`: every stage's tensors by name, in one process's order (this rank's own where it runs their stage,
    stand-ins elsewhere); `stage`: the stage that owns each (`autotp.pp.cut.owner`); `experts`: those split over EP
    on their stage (a stand-in does not say)."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        stage: dict[str, int],
        state: TPState,
        experts: frozenset[str],
        stages: list[int],
        group: Group,
        rank_of: Callable[[int], int],
    ) -> None:
        self.params, self.stage, self.experts, self.mine = params, stage, experts, set(stages)
        self.group, self.rank_of = group, rank_of
        self.size = group_size(self.group)
        grid = state.mesh.grid  # pp x dp x cp x tp: the replica of global rank 0 is dp 0, cp 0
        self.replica = set(range(dist.get_world_size()) if grid is None else grid[:, 0, 0, :].flatten().tolist())
        self.first_replica = dist.get_rank() in self.replica

    def gathers(self, group: Group) -> bool:
        """Whether this rank takes part in gathering a tensor split over `group` (TP, or EP for the experts), on its
        stage: the first replica's ranks, and the other ranks of an EP group folded over DP with one of them."""
        return self.first_replica or (
            group is not None and not self.replica.isdisjoint(dist.get_process_group_ranks(group))
        )

    def holds(self, name: str) -> bool:
        """Whether this rank runs the stage that owns `name` (then it takes part in gathering it)."""
        return self.stage[name] in self.mine

    def key(self, name: str) -> tuple[int, int]:
        """An export bucket holds one stage's experts or its other tensors (alike on every rank: another stage's are
        stand-ins, which hold no group)."""
        return int(name in self.experts), self.stage[name]

    def forward(self, name: str, fetch: Callable[[bool], Any], like: Callable[[], Like], lead: bool) -> Any:
        """What `fetch` returns for `name`'s tensors on the ranks of its stage (collective over its TP group), where the
        stage is PP rank 0's; else `fetch(True)`'s tensors (a list) sent from the stage's `lead` rank (the one the
        tensors are gathered to at pp 1) to PP rank 0's, in one message, received there as `like()` says (shapes,
        dtypes). None on every other rank."""
        src, me = self.rank_of(self.stage[name]), group_rank(self.group)
        if me == src:
            got = fetch(src != 0)
            if src == 0:
                return got
            if lead:
                self._send(got)
            return None
        return self._receive(src, like()) if me == 0 and lead else None

    def fetching(
        self,
        fetch: Callable[[str, bool], torch.Tensor | None],
        fetch_part: Callable[[SavedPart], torch.Tensor | None],
        lead: bool,
    ) -> tuple[Callable[[str], torch.Tensor | None], Callable[[SavedPart], torch.Tensor | None]]:
        """`save_pretrained`'s fetches of a whole tensor and of a part (one expert) under a pipeline: run on the
        owning stage (`fetch(name, sent)`: a full tensor, not a stream, where it is sent on), the result at PP rank 0."""

        def whole(name: str) -> torch.Tensor | None:
            like = [(full_shape(self.params[name]), self.params[name].dtype)]
            return _single(self.forward(name, lambda sent: _listed(fetch(name, sent), sent), lambda: like, lead))

        def part(cut: SavedPart) -> torch.Tensor | None:
            source = self.params[cut.source]
            shape = cut.cut(torch.empty(full_shape(source), dtype=source.dtype, device="meta")).shape

            def like() -> Like:
                return [(tuple(shape), source.dtype)]

            return _single(self.forward(cut.source, lambda sent: _listed(fetch_part(cut), sent), like, lead))

        return whole, part

    def _send(self, tensors: list[torch.Tensor]) -> None:
        offsets, total = _offsets([(tuple(t.shape), t.dtype) for t in tensors])
        if not total:
            return
        flat = torch.empty(total, dtype=torch.uint8, device=device_of(self.group))  # NCCL sends device memory
        for tensor, at in zip(tensors, offsets):
            flat[at : at + tensor.nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        with named_failure(self.group, "autotp: a stage's tensors sent to PP rank 0 (save or export)"):
            dist.send(flat, dist.get_global_rank(self.group, 0), group=self.group, tag=_TAG)

    def _receive(self, src: int, like: Like) -> list[torch.Tensor]:
        offsets, total = _offsets(like)
        flat = torch.empty(total, dtype=torch.uint8, device=device_of(self.group))
        if total:
            with named_failure(self.group, "autotp: a stage's tensors received on PP rank 0 (save or export)"):
                dist.recv(flat, dist.get_global_rank(self.group, src), group=self.group, tag=_TAG)
        return [
            flat[at : at + torch.Size(shape).numel() * dtype.itemsize].view(dtype).view(shape)
            for (shape, dtype), at in zip(like, offsets)
        ]


def stage_tensors(
    model: nn.Module,
    params: dict[str, torch.Tensor],
    state: TPState,
    cut: Cut,
    stages: list[int],
    group: Group,
    ties: list[tuple[str, ...]],
    rank_of: Callable[[int], int],
) -> StageTensors:
    """Every stage's tensors by name (see the module's docstring): `params` is this rank's state dict (keep_vars) of
    `model`, the model `autotp.wrap` cut at `cut`, this rank running `stages`; `ties`, the names of each tensor held
    under several over the whole model as wrapped; `rank_of`, the PP rank running a stage. Collective over the PP
    `group`."""
    stage_of = owner(model, cut)
    mine = [
        (stage_of(n), n, full_shape(t), t.dtype, isinstance(t, nn.Parameter), hasattr(t, "autotp_expert"))
        for n, t in params.items()
        if stage_of(n) in stages
    ]
    by_tensor: dict[int, list[str]] = {}
    for name, tensor in params.items():
        by_tensor.setdefault(id(tensor), []).append(name)
    owned = {name for _, name, *_ in mine}  # a tie counts where the tensor is one this rank trains (not a stand-in)
    tied_here = [names for names in by_tensor.values() if len(names) > 1 and owned.intersection(names)]
    gathered: list[Any] = [None] * group_size(group)
    with named_failure(group, "autotp: the stages' tensor names gathered over PP (save or export)"):
        dist.all_gather_object(gathered, (mine, tied_here), group=group)
    entries = sorted((e for listed, _ in gathered for e in listed), key=lambda e: e[0])  # stable: a stage's own order
    merged: dict[str, torch.Tensor] = {}
    for stage, name, shape, dtype, parameter, _ in entries:
        merged[name] = params[name] if stage in stages else _stand_in(shape, dtype, parameter)
    every = [names for _, tied in gathered for names in tied] + ties  # on a rank, and over the whole model
    for names in every:  # one tensor under several names (a tied head; a block layers on two stages share)
        present = [n for n in names if n in merged]
        held = [n for n in present if merged[n] is params.get(n)]
        for name in present:
            merged[name] = merged[(held or present)[0]]
    experts = frozenset(name for _, name, *_, expert in entries if expert)
    return StageTensors(merged, {name: stage for stage, name, *_ in entries}, state, experts, stages, group, rank_of)


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype, parameter: bool) -> torch.Tensor:
    """A tensor of `shape` and `dtype` over one element: what a layout reads of another stage's tensor."""
    tensor = torch.empty((), dtype=dtype).expand(shape)
    return nn.Parameter(tensor, requires_grad=False) if parameter else tensor


def _listed(got: Any, sent: bool) -> Any:
    """A fetch's result as `forward` sends it: in a list."""
    return [got] if sent and got is not None else got


def _single(got: Any) -> Any:
    """A received list of one tensor, or a fetch's own result, as the fetch returns it."""
    return got[0] if isinstance(got, list) else got


def _offsets(like: Like) -> tuple[list[int], int]:
    """Where each tensor of a message starts, and its bytes."""
    offsets, end = [], 0
    for shape, dtype in like:
        offsets.append(-(-end // _ALIGN) * _ALIGN)
        end = offsets[-1] + torch.Size(shape).numel() * dtype.itemsize
    return offsets, end
