"""Expert parallelism on a planned model: what is refused before any group exists, and the pipeline's step.

The planner finds a model's routed experts as regions (`plan.regions`: fused 3-D experts tensors, experts on dim 0),
from a shipped policy, transformers' plans or structure, verified by emulation like the rest of the plan. Under
`ep_size > 1` those regions are not width-sliced over TP: the EP step keeps whole experts, split by expert over the
EP group, and the rest of the plan is applied as at ep 1.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from ..runtime.replicas import broadcast_tensors
from ..mesh import Mesh
from ..options import WrapOptions
from ..planning.plan import Plan
from .dispatch import ExpertRegion
from .grads import expert_params
from .guard import guard_expert_slots
from .groups import ExpertGroups
from ..state import TPState


def refuse_unsupported(model: nn.Module, plan: Plan, options: WrapOptions) -> None:
    """Raise, naming the reason, for an `ep_size` this model or these options cannot take; needs no process group."""
    ep = options.ep_size
    if ep == 1:
        return
    if not plan.regions:
        lists = [name for name, module in model.named_modules()
                 if name.endswith("experts") and isinstance(module, nn.ModuleList)]
        if lists:
            raise NotImplementedError(f"ep_size={ep}: {type(model).__name__} keeps its experts as per-expert module "
                                      f"lists ({lists[0]}, ...); expert parallelism splits fused experts tensors only "
                                      f"so far")
        raise ValueError(f"ep_size={ep}: {type(model).__name__} has no routed experts autotp can find (a dense "
                         f"model); expert parallelism splits the experts of MoE layers. Leave ep_size at 1")
    for region in plan.regions:
        module = model.get_submodule(region.path)
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or not hasattr(module, "_is_expert_parallel"):
            raise NotImplementedError(f"ep_size={ep}: {region.path} ({type(module).__name__}) is not a transformers "
                                      f"experts module called as experts(hidden_states, top_k_index, top_k_weights); "
                                      f"autotp cannot dispatch tokens to it")
        wrong = [name for name, shape, _ in region.partitions if shape[0] != experts]
        if wrong:
            raise NotImplementedError(f"ep_size={ep}: {region.path}.{wrong[0]} does not hold its {experts} experts on "
                                      f"dim 0; autotp cannot split it by expert")
        if experts % ep:
            raise ValueError(f"ep_size={ep} does not divide the {experts} experts of {region.path}: each EP rank must "
                             f"hold the same number of whole experts; pick an ep_size that divides {experts}")
    for given, why in ((options.cp_size > 1, f"cp_size={options.cp_size}"),
                       (options.sequence_parallel, "sequence_parallel"),
                       (options.tp_group is not None, "tp_group=")):
        if given:
            raise NotImplementedError(f"ep_size={ep} with {why}: not supported yet; expert parallelism composes with "
                                      f"tp_size and data parallelism only so far")


def dense_plan(plan: Plan, options: WrapOptions) -> Plan:
    """The plan tensor parallelism applies: without the expert regions when the EP step takes them."""
    return plan if options.ep_size == 1 else replace(plan, regions=())


def expert_parallel(model: nn.Module, plan: Plan, mesh: Mesh, state: TPState) -> None:
    """Keep this EP rank's experts of every region of `plan` and dispatch tokens to them (`ExpertRegion`)."""
    experts = ExpertGroups.of(mesh)
    if experts is None:
        return
    for region in plan.regions:
        names = [name for name, _, _ in region.partitions]
        part = ExpertRegion(model.get_submodule(region.path), names, experts, state.tp_group, state)
        experts.regions.append(part)
        state.regions.append(part)  # gathered mode: every expert on every rank
    state.ep = experts
    guard_expert_slots(model, [region.path for region in plan.regions], experts.size)


def broadcast_experts(model: nn.Module, state: TPState) -> None:
    """Every expert from the first rank holding it (expert-DP rank 0), as the dense weights come from DP rank 0."""
    if state.ep is not None:
        broadcast_tensors([p.data for p in expert_params(model)], state.ep.data)
