"""Expert parallelism on a planned model: what is refused before any group exists, and its `autotp.parallelize` step.

The routed experts come from the plan's expert regions (a shipped policy, transformers' plans) and from structure
(`autotp.ep.regions`). Under `ep_size > 1` the plan's regions are not width-sliced over TP: the EP step keeps whole
experts, split by expert over the EP group, and the rest of the plan is applied as at ep 1.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..mesh import Mesh
from ..options import WrapOptions
from ..planning.plan import Plan
from ..runtime.process_hooks import patch_attribute
from ..runtime.replicas import broadcast_tensors
from ..state import TPState
from .dispatch import ExpertRegion
from .gathered import GatheredBackwardRefusal
from .grads import expert_params
from .groups import ExpertGroups
from .guard import guard_expert_slots
from .modality import modality_groups
from .regions import expert_layouts


def refuse_unsupported(model: nn.Module, plan: Plan, options: WrapOptions) -> None:
    """Raise, naming the reason, for an `ep_size` this model or these options cannot take; needs no process group."""
    ep = options.ep_size
    if ep == 1:
        return
    if not expert_layouts(model, plan, ep):
        raise ValueError(
            f"ep_size={ep}: {type(model).__name__} has no routed experts autotp can find (a dense "
            f"model); expert parallelism splits the experts of MoE layers. Leave ep_size at 1"
        )
    if options.tp_group is not None:
        raise NotImplementedError(
            f"ep_size={ep} with tp_group=: not supported; expert parallelism folds its EP "
            f"groups over consecutive ranks of the world, TP ranks first (autotp.ep.groups), "
            f"which a TP group of the caller's need not be; leave tp_group out"
        )


def expert_paths(model: nn.Module, plan: Plan, options: WrapOptions) -> tuple[str, ...]:
    """The experts modules the EP step splits (none at ep 1): sequence parallelism runs their MoE blocks on its
    chunk of the tokens (`autotp.sp.sequence.sequence_layout`)."""
    if options.ep_size == 1:
        return ()
    return tuple(layout.path for layout in expert_layouts(model, plan, options.ep_size))


def dense_plan(plan: Plan, options: WrapOptions) -> Plan:
    """The plan tensor parallelism applies: without the expert regions when the EP step takes them."""
    return plan if options.ep_size == 1 else replace(plan, regions=())


def expert_parallel(model: nn.Module, plan: Plan, mesh: Mesh, state: TPState) -> ExpertGroups | None:
    """Keep this EP rank's experts of every region of `plan` and dispatch tokens to them (`ExpertRegion`); returns
    the expert grid (None at ep 1)."""
    experts = ExpertGroups.of(mesh)
    if experts is None:
        return None
    layouts = expert_layouts(model, plan, experts.size)
    # the TP ranks hold the same tokens, each dispatching its share; under sequence parallelism each already holds
    # its own chunk, so nothing is split again
    tokens = None if state.options.sequence_parallel else state.tp_group
    for layout in layouts:
        part = ExpertRegion(layout.path, model.get_submodule(layout.path), list(layout.names), experts, tokens, state)
        experts.regions.append(part)
        state.regions.append(part)  # gathered mode: every expert on every rank
    modality_groups(model, experts.regions)  # several experts modules in one block: each run on every EP rank
    state.regions.append(GatheredBackwardRefusal(model, experts))  # after the regions: their gathered shapes
    guard_expert_slots(model, [layout.path for layout in layouts], experts.size)
    if callable(getattr(model, "generate", None)):
        patch_attribute(model, "generate", SyncedGenerate(model.generate))
    return experts


class SyncedGenerate:
    """`model.generate` at ep > 1, with `synced_gpus=True` unless the caller says otherwise: every EP rank must join
    every step's all-to-all, so a rank whose sequences ended first keeps stepping until all have (transformers' own
    switch) instead of leaving its peers waiting in the all-to-all until the timeout."""

    def __init__(self, generate):
        self.generate = generate

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return self.generate(*args, **kwargs)


def broadcast_experts(model: nn.Module, experts: ExpertGroups) -> None:
    """Every expert from the first rank holding it (expert-DP rank 0), as the dense weights come from DP rank 0."""
    broadcast_tensors([p.data for p in expert_params(model)], experts.edp)
