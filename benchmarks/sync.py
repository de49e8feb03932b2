"""Weight sync to a rollout engine, side by side in one run: autotp's send against TRL's way, same model, same
transport.

    python benchmarks/sync.py [--layers 2] [--bucket-mib 64] [--rounds 2]

Three CPU processes (gloo, 1 thread each): two trainer ranks holding a Llama of about 0.2 B parameters (fp32,
2 layers by default) at tp=2, and one engine rank that receives (`autotp.receive_weights`, dropping each tensor
as an engine's `load_weights` does after copying it). The transport is the same for both ways: autotp's bucketed
broadcast from trainer rank 0 to the engine rank over their own gloo group (`send_tensors`).
- autotp: `sync_weights` (`export_weights`' checkpoint tensors gathered bucket by bucket, one broadcast per bucket);
- TRL's way (`GRPOTrainer._move_model_to_vllm`, #5892): for each parameter, gather its full tensor over TP, then
  send it alone (one broadcast per tensor).
Each rank reports the seconds of the round (every rank starting together; the slowest round of `--rounds`) and its
peak RSS above the round's start (VmHWM reset just before; large buffers mmapped, so freed ones leave RSS).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = dict(hidden_size=2048, intermediate_size=5504, num_attention_heads=16, num_key_value_heads=8,
              vocab_size=32000, tie_word_embeddings=False)
TRAINERS = 2


def rss(field: str = "VmRSS") -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))


def measured(call) -> tuple[float, int]:
    """(seconds, peak RSS above the start) of `call()`, every rank starting together."""
    dist.barrier()
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


def rank_main(rank: int, world: int, layers: int, bucket: int, rounds: int, port: int, out) -> None:
    torch.set_num_threads(1)
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD fixed: a freed large buffer leaves RSS
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    trainers = dist.new_group(list(range(TRAINERS)))
    engine = dist.new_group([0, TRAINERS])  # trainer rank 0 (the sender) and the engine rank
    results = {}
    if rank < TRAINERS:
        from transformers import LlamaConfig, LlamaForCausalLM

        import autotp

        torch.manual_seed(0)
        model = autotp.wrap(LlamaForCausalLM(LlamaConfig(**CONFIG, num_hidden_layers=layers)), TRAINERS,
                            tp_group=trainers)
        ways = {"autotp": lambda: autotp.sync_weights(model, engine if rank == 0 else None, bucket_bytes=bucket),
                "trl": lambda: trl_way(model, engine if rank == 0 else None)}
    else:
        from autotp import receive_weights

        def receive():
            for _, tensor in receive_weights(engine):
                del tensor

        ways = {"autotp": receive, "trl": receive}
    for name in ("autotp", "trl"):
        runs = [measured(ways[name]) for _ in range(rounds)]
        results[name] = max(runs)
    out.put((rank, results))
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
    mp.start_processes(rank_main, args=(world, args.layers, args.bucket_mib << 20, args.rounds, free_port(), out),
                       nprocs=world, start_method="spawn")
    ranks = dict(out.get() for _ in range(world))
    print(f"Llama, hidden {CONFIG['hidden_size']}, {args.layers} layers, vocab {CONFIG['vocab_size']} (fp32), tp=2 "
          f"trainer ranks -> 1 engine rank, gloo; bucket {args.bucket_mib} MiB; slowest of {args.rounds} rounds")
    print("| way | seconds (trainer 0 / trainer 1 / engine) | peak RSS growth (trainer 0 / trainer 1 / engine) |")
    print("|---|---|---|")
    for name, label in (("autotp", "autotp `sync_weights` (buckets)"),
                        ("trl", "TRL's way: each parameter gathered whole, then sent alone")):
        rows = [ranks[r][name] for r in range(world)]
        print(f"| {label} | {' / '.join(f'{s:.2f}' for s, _ in rows)} | "
              f"{' / '.join(f'{m / 2**20:.0f} MiB' for _, m in rows)} |")


if __name__ == "__main__":
    main()
