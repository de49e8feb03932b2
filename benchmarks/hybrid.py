"""Hybrid models at tp 2 against one process, side by side in the same run: per-rank memory and step time (issue 51).

    python benchmarks/hybrid.py [--families nemotron_h qwen3_next] [--rounds 2] [--steps 4] [--warmup 1]

Two reduced hybrids, hidden 512, vocab 4096, each with its family's default layer pattern (transformers' default
config) over 4 layers, fp32, random weights saved once and read by every run:
- Nemotron-H: `layers_block_type` mamba, moe, attention, mlp (a Mamba-2 mixer of 16 heads of 64 in 2 groups of state
  64; 8 routed experts of width 256, top-2, and a shared expert of 512; 8/2 attention heads; a relu2 MLP of 1024);
- Qwen3-Next: `layer_types` 3 x linear_attention (a gated delta-net, 4 key / 8 value heads of 64), then
  full_attention (gated, 8/2 heads); every layer's MLP 8 routed experts of width 256, top-2, and a shared expert.

Each run is fresh processes, 1 thread per rank, gloo, `MALLOC_MMAP_THRESHOLD_=131072` (RSS follows the live bytes,
as in `activation_memory.py`): one process reads the model with transformers' `from_pretrained`, tp 2 with
`autotp.from_pretrained(path, 2)`. Both train on the same batch of 2 x 128 tokens with AdamW; one process and tp 2
alternate within each round. Reported per rank:
- the bytes of its parameters, and of its parameters, gradients and AdamW's two moments after the last step (a
  DTensor's `to_local()`);
- how far its RSS rose above where it stood before the model was read (the peak, VmHWM, reset once the model is read:
  the model, the steps' gradients, optimizer state and activations, not the load's transients);
- the median step (forward, backward, AdamW) after the warm-up, the slower rank's, median over rounds; and its CPU
  seconds (`time.process_time()`: the rank's process, gloo's threads included), each rank's median over rounds,
  which other jobs on the machine sway less than the wall clock;
- each step's loss, against one process's (a sanity line).
From the plan (`autotp.explain` on the meta device): the tensors it shards, the bytes it puts on each rank (beside the
measured ones) and the largest modules it keeps whole.

Step time on a 2-core CPU is not tp 2's speed-up: the two ranks share the cores with gloo's threads (and with
whatever else runs), and the collectives go through loopback TCP. The CPU seconds say how much of one process's work
a rank does: what the plan keeps whole (the embedding and LM head while the vocabulary is not split) runs on both
ranks. The state-space and delta-net scans run transformers' reference PyTorch code here (no `mamba_ssm` / `fla`
kernels on CPU). Read the memory ratios; the time ratios are what this machine measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from activation_memory import rss, spawn_ranks  # noqa: E402

VOCAB = 4096
BATCH = (2, 128)
LR = 1e-4
FAMILIES = {
    "nemotron_h": dict(
        hidden_size=512,
        intermediate_size=1024,
        layers_block_type=["mamba", "moe", "attention", "mlp"],
        mamba_num_heads=16,
        mamba_head_dim=64,
        n_groups=2,
        ssm_state_size=64,
        chunk_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        moe_shared_expert_intermediate_size=512,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    ),
    "qwen3_next": dict(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
        vocab_size=VOCAB,
        max_position_embeddings=256,
    ),
}
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def config(family: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **FAMILIES[family])


def nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def held(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's own parameters (tied ones once), their gradients and the optimizer's tensors."""
    params = list(model.parameters())
    return {
        "params": sum(nbytes(p) for p in params),
        "grads": sum(nbytes(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(nbytes(v) for s in optimizer.state.values() for v in s.values() if v.dim() > 0),
    }


def rank_main(rank: int, world: int, path: str, steps: int, warmup: int, port: int, out) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    import autotp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    base = rss("VmRSS")
    model = AutoModelForCausalLM.from_pretrained(path) if world == 1 else autotp.from_pretrained(path, world)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ids = torch.randint(0, VOCAB, BATCH, generator=torch.Generator().manual_seed(1))
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS: the load's transients left out
    times, cpu, losses = [], [], []
    for i in range(warmup + steps):
        start, start_cpu = time.perf_counter(), time.process_time()
        optimizer.zero_grad()  # at the start, so the last step's gradients are still held when counted
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        losses.append(loss.item())
    state = held(model, optimizer)
    report = {
        **state,
        "state": sum(state.values()),
        "peak": rss("VmHWM") - base,
        "median": statistics.median(times),
        "cpu": statistics.median(cpu),
        "losses": losses,
        "numels": {name: nbytes(p) // p.element_size() for name, p in model.named_parameters()},
    }
    out.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def run(path: str, world: int, steps: int, warmup: int) -> list[dict]:
    return [report for _, report in spawn_ranks(rank_main, world, (path, steps, warmup), MALLOC)]


def planned(family: str, tp: int) -> dict:
    """What the plan shards at `tp`, planned on the meta device as `autotp plan` plans it."""
    from transformers import AutoModelForCausalLM

    import autotp

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config(family))
    plan = autotp.explain(model, tp)
    sharded = plan.sharded_params(model)
    params = dict(model.named_parameters())
    whole: dict[str, int] = defaultdict(int)  # module -> bytes of its parameters the plan keeps whole
    for name, p in params.items():
        if name not in sharded:
            whole[name.rsplit(".", 1)[0]] += p.numel() * p.element_size()
    return {
        "tensors": len(params),
        "sharded": len(sharded),
        "per_rank": plan.param_bytes(model),
        "total": sum(p.numel() * p.element_size() for p in params.values()),
        "whole": sorted(whole.items(), key=lambda item: -item[1]),
        "vocab": plan.vocab is not None,
    }


def mib(value: float) -> str:
    return f"{value / 2**20:.1f}"


def table(family: str, rounds: dict[int, list[list[dict]]], plan: dict) -> None:
    """The family's side-by-side table (ratios: tp 2's larger rank over one process), its plan and loss lines."""
    print(f"\n{family}: {mib(plan['total'])} MiB of fp32 parameters, batch {BATCH[0]} x {BATCH[1]}, AdamW")
    if 1 not in rounds or 2 not in rounds:
        print("- not compared: a run failed (its reason is above)")
        return
    print(
        "| run | s/step, median (min-max) over rounds | vs one process | CPU s/step per rank | vs one process | "
        "parameters, MiB per rank | parameters + gradients + AdamW, MiB per rank | vs one process | peak RSS growth, "
        "MiB per rank | vs one process |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    walls = {world: [max(r["median"] for r in ranks) for ranks in rounds[world]] for world in (1, 2)}
    wall = {world: statistics.median(walls[world]) for world in (1, 2)}
    cpu = {
        world: [statistics.median(ranks[i]["cpu"] for ranks in rounds[world]) for i in range(world)] for world in (1, 2)
    }
    last = {
        world: {key: [r[key] for r in rounds[world][-1]] for key in ("params", "state", "peak")} for world in (1, 2)
    }
    ratio = lambda key: f"{max(last[2][key]) / max(last[1][key]):.3f}"  # noqa: E731
    ranks = lambda world, key: " / ".join(mib(v) for v in last[world][key])  # noqa: E731
    for world, label, vs in (
        (1, "one process, 1 thread", ("1.00", "1.00", "1.000", "1.000")),
        (
            2,
            "tp 2, 2 ranks x 1 thread",
            (f"{wall[2] / wall[1]:.2f}", f"{max(cpu[2]) / cpu[1][0]:.2f}", ratio("state"), ratio("peak")),
        ),
    ):
        print(
            f"| {label} | {wall[world]:.3f} ({min(walls[world]):.3f}-{max(walls[world]):.3f}) | {vs[0]} | "
            f"{' / '.join(f'{c:.3f}' for c in cpu[world])} | {vs[1]} | {ranks(world, 'params')} | "
            f"{ranks(world, 'state')} | {vs[2]} | {ranks(world, 'peak')} | {vs[3]} |"
        )
    print_plan(plan, rounds, ranks(2, "params"))
    losses = [(one[0]["losses"], tp[0]["losses"]) for one, tp in zip(rounds[1], rounds[2])]
    largest = max(abs(a - b) for single, split in losses for a, b in zip(single, split))
    single, split = losses[-1]
    print(
        f"- loss, one process / tp 2: step 1 {single[0]:.6f} / {split[0]:.6f}, step {len(single)} {single[-1]:.6f} / "
        f"{split[-1]:.6f}; largest difference over every step of every round {largest:.1e} (fp32)"
    )


def print_plan(plan: dict, rounds: dict[int, list[list[dict]]], measured_bytes: str) -> None:
    """What the plan shards and keeps whole, beside what the tp 2 run's ranks hold."""
    whole = rounds[1][-1][0]["numels"]
    measured = sum(1 for name, n in rounds[2][-1][0]["numels"].items() if n < whole[name])
    kept = ", ".join(f"{name} {mib(size)}" for name, size in plan["whole"][:4])
    rest = sum(size for _, size in plan["whole"][4:])
    print(
        f"- plan at tp 2: {plan['sharded']} of {plan['tensors']} parameter tensors sharded ({measured} measured "
        f"smaller on a rank); {' / '.join(mib(b) for b in plan['per_rank'])} MiB planned per rank (measured "
        f"{measured_bytes}), {max(plan['per_rank']) / plan['total']:.3f} of the whole; vocab-parallel: "
        f"{'yes' if plan['vocab'] else 'no'}; kept whole (MiB): {kept}, {len(plan['whole']) - 4} more modules "
        f"{rest / 2**20:.2f}"
    )


def measure(
    results: dict[int, list[list[dict]]], path: str, world: int, args: argparse.Namespace, round_index: int
) -> None:
    """One run of the model at `path` on `world` ranks, added to `results`; a run that fails prints its reason."""
    try:
        ranks = run(path, world, args.steps, args.warmup)
    except Exception as err:  # reported, not fatal: the other runs still compare
        print(f"{Path(path).name} at {world} ranks failed: {str(err).strip().splitlines()[-1][:300]}", flush=True)
        return
    results[world].append(ranks)
    print(
        f"round {round_index + 1}, {Path(path).name}, {world} rank(s): "
        f"{max(r['median'] for r in ranks):.3f} s/step, loss {ranks[0]['losses'][-1]:.6f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    results: dict[str, dict[int, list[list[dict]]]] = defaultdict(lambda: defaultdict(list))
    with tempfile.TemporaryDirectory(prefix="autotp-hybrid-") as folder:
        for family in args.families:
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config(family)).save_pretrained(Path(folder) / family)
        for round_index in range(args.rounds):
            for family in args.families:
                for world in (1, 2):
                    measure(results[family], str(Path(folder) / family), world, args, round_index)
    print(
        f"\n{args.rounds} interleaved rounds of {args.steps} steps after {args.warmup} warm-up, each run in fresh "
        f"processes, 1 thread per rank; ratios are tp 2's larger rank over one process"
    )
    for family in args.families:
        table(family, results[family], planned(family, 2))


if __name__ == "__main__":
    main()
