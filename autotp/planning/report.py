"""What a plan costs: per-rank bytes and the collectives of one training step, computed from the plan alone."""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import nn

from .linears import features
from .plan import Plan


@dataclass(frozen=True)
class Collective:
    where: str
    phase: str  # "forward" or "backward"
    count: int
    bytes_each: int


def step_collectives(model: nn.Module, plan: Plan, batch: int, seq: int) -> list[Collective]:
    """The all-reduces of one forward and backward at this batch x seq (without sequence parallelism).

    One forward reduction per row layer; one backward reduction per block for its column layers (they
    share their input); expert regions reduce their output and the gradients of their two float
    inputs (hidden states, routing weights); per-head norms and replicated KV rows add gradient sums; a norm over
    the split width sums its statistic and that statistic's gradient;
    vocab parallelism adds the embedding's reduction, the loss's two (fp32) and the LM head's input
    gradient. tests/tp/test_collectives.py checks the total against the bytes real all-reduces move.
    """
    if plan.tp_size == 1:
        return []
    element = next(model.parameters()).element_size()
    tokens = batch * seq
    out: list[Collective] = []
    column_blocks: dict[str, int] = {}
    for layer in plan.layers:
        module = model.get_submodule(layer.path)
        out_features, in_features = features(module)
        if layer.style == "row":
            out.append(Collective(layer.path, "forward", 1, tokens * out_features * element))
        else:
            parent = layer.path.rpartition(".")[0] or layer.path  # the LM head sits at the top
            column_blocks.setdefault(parent, tokens * in_features * element)
        for _, length, _ in layer.partition.replicas(0):
            row_size = module.weight.numel() // module.weight.shape[layer.partition.dim]
            bias = length if layer.style == "column" and getattr(module, "bias", None) is not None else 0
            out.append(
                Collective(f"{layer.path} (replicated KV rows)", "backward", 1, (length * row_size + bias) * element)
            )
    out += [Collective(f"{parent} (input gradient)", "backward", 1, size) for parent, size in column_blocks.items()]
    hidden = getattr(model.config, "hidden_size", 0)
    top_k = _top_k(model.config)
    for region in plan.regions:  # experts(hidden_states, top_k_index, top_k_weights): two float inputs
        if region.side:  # a parallel-experts linear: one collective on its top_k x tokens rows
            out_features, in_features = features(model.get_submodule(region.path))
            column = region.side == "column"
            size = tokens * top_k * (in_features if column else out_features) * element
            out.append(
                Collective(
                    region.path + (" (input gradient)" if column else ""), "backward" if column else "forward", 1, size
                )
            )
            continue
        out.append(Collective(region.path, "forward", 1, tokens * hidden * element))
        out.append(Collective(f"{region.path} (hidden-state gradient)", "backward", 1, tokens * hidden * element))
        out.append(Collective(f"{region.path} (routing-weight gradient)", "backward", 1, tokens * top_k * element))
    for path in plan.head_norms:
        size = sum(p.numel() for p in model.get_submodule(path).parameters()) * element
        out.append(Collective(f"{path} (gradient)", "backward", 1, size))
    for norm in plan.norms:  # a norm over the split width: its fp32 statistic, one a token, and that one's gradient
        out.append(Collective(f"{norm.path} (statistic)", "forward", 1, tokens * 4))
        out.append(Collective(f"{norm.path} (statistic gradient)", "backward", 1, tokens * 4))
    if plan.vocab is not None:
        if plan.vocab.embedding:
            out.append(Collective(plan.vocab.embedding, "forward", 1, tokens * hidden * element))
        out.append(Collective("vocab-parallel loss (max log-sum-exp)", "forward", 1, tokens * 4))  # fp32
        out.append(
            Collective(
                "vocab-parallel loss (sum-exp, target logit)",
                "forward",
                1,
                tokens * 2 * 4,
            )
        )
    return out


ZERO = {  # stage -> which of parameters, gradients, optimizer state are split over DP, and what runs it
    0: ((False, False, False), "DDP over autotp.dp_group"),
    1: ((False, False, True), "not offered by autotp (FSDP2 has no stage 1)"),
    2: ((False, True, True), "autotp.fully_shard(model, reshard_after_forward=False)"),
    3: ((True, True, True), "autotp.fully_shard(model)"),
}


def zero_bytes(param_bytes: int, dp: int) -> dict[int, dict]:
    """Per-rank training-state bytes of one TP rank holding `param_bytes` of parameters, at each ZeRO stage over `dp`.

    Gradients take the parameters' bytes and Adam's two moments twice that, all in the parameter dtype;
    a stage-2 rank holds whole parameters from forward to backward. Activations are not counted.
    """
    out = {}
    for stage, (split, runs) in ZERO.items():
        parts = [param_bytes, param_bytes, 2 * param_bytes]
        parts = [-(-b // dp) if cut else b for b, cut in zip(parts, split)]
        out[stage] = {"params": parts[0], "grads": parts[1], "optimizer": parts[2], "total": sum(parts), "runs": runs}
    return out


def expert_zero_bytes(dense: int, experts: int, dp: int, expert_dp: int) -> dict[int, dict]:
    """`zero_bytes` of one rank at ep > 1: its dense bytes split over DP, its experts over expert-DP (the ranks
    holding the same experts, over which `autotp.fully_shard` shards them). DDP is refused at ep > 1, so stage 0 is
    `autotp.allreduce_gradients`."""
    dense_z, expert_z = zero_bytes(dense, dp), zero_bytes(experts, expert_dp)
    out = {}
    for stage, (_, runs) in ZERO.items():
        out[stage] = {k: dense_z[stage][k] + expert_z[stage][k] for k in ("params", "grads", "optimizer", "total")}
        out[stage]["runs"] = "autotp.allreduce_gradients (DDP is refused at ep > 1)" if stage == 0 else runs
    return out


def summary(model: nn.Module, plan: Plan, batch: int, seq: int, dp: int = 1) -> dict:
    """Everything `autotp plan` prints, as data."""
    per_rank = plan.param_bytes(model)
    collectives = step_collectives(model, plan, batch, seq)
    return {
        "tp_size": plan.tp_size,
        "origin": plan.origin.name.lower(),
        "source": plan.source,
        "layers": [
            {
                "path": layer.path,
                "style": layer.style,
                "shape": list(layer.shape),
                "local_rows": [layer.partition.local_size(r) for r in range(plan.tp_size)],
                "dim": layer.partition.dim,
                "reason": layer.reason,
            }
            for layer in plan.layers
        ],
        "experts": [
            {
                "path": f"{r.path}.{name}",
                "shape": list(shape),
                "local_rows": [p.local_size(k) for k in range(plan.tp_size)],
            }
            for r in plan.regions
            for name, shape, p in r.partitions
        ],
        "in_place": [  # parameters split in place with their block's heads or channels (mixers, sinks, sharded norms)
            {
                "path": p.path,
                "shape": list(p.shape),
                "local_rows": [p.partition.local_size(k) for k in range(plan.tp_size)],
                "dim": p.partition.dim,
                "reason": p.reason,
            }
            for p in plan.params
        ],
        "group_norms": [norm.path for norm in plan.group_norms],
        "replicated_mixers": [{"path": path, "why": why} for path, why in plan.mixers],
        "replicated": [{"path": path, "why": str(why)} for path, why in plan.replicated],
        "vocab_parallel": plan.vocab is not None,
        "vocab_reason": plan.vocab_reason,
        "param_bytes_per_rank": per_rank,
        # parameters, their gradients and Adam's two moments, all in the parameter dtype
        "train_state_bytes_per_rank": [4 * b for b in per_rank],
        "dp_size": dp,
        "zero_bytes_per_rank": zero_bytes(max(per_rank), dp),  # the largest TP rank's, by ZeRO stage over DP
        "unsharded_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "collectives": [
            {"where": c.where, "phase": c.phase, "count": c.count, "bytes": c.bytes_each} for c in collectives
        ],
        "collective_bytes_per_step": sum(c.count * c.bytes_each for c in collectives),
    }


def layer_activation_bytes(model: nn.Module, plan: Plan, batch: int, seq: int, cp: int = 1) -> tuple[int, int]:
    """What autograd keeps for one decoder layer's backward on this rank, an estimate from the config (see
    `context_cost`; a MoE layer's MLP part counted for each of a token's top-k experts), and the gathered K/V of the
    whole sequence included in it."""
    config = model.config
    element = next(model.parameters()).element_size()
    tp = plan.tp_size
    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kv_local = max(1, -(-kv_heads // tp))  # replicated KV heads: at least one per rank
    expert = getattr(config, "moe_intermediate_size", None)  # a MoE token runs through top-k experts' MLPs
    inner = (
        expert * getattr(config, "num_experts_per_tok", 1)
        if expert
        else getattr(config, "intermediate_size", 4 * hidden)
    )
    per_token = 3 * hidden + 2 * (heads // tp) * head_dim + 3 * -(-inner // tp)
    kv_gathered = batch * seq * 2 * kv_local * head_dim * element
    return batch * -(-seq // cp) * per_token * element + kv_gathered, kv_gathered


def context_cost(model: nn.Module, plan: Plan, batch: int, seq: int, cp: int) -> dict:
    """Activation memory per rank, and the bytes context parallelism's attention moves per step, at tp x cp.

    An estimate from the config, counting what autograd keeps per decoder layer for each of this rank's batch x
    seq / cp tokens (norm inputs, residual, q and attention output on this TP rank's heads, gate / up / product on
    its MLP rows), the gathered K/V of the whole sequence each layer keeps for its backward, the [S / cp, S] mask
    and the fp32 logits of the loss. The attention moves, per layer, one K/V all-gather forward and its
    reduce-scatter backward: each rank sends (cp - 1) / cp of the gathered bytes each way (a ring's share).
    """
    config = model.config
    layers, tp = config.num_hidden_layers, plan.tp_size
    vocab = config.vocab_size // (tp if plan.vocab is not None else 1)
    tokens = batch * -(-seq // cp)
    per_layer, kv_gathered = layer_activation_bytes(model, plan, batch, seq, cp)
    activations = layers * per_layer + tokens * seq + tokens * vocab * 4
    moved = layers * 2 * kv_gathered * (cp - 1) // cp
    return {
        "cp_size": cp,
        "seq": seq,
        "activation_bytes_per_rank": activations,
        "attention_bytes_per_step": moved,
        "attention_collectives_per_step": 2 * layers if cp > 1 else 0,
    }


def expert_cost(
    model: nn.Module, plan: Plan, experts: list[tuple[str, tuple[str, ...]]], ep: int, batch: int, seq: int
) -> dict:
    """Per-rank bytes with the experts split by expert over `ep` ranks, and the all-to-all bytes of one step.

    `experts`: each experts module's path and parameter names (`autotp.ep.regions`). The dense part is the plan's
    per-TP-rank bytes without the experts; each rank adds 1/ep of them, whole. Each MoE layer moves, per TP rank's
    share of the batch x seq tokens (the TP ranks split them before the dispatch), top-k hidden-state rows out and back
    forward and the same backward; with routing spread evenly, (ep - 1) / ep of them leave the rank.
    """
    element = next(model.parameters()).element_size()
    whole = sum(
        model.get_submodule(path).get_parameter(name).numel() * element for path, names in experts for name in names
    )
    dense = [b - whole for b in replace(plan, regions=()).param_bytes(model)]
    tokens = -(-batch * seq // plan.tp_size)
    top_k = _top_k(model.config)
    routed = tokens * top_k * getattr(model.config, "hidden_size", 0) * element
    return {
        "ep_size": ep,
        "expert_bytes": whole,
        "expert_bytes_per_rank": whole // ep,
        "param_bytes_per_rank": [b + whole // ep for b in dense],
        "all_to_alls_per_step": 4 * len(experts),
        "all_to_all_bytes_per_step": 4 * len(experts) * routed * (ep - 1) // ep,
    }


def _top_k(config) -> int:
    """Experts a token is routed to: `num_experts_per_tok`, or Aria's `moe_topk`."""
    return getattr(config, "num_experts_per_tok", None) or getattr(config, "moe_topk", None) or 1
