"""torch's zero-bubble schedules, `ZBVZeroBubble` and `DualPipeV`: their V-shaped stage placement, what they refuse,
the forward-only schedule that evaluates on their placement, and their bubble in theory.

Both cut the model into 2P stages and place them in a V: rank r runs stages r and 2P - 1 - r, so rank 0 holds the
first and the last stage (the embedding and the head), and rank P - 1 the two middle ones, handing the hidden states
from one to the other without a send. Both split a stage's backward into the input's gradient (torch's
`stage_backward_input`, sent on at once to the previous stage) and the weights' (`stage_backward_weight`, run later to
fill the bubble), both from one forward's autograd graph: the weights' part differentiates again the nodes where the
weights meet the input's path, from the gradients the input's part recorded there (the first stage runs its whole
backward as its weights' part). What runs in each part is autograd's own: a tensor hook on a parameter (autotp's
gradient hooks for TP's replicated heads) runs in the weights' part, and autotp's autograd Functions met twice (the
chunked loss, TP's and SP's column layers) compute again from what they saved, all-gathering SP's sequence again, so
they give the same gradients. What keeps state from one part to the other does not compose, and is refused before
the model changes (`refuse_options`, `refuse_fully_shard`, `refuse_compiled`): TP's overlap (its column layers leave
their weight gradients to the block entry's backward, run in the input's part), FSDP's reduction, compiled layers,
the MoE load-balancing loss's shares.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.pipelining.schedules import ScheduleLoopedBFS, _Action, _ComputationType

from ..options import WrapOptions

ZERO_BUBBLE = ("ZBVZeroBubble", "DualPipeV")  # torch's names


def stage_rank(schedule: str, pp: int, stage: int) -> int:
    """The PP rank that runs `stage`: looped (rank s mod P) but under the V of the zero-bubble schedules."""
    if schedule in ZERO_BUBBLE:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def rank_stages(schedule: str, pp: int, per_rank: int, rank: int) -> list[int]:
    """The stages PP rank `rank` runs, in order."""
    return [s for s in range(pp * per_rank) if stage_rank(schedule, pp, s) == rank]


def refuse_options(model: Any, options: WrapOptions, microbatches: int) -> None:
    """What the zero-bubble schedules cannot run exactly, by name, at planning time."""
    pp, schedule = options.pp_size, options.pp_schedule
    if options.pp_stages_per_rank not in (None, 2):
        raise ValueError(
            f"pp_stages_per_rank={options.pp_stages_per_rank} with pp_schedule={schedule!r}: torch's V schedule "
            f"runs exactly 2 stages per rank (rank r: stages r and {2 * pp - 1} - r); leave pp_stages_per_rank unset"
        )
    if schedule == "DualPipeV" and microbatches < 2 * pp:
        raise ValueError(
            f"pp_microbatches={microbatches} with pp_schedule='DualPipeV' at pp_size={pp}: torch's DualPipeV runs at "
            f"least one micro-batch per stage; give pp_microbatches >= {2 * pp}, or pp_schedule='ZBVZeroBubble'"
        )
    if options.tp_size > 1 and options.overlap:
        raise NotImplementedError(
            f"pp_size={pp} with pp_schedule={schedule!r} at tp_size={options.tp_size} with overlap=True: TP's overlap "
            f"leaves the column layers' weight gradients to their block entry's backward, which the split backward "
            f"runs in the input's part, before the weights' part that needs them; wrap with overlap=False (the "
            f"schedule's weights' part fills the pipeline's bubble instead)"
        )
    if getattr(model.config, "output_router_logits", False):
        raise NotImplementedError(
            f"pp_size={pp} with pp_schedule={schedule!r} and output_router_logits: the MoE load-balancing loss's "
            f"per-stage shares are not built for a backward split into the input's and the weights' parts; use "
            f"pp_schedule='1F1B' or 'Interleaved1F1B', or set output_router_logits=False"
        )


def refuse_fully_shard(schedule: str, pp: int) -> None:
    """`autotp.fully_shard` under a zero-bubble schedule, refused before any module is sharded: FSDP reduces a stage's
    gradients when its input's gradient is computed, before the weights' part of the split backward computes them."""
    if schedule in ZERO_BUBBLE:
        raise NotImplementedError(
            f"autotp.fully_shard at pp_size={pp} with pp_schedule={schedule!r}: FSDP reduce-scatters a stage's "
            f"gradients in the backward of its input, and the split backward computes the weights' gradients after "
            f"it; use pp_schedule='1F1B' or 'Interleaved1F1B' with FSDP, or DDP-style autotp.allreduce_gradients"
        )


def refuse_compiled(model: nn.Module, schedule: str) -> None:
    """A module compiled in place (`layer.compile()`, as for the other schedules) under a zero-bubble schedule,
    refused at the step, before it runs: torch's split backward does not support compiled stages (its own check
    looks only for `torch.compile(module)`'s wrapper)."""
    found = next((n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None) is not None), None)
    if found is not None:
        raise NotImplementedError(
            f"pp_schedule={schedule!r} with {found or type(model).__name__} compiled (Module.compile()): torch's "
            f"zero-bubble schedules split the backward, which they do not support through torch.compile; use "
            f"pp_schedule='1F1B' or 'Interleaved1F1B' with compiled layers, or run them eagerly"
        )


class VForwardOnly(ScheduleLoopedBFS):
    """Evaluation (`eval()` only) on the V placement: torch's LoopedBFS order, each rank's first stage's forwards,
    then its second's, on the V instead of the loop. The forwards alone give the same outputs in any order, for any
    count of micro-batches (DualPipeV needs at least 2P). The backwards are listed only for torch's check of the
    order, then dropped with their sends: rank P - 1 would hand its second stage's input gradient to its first, which
    `eval()` does not compute."""

    def __init__(self, stages: list[Any], n_microbatches: int, **kwargs: Any):
        super().__init__(stages, n_microbatches, **kwargs)
        backward = {_ComputationType.FULL_BACKWARD, _ComputationType.SEND_B, _ComputationType.RECV_B}
        lowered: dict[int, list[_Action]] = self.pipeline_order_with_comms  # type: ignore[has-type]
        self.pipeline_order_with_comms = {
            rank: [a for a in actions if a.computation_type not in backward] for rank, actions in lowered.items()
        }

    def _calculate_single_rank_operations(self, rank: int) -> list[_Action | None]:
        stages, microbatches = rank_stages("DualPipeV", self.pp_group_size, 2, rank), range(self._n_microbatches)
        forwards = [_Action(s, _ComputationType.FORWARD, m) for s in stages for m in microbatches]
        backwards = [_Action(s, _ComputationType.FULL_BACKWARD, m) for s in stages[::-1] for m in microbatches[::-1]]
        return [*forwards, *backwards]


def bubble(schedule: str, pp: int, microbatches: int) -> float:
    """The share of a step each rank idles with equal stages, forward, input backward and weight backward taking one
    unit each (the cost model under which ZBV is zero-bubble; a whole backward is their two): torch's own order of
    each rank's actions, each waiting for the one it needs (a forward for the previous stage's forward of its
    micro-batch, an input backward for the next stage's, a weight backward for its input backward), sends free."""
    cls = {"ZBVZeroBubble": "ScheduleZBVZeroBubble", "DualPipeV": "ScheduleDualPipeV"}[schedule]
    return simulate(torch_order(cls, pp, microbatches), 2 * pp)


def torch_order(cls: str, pp: int, microbatches: int) -> list[list[tuple[str, int, int]]]:
    """Each rank's compute actions as torch's schedule orders them: (kind F, I, W or B, stage, micro-batch), an
    overlapped forward-and-backward as its two actions. Computed by the schedule's own method, with no process group."""
    from torch.distributed.pipelining import schedules

    method = getattr(schedules, cls)._calculate_single_rank_operations
    shell = _Shell(pp, 2 * pp, microbatches)
    ranks = []
    for rank in range(pp):
        actions: list[tuple[str, int, int]] = []
        for action in method(shell, rank):
            if action is None:
                continue
            for one in action.sub_actions or (action,):
                actions.append((one.computation_type.value, one.stage_index, int(one.microbatch_index)))
        ranks.append(actions)
    return ranks


class _Shell:
    """What torch's `_calculate_single_rank_operations` reads of its schedule."""

    def __init__(self, pp: int, stages: int, microbatches: int):
        self.pp_group_size, self.num_stages, self._num_stages = pp, stages, stages
        self._n_microbatches = microbatches


def simulate(ranks: list[list[tuple[str, int, int]]], stages: int, cost: dict[str, float] | None = None) -> float:
    """The mean idle share of the ranks when each runs its actions in order, each as soon as what it needs is done
    (`bubble`), with `cost` per kind (default F = I = W = 1, a whole backward B = 2)."""
    cost = cost or {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
    done: dict[tuple[str, int, int], float] = {}
    queues, clocks = [list(r) for r in ranks], [0.0] * len(ranks)
    while any(queues):
        progressed = False
        for r, queue in enumerate(queues):
            while queue:
                kind, stage, mb = queue[0]
                need = _needs(kind, stage, mb, stages)
                if need is not None and need not in done:
                    break
                clocks[r] = max(clocks[r], done[need] if need else 0.0) + cost[kind]
                done[(kind, stage, mb)] = clocks[r]
                if kind == "B":  # a whole backward is its input's part too
                    done[("I", stage, mb)] = clocks[r]
                queue.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("the actions wait on each other: not a schedule")
    span = max(clocks)
    return sum(1 - sum(cost[a[0]] for a in rank) / span for rank in ranks) / len(ranks)


def _needs(kind: str, stage: int, mb: int, stages: int) -> tuple[str, int, int] | None:
    """The action that must be done first (None: none): a forward waits for the previous stage's forward, a
    backward (input part or whole) for the next stage's input part (the last stage's for its forward), a weight
    part for its own input part."""
    if kind == "F":
        return None if stage == 0 else ("F", stage - 1, mb)
    if kind == "W":
        return ("I", stage, mb)
    return ("F", stage, mb) if stage == stages - 1 else ("I", stage + 1, mb)
