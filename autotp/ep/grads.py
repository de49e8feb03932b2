"""Expert gradients: summed over the expert-DP group only, and their part of the whole model's gradient norm.

`experts` is the model's `autotp.ep.groups.ExpertGroups` (its `ep` and `edp` groups: `autotp.mesh.EXPERT_AXES`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..mesh import device_of, group_size, named_failure
from ..runtime.collectives import all_reduce_bucketed, any_rank
from ..runtime.rows import local_rows


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters holding this rank's experts (tagged `autotp_expert` by `ExpertRegion`)."""
    return [p for p in model.parameters() if hasattr(p, "autotp_expert")]


def sync_expert_gradients(model: nn.Module, experts, replicas: int, average: bool) -> None:
    """Sum each expert gradient over the expert-DP group, then divide by `replicas` (dp x cp) when averaging.

    An expert's gradient already sums the tokens of every rank of its EP group (the all-to-all's backward), so the
    sum over expert-DP covers the world's tokens once, as the dense gradients' sum over dp x cp does; both are then
    divided by the same count of replicas. At world == ep nothing is summed, but the division still applies.
    A parameter that got no gradient gets a zero one, so the all-reduces and the optimizers agree across ranks;
    but the experts modules that no rank called on a token since the last sync (the vision experts of a text-only
    step) get none on every rank, as one process's never called module gets none, so AdamW skips them there too.
    """
    fed = any_rank(
        [region.fed for region in experts.regions],
        [experts.ep, experts.edp],
        device_of(experts.ep),
        "autotp.allreduce_gradients' all-reduce of which experts modules ran",
    )
    idle = [region for region, used in zip(experts.regions, fed) if not used]
    for region in experts.regions:
        region.fed = False
    params = []
    for p in expert_params(model):
        if p.autotp_expert in idle:
            p.grad = None
        elif p.requires_grad:
            params.append(p)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    all_reduce_bucketed(
        [p.grad for p in params],
        experts.edp,
        "autotp.allreduce_gradients' all-reduce of the expert gradients",
        replicas if average else 1,
    )


def expert_norm(params: list[nn.Parameter], experts, norm_type: float, sharded: bool = False) -> torch.Tensor:
    """The experts' part of the gradient norm (sum of squares, or max): each EP rank's experts counted once; under
    FSDP (`sharded`) each expert-DP rank holds its rows of them (`local_rows`), so the parts are reduced there too."""
    device = params[0].grad.device if params else torch.device("cpu")
    part = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        grad = local_rows(p.grad.detach())[0].double()
        part = part + grad.pow(2).sum() if norm_type == 2.0 else torch.maximum(part, grad.abs().max())
    op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
    with named_failure(experts.ep, "autotp.clip_grad_norm_'s all-reduce of the experts' gradient norm"):
        dist.all_reduce(part, op=op, group=experts.ep)
    if sharded and group_size(experts.edp) > 1:
        with named_failure(experts.edp, "autotp.clip_grad_norm_'s all-reduce of the experts' norm over expert-DP"):
            dist.all_reduce(part, op=op, group=experts.edp)
    return part
