"""FSDP2 on the experts (`autotp.fully_shard` at ep > 1): each experts module sharded over its expert-DP group.

The dense layers are sharded over DP x CP (`autotp.dp.fsdp`); an EP rank's experts exist only on the ranks holding
the same experts, so their FSDP unit is the experts module over the expert-DP group, as torchtitan shards MoE
experts over its `dp_mod_ep` mesh. FSDP's reduce-scatter over expert-DP sums each expert's gradient over the world's
tokens once (the all-to-all's backward already summed its EP group's); dividing by the DP x CP replicas, not the
expert-DP size, then matches the dense average (`autotp.ep.grads.sync_expert_gradients` at plain data parallelism).
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh

from ..mesh import device_of, group_size


def shard_experts(experts, options: dict[str, Any], replicas: int) -> dict[int, Any]:
    """`fully_shard` each expert region's module over `experts.edp` (expert-DP), before the decoder layers are
    sharded around them; returns {id of FSDP's new parameter: its `autotp_expert` region} to tag them again."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    grouped = next((region.modality for region in experts.regions if region.modality is not None), None)
    if grouped is not None:  # FSDP2 reduces the gradients this rank's batch reached: replicas would pair others
        raise NotImplementedError(
            f"autotp.fully_shard at ep_size={experts.size}: {grouped.path} runs its experts modules "
            f"({', '.join(region.path for region in grouped.regions)}) only on the batches holding their modality's "
            f"tokens, so the replicas' FSDP reductions would differ (a router unused by one replica); train it with "
            f"autotp.allreduce_gradients, which first agrees on the gradients some replica reached"
        )
    mesh = DeviceMesh.from_group(experts.edp, device_of(experts.edp).type)
    tags = {}
    for region in experts.regions:
        shared = [name for name, _ in region.module.named_parameters() if name not in region.names]
        if shared:  # FSDP over expert-DP would sum its gradient over one EP rank's share of the tokens only
            raise NotImplementedError(
                f"autotp.fully_shard at ep_size={experts.size}: {type(region.module).__name__} "
                f"also holds {shared[0]}, which is not split by expert; autotp shards an "
                f"experts module over expert-DP only when every parameter in it is an expert's"
            )
        module = torch_fully_shard(region.module, **{**options, "mesh": mesh})
        module.set_gradient_divide_factor(float(replicas))
        if group_size(experts.edp) > 1:  # a sum, then the division (gloo has no PREMUL_SUM); not on one rank,
            module.set_force_sum_reduction_for_comms(True)  # where torch 2.13 would then divide twice
        for name in region.names:
            tags[id(region.module.get_parameter(name))] = region
    return tags
