"""Weight sync to a rollout engine, side by side in one run: autotp's send against TRL's way, same model, same
transport.

    python benchmarks/sync.py [--layers 2] [--bucket-mib 64] [--rounds 2]

Three CPU processes (gloo, 1 thread each): two trainer ranks (their own world) holding a Llama of about 0.2 B parameters
(fp32, 2 layers by default) at tp=2, and one engine rank (outside that world, as an engine is) that receives (`autotp.receive_weights`, dropping each tensor
as an engine's `load_weights` does after copying it). The transport is the same for both ways: autotp's bucketed
broadcast from trainer rank 0 to the engine rank over their own gloo group and store (`send_tensors`).
- autotp: `sync_weights` (`export_weights`' checkpoint tensors gathered bucket by bucket, one broadcast per bucket);
- TRL's way (`GRPOTrainer._move_model_to_vllm`, #5892): for each parameter, gather its full tensor over TP, then
  send it alone (one broadcast per tensor).
Each rank reports the seconds of the round (the trainer ranks starting together; the engine's count its wait for the
first bucket; the slowest round of `--rounds`) and its peak RSS above the round's start (VmHWM reset just before; large buffers mmapped, so freed ones leave RSS).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5504,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=False,
)
TRAINERS = 2


def rss(field: str = "VmRSS") -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))


def measured(call, group: dist.ProcessGroup | None) -> tuple[float, int]:
    """(seconds, peak RSS above the start) of `call()`, the trainer ranks starting together (`group`: theirs)."""
    if group is not None:
        dist.barrier(group)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before, start = rss(), time.perf_counter()
    call()
    return time.perf_counter() - start, rss("VmHWM") - before


def trl_way(model: torch.nn.Module, engine: dist.ProcessGroup | None) -> None:
    """Each parameter's full tensor gathered over TP, then sent alone (a bucket smaller than any tensor)."""
    import autotp
    from autotp.io.rollout.sync import send_tensors
    from autotp.testing.parity import full_tensor

    group = autotp.tp_group(model)
    pairs = ((name, full_tensor(p, p, group)) for name, p in model.named_parameters())
    if engine is not None:
        send_tensors(pairs, engine, bucket_bytes=1)
    else:
        for _ in pairs:
            pass


def engine_group(rank: int, port: int) -> dist.ProcessGroup:
    """Trainer rank 0 (rank 0) and the engine (rank 1) over their own store, as docs/rl.md builds it."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0)
    return dist.ProcessGroupGloo(dist.PrefixStore("engine", store), rank, 2, datetime.timedelta(minutes=10))


def rank_main(index: int, layers: int, bucket: int, rounds: int, ports: tuple[int, int], out) -> None:
    """Process `index`: trainer ranks 0 and 1 (their own world), then the engine rank."""
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD fixed: a freed large buffer leaves RSS
    if index < TRAINERS:
        from transformers import LlamaConfig, LlamaForCausalLM

        import autotp

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
        dist.init_process_group("gloo", rank=index, world_size=TRAINERS)
        engine = engine_group(0, ports[1]) if index == 0 else None
        torch.manual_seed(0)
        model = autotp.wrap(LlamaForCausalLM(LlamaConfig(**CONFIG, num_hidden_layers=layers)), TRAINERS)
        ways = {
            "autotp": lambda: autotp.sync_weights(model, engine, bucket_bytes=bucket),
            "trl": lambda: trl_way(model, engine),
        }
        trainers = dist.group.WORLD
    else:
        from autotp import receive_weights

        engine, trainers = engine_group(1, ports[1]), None

        def receive():
            for _, tensor in receive_weights(engine):
                del tensor

        ways = {"autotp": receive, "trl": receive}
    results = {name: max(measured(ways[name], trainers) for _ in range(rounds)) for name in ("autotp", "trl")}
    out.put((index, results))
    if trainers is not None:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--bucket-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    from autotp.testing.spawn import free_port

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    world = TRAINERS + 1
    mp.start_processes(
        rank_main,
        args=(args.layers, args.bucket_mib << 20, args.rounds, (free_port(), free_port()), out),
        nprocs=world,
        start_method="spawn",
    )
    ranks = dict(out.get() for _ in range(world))
    print(
        f"Llama, hidden {CONFIG['hidden_size']}, {args.layers} layers, vocab {CONFIG['vocab_size']} (fp32), tp=2 "
        f"trainer ranks -> 1 engine rank, gloo; bucket {args.bucket_mib} MiB; slowest of {args.rounds} rounds"
    )
    print("| way | seconds (trainer 0 / trainer 1 / engine) | peak RSS growth (trainer 0 / trainer 1 / engine) |")
    print("|---|---|---|")
    for name, label in (
        ("autotp", "autotp `sync_weights` (buckets)"),
        ("trl", "TRL's way: each parameter gathered whole, then sent alone"),
    ):
        rows = [ranks[r][name] for r in range(world)]
        print(
            f"| {label} | {' / '.join(f'{s:.2f}' for s, _ in rows)} | "
            f"{' / '.join(f'{m / 2**20:.0f} MiB' for _, m in rows)} |"
        )


if __name__ == "__main__":
    main()
