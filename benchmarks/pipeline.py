"""Pipeline parallelism on CPU: autotp's schedules against one process and against torch.distributed.pipelining
driven by hand, at pp 2 and pp 4.

    python benchmarks/pipeline.py            # pp 2 and 4, hidden 256, 8 layers, 8 x 256 tokens (3 to 4 minutes)
    python benchmarks/pipeline.py --quick    # pp 2, a tiny Llama (seconds: tests run this)

Each pp size runs in P freshly spawned CPU ranks (gloo, 1 thread). One Llama (seed 0, fp32, SDPA) and one batch of
8 x 256 tokens (`--quick`: 4 x 32), cut into M = 8 (4) micro-batches of one row. Every step is a whole training step (forward,
backward, `allreduce_gradients`, AdamW); the ranks meet at a barrier before each, and a step's time is its slowest
rank's, the median over the timed steps. The runs on the same ranks:
- one process (rank 0 alone, the others waiting): `model(**batch).loss.backward()` on the whole batch;
- `autotp.wrap(model, 1, pp_size=P, pp_schedule=S, pp_microbatches=M)` and `autotp.forward_backward`, for S in GPipe,
  1F1B and Interleaved1F1B (2 stages per rank);
- torch by hand, as its users write it: stage modules sliced from the HF model (the embedding and the first layers;
  then layers; the last layers, the final norm and the head), the rotary table recomputed on each stage, one
  `PipelineStage` each, `Schedule1F1B` with a cross-entropy `loss_fn` (mean per micro-batch, torch's default
  `scale_grads`). Its first loss is checked against one process's (the same model, so the same work).

Measured on every rank, through torch's own `PipelineStage` (its methods timed and counted, both runs alike):
- the bubble: the share of the schedule's wall time (`forward_backward`, or torch's `schedule.step`) that the rank
  spent outside its stages' forward and backward (waiting in a receive, sending, the schedule's own work), averaged
  over ranks. Beside it the theory, (P - 1) / (M + P - 1) for GPipe and 1F1B, (P - 1) / (vM + P - 1) for v stages per
  rank, and the same bubble "replayed": each rank's forwards and backwards, their measured CPU time (the thread's,
  so time spent descheduled is not counted), laid out again in the rank's order with a forward waiting for the
  previous stage's and a backward for the next stage's, sends free. At pp 4 the 4 ranks share 2 cores, so the wall
  time measure mixes in waiting for a core: read the replayed one there. The replayed step's span is also set
  beside one process's CPU seconds: the step on one core per rank.
- peak activation memory per stage: the most bytes autograd held saved for the backward at once during the step
  (`saved_tensors_hooks`, parameters excluded, each storage once; as `benchmarks/activation_memory.py` counts them, but
  the peak over the step rather than after one forward), per rank, over GPipe's, beside the theory
  (`autotp.pp.report.in_flight`): stage s keeps min(P - s, M) micro-batches in flight under 1F1B where GPipe keeps M,
  and Interleaved1F1B its warm-up's forwards plus one, each through one of its 2 stages; counted in micro-batches
  times decoder layers, since the cut into 2P stages gives a rank other layers than the cut into P (8 layers at pp 4:
  (0, 2, 4, 7, 8), the embedding and the head counting as a layer each, against one layer a stage). The last stage's
  head and loss are not in the theory;
- bytes sent per step: the tensors of every send torch's stages post (activations forward, their gradients
  back), summed over ranks, beside the count from the shapes: 2 (S - 1) M rows x seq x hidden x 4 bytes for S stages
  (autotp also broadcasts the 4-byte loss, not counted).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from activation_memory import spawn_ranks  # noqa: E402

CONFIG = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=4096,
)
QUICK = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")
HAND = "torch by hand, Schedule1F1B"


class Trace:
    """What this rank's pipeline stages did in a step: each forward and backward (kind, stage, micro-batch, wall
    seconds, CPU seconds) and the bytes their sends carried. Installed on torch's `PipelineStage` class, so autotp's
    stages and the hand-made ones are measured alike."""

    def __init__(self) -> None:
        from torch.distributed.pipelining import PipelineStage

        self.actions: list[tuple[str, int, int, float, float]] = []
        self.sent = 0
        for kind, name in (("F", "forward_one_chunk"), ("B", "backward_one_chunk"), ("W", "backward_weight_one_chunk")):
            setattr(PipelineStage, name, self._timed(kind, getattr(PipelineStage, name)))
        for name in ("get_fwd_send_ops", "get_bwd_send_ops"):
            setattr(PipelineStage, name, self._counted(getattr(PipelineStage, name)))

    def reset(self) -> None:
        self.actions, self.sent = [], 0

    def _timed(self, kind: str, method: Any) -> Any:
        def call(stage: Any, chunk: int, *args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return method(stage, chunk, *args, **kwargs)
            finally:
                done = (time.perf_counter() - wall, time.thread_time() - cpu)
                split = kind == "B" and not kwargs.get("full_backward", True)  # the input's part of a split backward
                self.actions.append(("I" if split else kind, stage.stage_index, chunk, *done))

        return call

    def _counted(self, method: Any) -> Any:
        def call(stage: Any, *args: Any, **kwargs: Any) -> Any:
            ops = method(stage, *args, **kwargs)
            self.sent += sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
            return ops

        return call


class PeakSaved:
    """The most bytes autograd holds saved for the backward at once inside `with peak.hooks:` (parameters excluded,
    each storage counted once while any tensor saved on it is alive)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live: dict[int, list[int]] = {}  # storage address -> [saved tensors alive, bytes]
        self.now = self.peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self.params or storage.nbytes() == 0:
            return tensor
        entry = self.live.setdefault(address, [0, storage.nbytes()])
        if entry[0] == 0:
            self.now += entry[1]
            self.peak = max(self.peak, self.now)
        entry[0] += 1
        weakref.finalize(tensor, self._release, address)
        return tensor

    def _release(self, address: int) -> None:
        entry = self.live[address]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.live[address]


class HandStage(nn.Module):
    """One stage as a user of torch.distributed.pipelining writes it for an HF Llama: its slice of the layers, the
    embedding on the first, the final norm and the head on the last, the rotary table computed where it is used."""

    def __init__(self, model: nn.Module, start: int, stop: int, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[start:stop])
        self.rotary = inner.rotary_emb
        self.norm = inner.norm if last else None
        self.head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed is not None else x
        positions = torch.arange(hidden.shape[1])[None]
        rope = self.rotary(hidden, positions)
        for layer in self.layers:  # no mask: SDPA's causal attention
            hidden = layer(hidden, position_embeddings=rope, position_ids=positions)
        return self.head(self.norm(hidden)) if self.head is not None else hidden


def next_token_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target[:, 1:].flatten())


def build(config: dict) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**config, use_cache=False), attn_implementation="sdpa").train()


def timed_steps(step: Any, model: nn.Module, steps: int, trace: Trace, barrier: bool = True) -> dict[str, Any]:
    """`step()` (returning its forward and backward's wall and CPU seconds) once to warm up, with the saved bytes'
    peak, then `steps` times: each whole step's wall seconds, its forward and backward's, and the stages' forwards
    and backwards of the last."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    peak = PeakSaved(model)
    times, inner = [], []
    for i in range(steps + 1):
        trace.reset()
        if barrier:
            dist.barrier()
        start = time.perf_counter()
        with peak.hooks if i == 0 else contextlib.nullcontext():
            inner.append(step())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return {
        "times": times[1:],
        "schedule": [wall for wall, _ in inner[1:]],
        "cpu": [cpu for _, cpu in inner[1:]],
        "actions": trace.actions,
        "sent": trace.sent,
        "peak_saved": peak.peak,
    }


def clocked(run: Any) -> tuple[float, float]:
    """`run()`'s wall and CPU seconds (this thread's: the ranks run one thread each)."""
    wall, cpu = time.perf_counter(), time.thread_time()
    run()
    return time.perf_counter() - wall, time.thread_time() - cpu


def rank_main(rank: int, world: int, config: dict, rows: int, seq: int, steps: int, port: int, out: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    trace = Trace()
    ids = torch.randint(0, config["vocab_size"], (rows, seq), generator=torch.Generator().manual_seed(1))
    results: dict[str, Any] = {}
    if rank == 0:  # one process on the whole batch, while the other ranks wait at the barrier below
        results.update(one_process(config, ids, steps, trace))
    dist.barrier()
    for schedule in SCHEDULES:
        results[schedule] = autotp_run(world, config, ids, steps, trace, schedule)
    results[HAND] = hand_run(rank, world, config, ids, steps, trace)
    out.put((rank, results))
    dist.barrier()
    dist.destroy_process_group()


def one_process(config: dict, ids: torch.Tensor, steps: int, trace: Trace) -> dict[str, Any]:
    """The plain transformers model on the whole batch: its first loss, and its steps."""
    model = build(config)
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    step = lambda: clocked(lambda: model(input_ids=ids, labels=ids).loss.backward())  # noqa: E731
    return {"reference_loss": loss, "one process": timed_steps(step, model, steps, trace, barrier=False)}


def autotp_run(world: int, config: dict, ids: torch.Tensor, steps: int, trace: Trace, schedule: str) -> dict[str, Any]:
    """autotp's pipeline at pp = the world: `forward_backward`, then `allreduce_gradients`, as its loop is."""
    import autotp

    model = autotp.wrap(build(config), 1, pp_size=world, pp_schedule=schedule, pp_microbatches=ids.shape[0])

    def step() -> tuple[float, float]:
        seconds = clocked(lambda: autotp.forward_backward(model, input_ids=ids, labels=ids))
        autotp.allreduce_gradients(model)
        return seconds

    return timed_steps(step, model, steps, trace)


def hand_run(rank: int, world: int, config: dict, ids: torch.Tensor, steps: int, trace: Trace) -> dict[str, Any]:
    """torch.distributed.pipelining as its users drive it: this rank's `HandStage`, a `PipelineStage`, `Schedule1F1B`
    over the whole batch's rows as micro-batches; the cut autotp's cost model makes (`autotp.pp.cut.bounds`)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from autotp.pp.cut import bounds

    cut = bounds(config["num_hidden_layers"], world)
    first, last = rank == 0, rank == world - 1
    module = HandStage(build(config), cut[rank], cut[rank + 1], first, last)
    rows, seq = ids.shape
    hidden = torch.empty(1, seq, config["hidden_size"], requires_grad=True)  # gradients flow back through it
    stage = PipelineStage(
        module,
        rank,
        world,
        torch.device("cpu"),
        input_args=ids[:1] if first else hidden,
        output_args=torch.empty(1, seq, config["vocab_size"]) if last else hidden,
    )
    schedule = Schedule1F1B(stage, n_microbatches=rows, loss_fn=next_token_loss)
    losses: list[torch.Tensor] = []
    first_loss: list[float] = []  # the warm-up step's, before any update: one process's on the same model

    def step() -> tuple[float, float]:
        losses.clear()
        inputs = (ids,) if first else ()
        seconds = clocked(lambda: schedule.step(*inputs, target=ids if last else None, losses=losses if last else None))
        if last and not first_loss:
            first_loss.append(torch.stack(losses).mean().item())
        return seconds

    result = timed_steps(step, module, steps, trace)
    result["first_loss"] = first_loss[0] if last else None
    return result


def replay(actions: list[list[tuple]], stages: int) -> tuple[float, float]:
    """The step's span and the ranks' mean idle share when each rank's forwards and backwards (their CPU seconds),
    in its own order, wait only for their inputs: a forward for the previous stage's forward of its micro-batch, a
    backward (whole, or a split backward's input part I) for the next stage's, a split backward's weight part W for
    nothing more (its input part ran before it on the same rank); sends free, one core per rank."""
    done: dict[tuple[str, int, int], float] = {}
    queues = [list(rank) for rank in actions]
    clocks = [0.0] * len(queues)
    while any(queues):
        progressed = False
        for r, queue in enumerate(queues):
            while queue:
                kind, stage, mb, _, cpu = queue[0]
                edge = kind == "F" and stage == 0 or kind != "F" and stage == stages - 1 or kind == "W"
                need = None if edge else ("F", stage - 1, mb) if kind == "F" else ("B", stage + 1, mb)
                if need is not None and need not in done:
                    break
                clocks[r] = max(clocks[r], done.get(need, 0.0) if need else 0.0) + cpu
                done[("B" if kind == "I" else kind, stage, mb)] = clocks[r]
                queue.pop(0)
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded forwards and backwards wait on each other: not a schedule")
    span = max(clocks)
    return span, statistics.mean(1 - sum(a[4] for a in rank) / span for rank in actions)


def per_rank(schedule: str) -> int:
    """The stages each rank runs under `schedule` (2 under the looped and the V schedules)."""
    from autotp.pp.report import stages_per_rank
    from autotp.pp.zero_bubble import ZERO_BUBBLE

    return 2 if schedule in ZERO_BUBBLE else stages_per_rank(schedule)


def theory_bubble(schedule: str, pp: int, rows: int) -> float:
    """(P - 1) / (vM + P - 1), or for a zero-bubble schedule its own order with F = I = W (`autotp.pp.zero_bubble`)."""
    from autotp.pp import report, zero_bubble

    if schedule in zero_bubble.ZERO_BUBBLE:
        return zero_bubble.bubble(schedule, pp, rows)
    return report.bubble(schedule, pp, rows)


def sent_edges(schedule: str, pp: int) -> int:
    """The stage boundaries whose hidden states cross ranks (the V's middle two stages share rank P - 1)."""
    from autotp.pp.zero_bubble import stage_rank

    stages = pp * per_rank(schedule)
    return sum(stage_rank(schedule, pp, s) != stage_rank(schedule, pp, s + 1) for s in range(stages - 1))


def tables(pp: int, ranks: list[dict], config: dict, rows: int, seq: int) -> tuple[list[str], list[str]]:
    """The speed rows and the bubble, memory and bytes rows of one pp size."""
    from autotp.pp.cut import bounds
    from autotp.pp.report import in_flight
    from autotp.pp.zero_bubble import ZERO_BUBBLE, rank_stages

    def layers(schedule: str, rank: int) -> int:  # the decoder layers a rank runs under the schedule's cut
        v = per_rank(schedule)
        cut = bounds(config["num_hidden_layers"], v * pp)
        return sum(cut[s + 1] - cut[s] for s in rank_stages(schedule, pp, v, rank))

    def theory(schedule: str, rank: int) -> str:  # in flight over GPipe's, in micro-batches x decoder layers
        if schedule in ZERO_BUBBLE:  # no count of torch's for them
            return ""
        return f" ({in_flight(schedule, pp, rows, rank) * layers(schedule, rank) / (rows * layers('GPipe', rank)):.2f})"

    median = statistics.median
    base = ranks[0]["one process"]
    wall = {run: median(map(max, zip(*(r[run]["times"] for r in ranks)))) for run in (*SCHEDULES, HAND)}
    replayed = {
        run: replay([r[run]["actions"] for r in ranks], pp * per_rank("1F1B" if run == HAND else run))
        for run in (*SCHEDULES, HAND)
    }
    single_wall, single_cpu = median(base["times"]), median(base["cpu"])
    speed = (
        [f"| one process, the whole batch | 1.00 | | 1.00 | | {base['peak_saved'] / 2**20:.1f} |"] if pp == 2 else []
    )
    shape = []
    gpipe = [r["GPipe"]["peak_saved"] for r in ranks]
    for run in (*SCHEDULES, HAND):
        schedule = "1F1B" if run == HAND else run
        span, idle = replayed[run]
        measured = statistics.mean(1 - sum(a[3] for a in r[run]["actions"]) / r[run]["schedule"][-1] for r in ranks)
        peaks = [r[run]["peak_saved"] for r in ranks]
        against = " / ".join(f"{p / g:.2f}{theory(schedule, s)}" for s, (p, g) in enumerate(zip(peaks, gpipe)))
        sent = sum(r[run]["sent"] for r in ranks)
        expected = 2 * sent_edges(schedule, pp) * rows * seq * config["hidden_size"] * 4
        name = f"pp {pp}: " + (f"autotp {run}" if run != HAND else run)
        speed.append(
            f"| {name} | {single_wall / wall[run]:.2f} | {wall[HAND] / wall[run]:.2f} | {single_cpu / span:.2f} | "
            f"{replayed[HAND][0] / span:.2f} | {' / '.join(f'{p / 2**20:.1f}' for p in peaks)} |"
        )
        shape.append(
            f"| {name} | {theory_bubble(schedule, pp, rows):.3f} | {measured:.3f} | {idle:.3f} | "
            f"{against if run != 'GPipe' else ''} | {sent / 2**20:.1f} | {expected / 2**20:.1f} |"
        )
    return speed, shape


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="pp 2 only, a tiny Llama, one timed step")
    args = parser.parse_args()
    config, rows, seq, steps, sizes = (QUICK, 4, 32, 1, (2,)) if args.quick else (CONFIG, 8, 256, 3, (2, 4))
    speed, shape, checks = [], [], []
    for pp in sizes:
        ranks = [r for _, r in spawn_ranks(rank_main, pp, (config, rows, seq, steps), {})]
        rows_speed, rows_shape = tables(pp, ranks, config, rows, seq)
        speed += rows_speed
        shape += rows_shape
        reference, hand = ranks[0]["reference_loss"], ranks[-1][HAND]["first_loss"]
        checks.append(f"pp {pp}: torch by hand's first loss {hand:.6f}, one process's {reference:.6f}")
    print(
        f"Llama hidden {config['hidden_size']}, {config['num_hidden_layers']} layers, vocab {config['vocab_size']}; "
        f"batch {rows} x {seq} in M = {rows} micro-batches of one row; fp32, 1 thread per rank; median of {steps} "
        f"steps\n"
    )
    print(
        "| run | speed vs one process, wall | speed vs torch by hand, wall | speed vs one process, replayed | "
        "speed vs torch by hand, replayed | peak saved for backward per stage, MiB |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(speed) + "\n")
    print(
        "| run | bubble, theory | bubble, measured (wall) | bubble, replayed (CPU) | peak saved per stage over GPipe's "
        "(theory) | sent per step, counted, MiB | sent per step, from shapes, MiB |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(shape) + "\n")
    print("\n".join(checks))


if __name__ == "__main__":
    main()
