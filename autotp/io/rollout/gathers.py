"""Where `export_weights` gathers each bucket of tensors: over the TP group to its rank 0, over the EP group to each
of its TP rank 0s for experts, and where the model is held in parts (a pipeline's stages) where the tensor is held,
then sent on to rank 0 (`autotp.runtime.dimension.Collected`)."""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist

from ...mesh import Group, group_rank
from ...runtime.dimension import Collected
from .row_gather import RowRequest, delivered_shape, gather_rows_to


class Gathers:
    """Where each exported tensor is gathered: over the TP group to its rank 0, or, for experts (`autotp.ep`), over
    the EP group to each of its ranks that is TP rank 0 (each such rank yields every tensor, as at ep 1)."""

    def __init__(
        self, state, groups: dict[str, Group], parts: Collected | None = None, sources: dict[str, str] | None = None
    ):
        self.groups, self.writers = groups, {}  # group -> its ranks that get the tensors (else its rank 0)
        self.sources = sources or {}  # an exported name -> the model tensor it is cut from (the held part's name)
        self.parts, self.lead = parts, state is None or group_rank(state.tp_group) == 0
        for group in [] if state is None else state.split_groups():  # a dimension's own split (the experts over EP)
            firsts = set(state.mesh.grid[..., 0].flatten().tolist())  # TP rank 0 of every TP group (TP innermost)
            ranks = dist.get_process_group_ranks(group)
            self.writers[group] = [i for i, rank in enumerate(ranks) if rank in firsts]

    def key(self, name: str) -> tuple[int, int]:
        """Tensors gathered over one group go in one bucket; held in parts, as the parts say (`Collected.key`: a
        stage's experts or its other tensors, alike on every rank)."""
        if self.parts is None:
            return id(self.groups[name]), -1
        return self.parts.key(self.sources[name])

    def __call__(self, bucket: list, reqs: list[RowRequest]) -> Iterator[torch.Tensor] | None:
        """The bucket's tensors where they are gathered; held in parts, gathered where they are held and sent on to
        rank 0 (`Collected.forward`)."""
        if self.parts is None:
            return self._gather(bucket, reqs)

        def fetch(sent: bool) -> Any:
            got = self._gather(bucket, reqs)
            return list(got) if sent and got is not None else got

        def like() -> list:
            return [(delivered_shape(r), r.dtype) for r in reqs]

        got = self.parts.forward(self.sources[bucket[0][0]], fetch, like, self.lead)
        return iter(got) if isinstance(got, list) else got

    def _gather(self, bucket: list, reqs: list[RowRequest]) -> Iterator[torch.Tensor] | None:
        group = self.groups[bucket[0][0]]
        mine = None
        for dst in self.writers.get(group, [0]):  # every gather completes its messages before it returns
            got = gather_rows_to(reqs, group, dst=dst)
            mine = got if got is not None else mine
        return mine
