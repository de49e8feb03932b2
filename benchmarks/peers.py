"""One training step, side by side: autotp, transformers TP, torch parallelize_module, DeepSpeed AutoTP, one process.

    pip install deepspeed            # optional: a peer that is not installed is skipped with a message
    python benchmarks/peers.py [--rounds 3] [--steps 16] [--warmup 2]

Same Llama-style model (hidden 512, 4 layers, 8/4 heads, ffn 1408, vocab 8000), batch 4 x 128, fp32,
SGD, 2 ranks x 1 thread on gloo (each peer in freshly spawned processes), and one process with one
thread. The peers run in interleaved rounds (every peer once per round, so a slow spell of a shared
machine hits all of them alike); each run reports the median of its steps. Reported per peer: the
median over rounds of those medians and their spread (min-max), the ratio to autotp's measured in
each round (median and spread), parameter MB per rank, peak RSS per rank. For autotp also: the
collectives it ran per step and their bytes, against the minimum of 2 forward + 2 backward
all-reduces of batch x seq x hidden per layer, and the time the slower rank spends blocked in them. Then save_pretrained throughput
against a one-process transformers save of the same model.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8000,
    tie_word_embeddings=False,
)
BATCH = (4, 128)


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def batch() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], BATCH, generator=torch.Generator().manual_seed(1))


def time_steps(step, steps: int, warmup: int) -> tuple[float, float]:
    times, loss = [], 0.0
    for i in range(warmup + steps):
        start = time.perf_counter()
        loss = step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), loss


def param_mb(model) -> float:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total / 2**20


def sgd_step(model, opt, ids, backward=None):
    def step():
        loss = model(input_ids=ids, labels=ids).loss
        (backward or (lambda out: out.backward()))(loss)
        opt.step()
        opt.zero_grad()
        return loss.item()

    return step


def measure(model, steps: int, warmup: int) -> dict:
    """Median SGD step time, last loss and parameter MB of a model that trains like a plain HF model."""
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    median, loss = time_steps(sgd_step(model, opt, batch()), steps, warmup)
    return {"median": median, "loss": loss, "param_mb": param_mb(model)}


# ---- the peers: each runs on one rank of a 2-rank group and returns its measurements ----


def run_autotp(path: str, steps: int, warmup: int) -> dict:
    import autotp

    model = autotp.from_pretrained(path, 2)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    counts = {"n": 0, "bytes": 0, "blocked": 0.0}
    real = dist.all_reduce

    class Timed:
        """An asynchronous collective's handle whose wait is timed as blocked."""

        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            start = time.perf_counter()
            try:
                return self.work.wait(*args, **kwargs)
            finally:
                counts["blocked"] += time.perf_counter() - start

    def counting(tensor, *args, async_op=False, **kwargs):
        counts["n"] += 1
        counts["bytes"] += tensor.numel() * tensor.element_size()
        start = time.perf_counter()
        work = real(tensor, *args, async_op=async_op, **kwargs)
        counts["blocked"] += time.perf_counter() - start
        return Timed(work) if async_op else work

    ids = batch()
    median, loss = time_steps(sgd_step(model, opt, ids), steps, warmup)
    dist.all_reduce = counting
    try:
        sgd_step(model, opt, ids)()
        collectives, moved = counts["n"], counts["bytes"]
        counts["blocked"] = 0.0
        timed, _ = time_steps(sgd_step(model, opt, ids), steps, 0)
    finally:
        dist.all_reduce = real
    return {
        "median": median,
        "loss": loss,
        "param_mb": param_mb(model),
        "collectives": collectives,
        "collective_bytes": moved,
        "blocked": counts["blocked"] / steps,
        "timed": timed,
    }


def run_transformers(path: str, steps: int, warmup: int) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, distributed_config=DistributedConfig(tp_size=2), dtype=torch.float32
    )
    return measure(model, steps, warmup)


def run_torch(path: str, steps: int, warmup: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    mesh = init_device_mesh("cpu", (2,))
    plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return measure(model, steps, warmup)


def run_deepspeed(path: str, steps: int, warmup: int) -> dict:
    import deepspeed
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = {
        "train_micro_batch_size_per_gpu": BATCH[0],
        "tensor_parallel": {"autotp_size": 2},
        "zero_optimization": {"stage": 0},
        "optimizer": {"type": "SGD", "params": {"lr": 1e-3}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()
    ids = batch()

    def step():
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        return loss.item()

    median, loss = time_steps(step, steps, warmup)
    return {"median": median, "loss": loss, "param_mb": param_mb(engine.module)}


PEERS = {
    "autotp": (run_autotp, None),
    "transformers TP": (run_transformers, None),
    "torch parallelize_module": (run_torch, None),
    "DeepSpeed AutoTP": (run_deepspeed, "deepspeed"),
}


def rank_main(rank: int, world: int, name: str, path: str, port: int, steps: int, warmup: int, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    if name != "transformers TP":  # transformers starts the process group itself
        dist.init_process_group("gloo", rank=rank, world_size=world)
    result = PEERS[name][0](path, steps, warmup)
    result["rss_mb"] = peak_rss() / 2**20
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def one_process(path: str, steps: int, warmup: int, out) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    out.put({**measure(model, steps, warmup), "rss_mb": peak_rss() / 2**20})


def save_rank(rank: int, world: int, path: str, port: int, target: str, out) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import autotp

    model = autotp.from_pretrained(path, world)
    dist.barrier()
    start = time.perf_counter()
    autotp.save_pretrained(model, target, overwrite=True)
    out.put((rank, time.perf_counter() - start))
    dist.destroy_process_group()


def plain_save(path: str, target: str, out) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    start = time.perf_counter()
    model.save_pretrained(target)
    out.put(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, LlamaConfig

    from autotp.testing.spawn import free_port

    work = Path(tempfile.mkdtemp(prefix="autotp-peers-"))
    path = str(work / "model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).save_pretrained(path)
    ctx = mp.get_context("spawn")
    runnable = []
    for name, (_, module) in PEERS.items():
        if module is not None:
            try:
                __import__(module)
            except ImportError:
                print(f"skipping {name}: `{module}` is not installed (pip install {module})")
                continue
        runnable.append(name)
    rounds: list[dict] = []
    for round_index in range(args.rounds):
        times: dict = {}
        for name in runnable:
            out = ctx.SimpleQueue()
            try:
                mp.start_processes(
                    rank_main,
                    args=(2, name, path, free_port(), args.steps, args.warmup, out),
                    nprocs=2,
                    start_method="spawn",
                )
            except Exception as err:  # a peer that fails is reported, not fatal
                print(f"{name} failed: {str(err).strip().splitlines()[-1][:200]}")
                continue
            times[name] = [r for _, r in sorted(out.get() for _ in range(2))]
        out = ctx.SimpleQueue()
        process = ctx.Process(target=one_process, args=(path, args.steps, args.warmup, out))
        process.start()
        times["one process, 1 thread"] = [out.get()]
        process.join()
        rounds.append(times)
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{n} {max(r['median'] for r in rs):.3f} s" for n, rs in times.items()),
            flush=True,
        )

    def step_times(name: str) -> list[float]:
        return [max(r["median"] for r in times[name]) for times in rounds if name in times]

    def spread(values: list[float], digits: int) -> str:
        return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"

    ours = step_times("autotp")
    base = statistics.median(ours)
    print(
        f"\nLlama hidden 512, 4 layers, 8/4 heads, ffn 1408, vocab 8000; batch {BATCH[0]} x {BATCH[1]}, fp32, SGD; "
        f"{args.rounds} interleaved rounds, each the median of {args.steps} steps after {args.warmup} warm-up"
    )
    print(
        "| run | s/step, median (min-max) over rounds | ratio to autotp, per round | param MB per rank | "
        "peak RSS MB per rank |"
    )
    print("|---|---|---|---|---|")
    for name in rounds[0]:
        mine = step_times(name)
        ratios = [a / b for a, b in zip(mine, ours)]
        last = rounds[-1][name]
        label = name if name.startswith("one process") else f"{name} (2 ranks x 1 thread)"
        print(
            f"| {label} | {spread(mine, 3)} | {spread(ratios, 2)} | {last[0]['param_mb']:.1f} | "
            f"{max(r['rss_mb'] for r in last):.0f} |"
        )
    single = {"median": statistics.median(step_times("one process, 1 thread"))}
    peers = [
        statistics.median([a / b for a, b in zip(ours, step_times(n))])
        for n in rounds[0]
        if n not in ("autotp", "one process, 1 thread")
    ]
    if peers:
        print(f"\nautotp against the best peer: {min(peers):.2f}x its step time (median of per-round ratios)")
    efficiency = single["median"] / (2 * base)
    ours = rounds[-1]["autotp"][0]
    minimum = 4 * CONFIG["num_hidden_layers"]
    per = BATCH[0] * BATCH[1] * CONFIG["hidden_size"] * 4
    print(
        f"\nautotp parallel efficiency against one 1-thread process: {efficiency:.0%} "
        f"(one-process time / (2 x autotp time))"
    )
    print(
        f"autotp all-reduces per step: {ours['collectives']} ({ours['collective_bytes'] / 2**20:.1f} MiB); "
        f"the minimum for 4 layers is {minimum} of {per / 2**20:.1f} MiB ({minimum * per / 2**20:.1f} MiB), "
        f"plus vocab parallelism's 4 (embedding, LM-head input gradient: {2 * per / 2**20:.1f} MiB; "
        f"the loss's two: {BATCH[0] * BATCH[1] * 12 / 2**20:.2f} MiB)"
    )
    slowest = max(rounds[-1]["autotp"], key=lambda r: r["timed"])
    print(
        f"where autotp's step goes (last round, slower rank, {args.steps} more steps timed around its all-reduces): "
        f"{slowest['timed']:.3f} s/step, of which {slowest['blocked']:.3f} s blocked in all-reduces (gloo's copies "
        f"through loopback TCP, and waiting for the other rank); without that time the step would take "
        f"{slowest['timed'] - slowest['blocked']:.3f} s, a parallel efficiency of "
        f"{single['median'] / (2 * (slowest['timed'] - slowest['blocked'])):.0%}"
    )

    out = ctx.SimpleQueue()
    mp.start_processes(
        save_rank, args=(2, path, free_port(), str(work / "saved-autotp"), out), nprocs=2, start_method="spawn"
    )
    autotp_save = max(t for _, t in (out.get() for _ in range(2)))
    process = ctx.Process(target=plain_save, args=(path, str(work / "saved-plain"), out))
    process.start()
    plain = out.get()
    process.join()
    size = sum(f.stat().st_size for f in (work / "saved-plain").glob("*.safetensors")) / 2**20
    print(
        f"save_pretrained of {size:.0f} MiB: autotp at tp=2 {autotp_save:.2f} s, one-process transformers "
        f"{plain:.2f} s: throughput ratio {plain / autotp_save:.2f} (target >= 0.8)"
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
