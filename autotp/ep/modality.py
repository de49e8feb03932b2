"""Expert groups a block runs only for some batches, made collective-safe: every EP rank runs each group's dispatch.

Ernie 4.5 VL's MoE block holds text experts and vision experts (`text_moe.experts`, `vision_moe.experts`) and runs
the vision ones only when its batch holds vision tokens. Each dispatch is a run of all-to-alls over the EP group, so
a rank whose replica is text-only would run fewer than its peers (gloo aborts with "collective mismatch"; NCCL may
pair the wrong buffers). A `ModalityGroup` makes every rank run every experts module of the block once a forward, in
module order: one the block skips runs with zero tokens of its own (it still receives, and in backward returns, the
tokens its peers route to its experts), its output tied into the block's so its backward's all-to-alls run too.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..runtime.forward_end import after_every_forward


class ModalityGroup:
    """The experts modules (`ExpertRegion`s, module order) under one block: hooks on the block, `before` called by
    each region's dispatch. A block that runs them out of module order, or one twice, is refused by name."""

    def __init__(self, path: str, model: nn.Module, regions: list):
        self.path, self.regions = path, regions
        self.ran, self.anchor, self.skipping = 0, None, False
        self.skipped: list[torch.Tensor] = []
        block = model.get_submodule(path)
        block.register_forward_pre_hook(self._start, with_kwargs=True)
        block.register_forward_hook(self._finish)
        after_every_forward(model, path, self._drop)  # a forward that raised holds no activation of the block's
        for region in regions:
            region.modality = self

    def before(self, region, hidden_states: torch.Tensor) -> None:
        """`region` is about to dispatch: first run the ones before it that this forward skipped."""
        if self.skipping:  # its own call from `_skip_to`
            return
        index = self.regions.index(region)
        if index < self.ran:
            raise RuntimeError(
                f"ep_size={region.experts.size}: {self.path} ran {region.path} after "
                f"{self.regions[self.ran - 1].path} (or twice) in one forward; autotp runs the experts "
                f"modules of a block in module order on every EP rank, so each rank's all-to-alls "
                f"pair with its peers'"
            )
        self._skip_to(index, hidden_states)
        self.ran = index + 1

    def _start(self, block: nn.Module, args: tuple, kwargs: dict) -> None:
        self.ran, self.skipped = 0, []
        self.anchor = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))

    def _skip_to(self, index: int, hidden_states: torch.Tensor) -> None:
        self.skipping = True
        try:
            for region in self.regions[self.ran : index]:
                self.skipped.append(region.dispatch_nothing(hidden_states))
        finally:
            self.skipping = False

    def _drop(self) -> None:
        """After every forward, one that raised included: what `_start` kept (its input, the skipped dispatches'
        outputs) is let go, without the collectives `_finish` runs."""
        self.skipped, self.anchor = [], None

    def _finish(self, block: nn.Module, args: tuple, output):
        if self.regions[0].state.is_gathered():  # every expert on every rank: no collective to pair
            return output
        self._skip_to(len(self.regions), self.anchor)
        skipped, self.skipped, self.anchor = self.skipped, [], None
        if not skipped or not torch.is_grad_enabled():
            return output
        zero = sum(out.sum() for out in skipped)  # exactly 0: the backward of each skipped dispatch runs
        leaves, spec = pytree.tree_flatten(output)
        first = next(i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point())
        leaves[first] = leaves[first] + zero
        return pytree.tree_unflatten(leaves, spec)


def modality_groups(model: nn.Module, regions: list) -> list[ModalityGroup]:
    """A `ModalityGroup` for each block of `model` (the experts modules' grandparent, Ernie 4.5 VL's `mlp`) holding
    several; a block with one experts module needs none."""
    blocks: dict[str, list] = {}
    for region in regions:
        blocks.setdefault(".".join(region.path.split(".")[:-2]), []).append(region)
    return [ModalityGroup(path, model, members) for path, members in blocks.items() if len(members) > 1]
