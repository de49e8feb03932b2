"""Many small experts, side by side at 2 and 4 CPU ranks: autotp EP, autotp TP-only, autotp TP x EP, and
transformers' own expert parallelism (`DistributedConfig(ep_size=...)`).

    python benchmarks/moe.py [--worlds 2 4] [--rounds 2] [--steps 4] [--warmup 1]

Qwen3-MoE, hidden 512, 4 layers, 8/4 heads, 32 experts of width 128, top-4, vocab 4000; a global batch of 8 x 128
tokens, fp32, SGD, 1 thread per rank on gloo. At each world size W:

- autotp EP: `wrap(model, 1, ep_size=W)`: dense layers data-parallel (dp W, 8/W rows each), experts split by expert,
  `autotp.allreduce_gradients` after backward;
- autotp TP: `wrap(model, W)`: every expert sliced by width over W ranks, the whole batch on each (dp 1);
- autotp TP x EP: `wrap(model, W, ep_size=W)`: dense layers as TP, experts whole, the TP ranks split the tokens
  before the dispatch (dp 1);
- transformers EP: `from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=W, ep_size=W,
  ep_implementation="all_to_all"))`: dense layers FSDP2-sharded (dp W), experts split by expert, tokens by
  all-to-all. It runs on CPU/gloo in transformers 5.24.

The runs are interleaved (each once per round, in fresh processes). Reported: step time (the median over rounds of
each run's median step, the slower rank), per-rank expert bytes, and the bytes each rank sends per step in
collectives (counted at torch.distributed's Python functions and, for DTensor's functional collectives, at the
dispatcher: all-reduce, all-gather, reduce-scatter and all-to-all inputs, the rows a rank keeps for
itself included; the slower rank's).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=128,
    num_experts=32,
    num_experts_per_tok=4,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    vocab_size=4000,
    tie_word_embeddings=False,
)
GLOBAL = (8, 128)
COUNTED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "broadcast",
)


class Sent:
    """Bytes of the collectives' inputs on this rank: torch.distributed's functions patched, functional ones seen
    by a dispatch mode (DTensor's redistributions)."""

    def __init__(self) -> None:
        self.bytes, self.on = 0, False
        for name in COUNTED:
            real = getattr(dist, name)
            setattr(dist, name, self._counting(real))

    def _counting(self, real):
        def call(*args, **kwargs):
            if self.on:
                tensor = (
                    args[1]
                    if real.__name__ in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
                    else args[0]
                )
                tensor = tensor[0] if isinstance(tensor, list) else tensor  # all_gather's output list: one part
                self.bytes += tensor.numel() * tensor.element_size()
            return real(*args, **kwargs)

        return call


class FunctionalSent(TorchDispatchMode):
    def __init__(self, sent: Sent) -> None:
        super().__init__()
        self.sent = sent

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.sent.on and func.namespace == "_c10d_functional" and "wait" not in func.__name__:
            first = args[0][0] if isinstance(args[0], (list, tuple)) else args[0]
            if torch.is_tensor(first):
                self.sent.bytes += first.numel() * first.element_size()
        return func(*args, **(kwargs or {}))


def local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def build(name: str, path: str, world: int):
    """The model of run `name` on this rank, its rows of the global batch, and the gradient sync to call."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, CONFIG["vocab_size"], GLOBAL, generator=torch.Generator().manual_seed(1))
    if name == "transformers EP":
        from transformers.distributed import DistributedConfig

        config = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation="all_to_all")
        model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, dtype=torch.float32)
        rows = GLOBAL[0] // world
        return model, ids[dist.get_rank() * rows : (dist.get_rank() + 1) * rows], lambda: None
    import autotp

    tp, ep = {"autotp EP": (1, world), "autotp TP": (world, 1), "autotp TP x EP": (world, world)}[name]
    model = autotp.from_pretrained(path, tp, ep_size=ep)
    rows = GLOBAL[0] // autotp.dp_size(model)
    mine = ids[autotp.dp_rank(model) * rows : (autotp.dp_rank(model) + 1) * rows]
    return model, mine, lambda: autotp.allreduce_gradients(model)


def rank_main(rank: int, world: int, name: str, path: str, port: int, steps: int, warmup: int, out) -> None:
    torch.set_num_threads(1)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU benchmark: on a GPU machine transformers would pick NCCL
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if name != "transformers EP":  # transformers starts the process group itself
        dist.init_process_group("gloo", rank=rank, world_size=world)
    sent = Sent()
    model, ids, sync = build(name, path, world)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    with FunctionalSent(sent):
        for i in range(warmup + steps):
            sent.on, sent.bytes = i == warmup, 0 if i == warmup else sent.bytes
            start = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            sync()
            opt.step()
            opt.zero_grad()
            if i >= warmup:
                times.append(time.perf_counter() - start)
            if i == warmup:
                sent.on, step_bytes = False, sent.bytes
    experts = sum(local(p).numel() * local(p).element_size() for n, p in model.named_parameters() if ".experts." in n)
    out.put((rank, {"median": statistics.median(times), "experts": experts, "sent": step_bytes}))
    dist.barrier()
    dist.destroy_process_group()


RUNS = ["autotp EP", "autotp TP", "autotp TP x EP", "transformers EP"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from autotp.testing.spawn import free_port

    path = str(Path(tempfile.mkdtemp(prefix="autotp-moe-")) / "model")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**CONFIG))
    whole = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    model.save_pretrained(path)
    ctx = mp.get_context("spawn")
    results: dict = {}
    for round_index in range(args.rounds):
        for world in args.worlds:
            for name in RUNS:
                out = ctx.SimpleQueue()
                try:
                    mp.start_processes(
                        rank_main,
                        args=(world, name, path, free_port(), args.steps, args.warmup, out),
                        nprocs=world,
                        start_method="spawn",
                    )
                except Exception as err:  # a run that fails is reported with its reason, not fatal
                    print(f"{name} at {world} ranks failed: {str(err).strip().splitlines()[-1][:300]}")
                    continue
                ranks = [r for _, r in sorted(out.get() for _ in range(world))]
                results.setdefault((world, name), []).append(ranks)
                print(
                    f"{name} at {world} ranks: {max(r['median'] for r in ranks):.3f} s/step, "  # kept if cut off
                    f"{max(r['experts'] for r in ranks) / 2**20:.1f} expert MiB, "
                    f"{max(r['sent'] for r in ranks) / 2**20:.1f} MiB sent",
                    flush=True,
                )
        print(f"round {round_index + 1} done", flush=True)
    print(
        f"\nQwen3-MoE hidden 512, 4 layers, 32 experts of width 128, top-4; batch {GLOBAL[0]} x {GLOBAL[1]} "
        f"(global), fp32, SGD; {args.rounds} interleaved rounds of {args.steps} steps after {args.warmup} warm-up; "
        f"experts of the whole model: {whole / 2**20:.1f} MiB"
    )
    print("| ranks | run | s/step, median (min-max) over rounds | expert MiB per rank | MiB sent per step per rank |")
    print("|---|---|---|---|---|")
    for (world, name), rounds in results.items():
        steps = [max(r["median"] for r in ranks) for ranks in rounds]
        last = rounds[-1]
        print(
            f"| {world} | {name} | {statistics.median(steps):.3f} ({min(steps):.3f}-{max(steps):.3f}) | "
            f"{max(r['experts'] for r in last) / 2**20:.1f} | {max(r['sent'] for r in last) / 2**20:.1f} |"
        )


if __name__ == "__main__":
    main()
