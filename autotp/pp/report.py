"""What a pipeline costs, from the model and the plan alone (`autotp plan --pp P`): each stage's parameter bytes, the
activations each schedule keeps in flight, the bubble, and the bytes each rank sends per step.

The schedules are torch's, so their counts are torch's: GPipe runs every micro-batch's forward before any backward
(each stage keeps all M in flight); 1F1B starts backwards as soon as the last stage can, so stage s keeps
min(P - s, M); Interleaved1F1B (v stages per rank, its warm-up as torch counts it) keeps its warm-up's
forwards plus one, each of a stage 1/v the size. With equal stages the bubble, the share of a step each rank idles
while the pipeline fills and drains, is (P - 1) / (vM + P - 1) (v = 1 for GPipe and 1F1B).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..planning.plan import Plan
from ..planning.report import layer_activation_bytes
from .cut import bounds, find_cut, owner
from .schedule import LOOPED, SCHEDULES


def stages_per_rank(schedule: str, looped: int = 2) -> int:
    return looped if schedule in LOOPED else 1


def bubble(schedule: str, pp: int, microbatches: int, looped: int = 2) -> float:
    """The share of a step each rank idles with equal stages: (P - 1) / (vM + P - 1)."""
    return (pp - 1) / (stages_per_rank(schedule, looped) * microbatches + pp - 1)


def in_flight(schedule: str, pp: int, microbatches: int, rank: int, looped: int = 2) -> float:
    """At the peak, how many micro-batches' activations of all this rank's layers it holds: M under GPipe,
    min(P - rank, M) under 1F1B; under a looped schedule its warm-up's forwards plus one, each through one of its v
    stages (torch's `_get_warmup_ops`: (v - 1) M / rounds + 2 (P - 1 - rank), rounds = max(1, M // P))."""
    if schedule == "GPipe":
        return float(microbatches)
    if schedule not in LOOPED:
        return float(min(pp - rank, microbatches))
    v = looped
    per_round = microbatches // max(1, microbatches // pp)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), microbatches * v)
    return min(warmup + 1, microbatches * v) / v


def pipeline_cost(
    model: nn.Module,
    plan: Plan,
    pp: int,
    microbatches: int,
    batch: int,
    seq: int,
    experts: frozenset[str] = frozenset(),
    ep: int = 1,
) -> dict[str, Any]:
    """Per stage: its layers, what it holds besides them, its parameter bytes on its largest TP rank (`experts`,
    parameter names, split over `ep` ranks whole) and the training state's (gradients and Adam's moments in the
    parameter dtype); per schedule: the bubble and each rank's activations in flight at the peak (decoder layers
    only: the loss's logits are chunked by default); per rank the bytes it sends per step."""
    try:
        cut = find_cut(model, pp, None)
    except NotImplementedError as err:  # a model wrap would refuse to cut: bad input for the plan
        raise ValueError(str(err)) from None
    if batch % microbatches:
        raise ValueError(f"batch {batch} rows do not split into {microbatches} micro-batches of equal rows")
    stage_of = owner(model, cut)
    sharded = plan.sharded_params(model)
    per_stage = [0] * pp
    for name, p in model.named_parameters():
        part = sharded.get(name)
        numel = p.numel() if part is None else p.numel() // p.shape[part.dim] * part.local_size(0)
        per_stage[stage_of(name)] += numel * p.element_size() // (ep if name in experts else 1)
        if p is model.get_output_embeddings().weight and stage_of(name) != pp - 1:
            per_stage[-1] += numel * p.element_size()  # a tied head: the last stage holds its copy
    rows = batch // microbatches
    layer_bytes, _ = layer_activation_bytes(model, plan, rows, seq)
    element = next(model.parameters()).element_size()
    hidden = model.config.hidden_size * rows * seq * element  # one micro-batch's activation between stages
    layers = cut.bounds[-1]
    schedules = {}
    for name in SCHEDULES:
        v = stages_per_rank(name)
        if layers < v * pp:
            continue  # too few layers to loop
        looped = bounds(layers, v * pp)
        mine = [sum(looped[r + k * pp + 1] - looped[r + k * pp] for k in range(v)) for r in range(pp)]
        counts = [in_flight(name, pp, microbatches, r, v) for r in range(pp)]
        sends = [  # forward from every stage but the last, gradients back from every stage but the first
            microbatches * hidden * sum((r + k * pp < v * pp - 1) + (r + k * pp > 0) for k in range(v))
            for r in range(pp)
        ]
        schedules[name] = {
            "bubble": bubble(name, pp, microbatches, v),
            "stages_per_rank": v,
            "in_flight_microbatches": counts,
            "activation_bytes_per_rank": [round(c * n * layer_bytes) for c, n in zip(counts, mine)],
            "sent_bytes_per_rank": sends,
        }
    return {
        "pp_size": pp,
        "microbatches": microbatches,
        "rows_per_microbatch": rows,
        "bounds": list(cut.bounds),
        "stages": [
            {
                "stage": s,
                "layers": [cut.bounds[s], cut.bounds[s + 1]],
                "also": (["embedding"] if s == 0 else []) + (["final norm", "head"] if s == pp - 1 else []),
                "param_bytes": per_stage[s],
                "train_state_bytes": 4 * per_stage[s],
            }
            for s in range(pp)
        ],
        "activation_bytes_per_layer_microbatch": layer_bytes,
        "sent_bytes_per_microbatch": hidden,
        "schedules": schedules,
    }


def size(count: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.2f} MiB"


def describe(cost: dict[str, Any], batch: int, seq: int) -> list[str]:
    """The lines `autotp plan --pp` prints."""
    pp, m = cost["pp_size"], cost["microbatches"]
    lines = [f"  pipeline at pp {pp} (the cost model's cut: the embedding and the head count as a layer each):"]
    for s in cost["stages"]:
        first, stop = s["layers"]
        layers = f"layer {first}" if stop - first == 1 else f"layers {first}-{stop - 1}"
        also = f" + {', '.join(s['also'])}" if s["also"] else ""
        lines.append(
            f"    stage {s['stage']}: {layers}{also}: parameters {size(s['param_bytes'])} per rank, with gradients "
            f"and Adam moments {size(s['train_state_bytes'])}"
        )
    rows = cost["rows_per_microbatch"]
    lines.append(
        f"  at batch {batch} x seq {seq} in {m} micro-batches of {rows} row{'s' * (rows > 1)} (activations "
        f"~{size(cost['activation_bytes_per_layer_microbatch'])} per layer and micro-batch, an estimate, decoder "
        f"layers only; each send one micro-batch's hidden states forward or their gradient back, "
        f"{size(cost['sent_bytes_per_microbatch'])}):"
    )
    for name in SCHEDULES:
        c = cost["schedules"].get(name)
        if c is None:
            lines.append(f"    {name}: needs {2 * pp} layers for 2 stages per rank; the model has {cost['bounds'][-1]}")
            continue
        looped = f" ({c['stages_per_rank']} stages per rank)" if c["stages_per_rank"] > 1 else ""
        lines.append(
            f"    {name}{looped}: bubble {c['bubble']:.3f}; in flight per rank "
            f"{' / '.join(f'{n:g}' for n in c['in_flight_microbatches'])} micro-batches = "
            f"{' / '.join(size(b) for b in c['activation_bytes_per_rank'])}; sends "
            f"{' / '.join(size(b) for b in c['sent_bytes_per_rank'])} per rank per step"
        )
    lines.append("  bubble: the share of a step each rank idles with equal stages, (P - 1) / (vM + P - 1), v per rank")
    return lines
