"""Peak RSS per rank: autotp.from_pretrained against load-then-wrap, for a checkpoint of at least 1 GB at tp=2.

    python benchmarks/load_memory.py [--dir /tmp/autotp-bench-1g]

Each method runs in 2 freshly spawned ranks (gloo, 1 thread). Every rank records its baseline (peak
RSS after importing torch, transformers and autotp and joining the group), then its peak RSS after
loading, and the bytes of the parameters and buffers it ends up holding (its shard). Target for
from_pretrained: peak <= baseline + 1.3 x shard.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5504,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=False,
)


def peak_rss() -> int:
    """This process's peak resident set size in bytes (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def make_checkpoint(path: Path) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    if not (path / "model.safetensors").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).save_pretrained(path)
    return (path / "model.safetensors").stat().st_size


def rank_main(rank: int, world: int, method: str, path: str, port: int, results) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    import autotp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    baseline = peak_rss()
    if method == "autotp.from_pretrained":
        model = autotp.from_pretrained(path, world)
    else:
        model = autotp.wrap(AutoModelForCausalLM.from_pretrained(path), world)
    peak = peak_rss()
    shard = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    results.put((method, rank, baseline, peak, shard))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/tmp/autotp-bench-1g", help="where the checkpoint is made (kept for reuse)")
    args = parser.parse_args()
    from autotp.testing.spawn import free_port

    size = make_checkpoint(Path(args.dir))
    print(f"checkpoint: {args.dir}, {size / 2**30:.2f} GiB (Llama, fp32, {CONFIG})")
    ctx = mp.get_context("spawn")
    rows = []
    for method in ("autotp.from_pretrained", "load-then-wrap"):
        results = ctx.SimpleQueue()
        mp.start_processes(rank_main, args=(2, method, args.dir, free_port(), results), nprocs=2, start_method="spawn")
        rows += sorted(results.get() for _ in range(2))
    gib = 2**30
    print("\n| method | rank | baseline | peak RSS | shard | (peak - baseline) / shard | target <= 1.3 |")
    print("|---|---|---|---|---|---|---|")
    for method, rank, baseline, peak, shard in rows:
        ratio = (peak - baseline) / shard
        print(
            f"| {method} | {rank} | {baseline / gib:.2f} GiB | {peak / gib:.2f} GiB | {shard / gib:.2f} GiB | "
            f"{ratio:.2f} | {'yes' if ratio <= 1.3 else 'no'} |"
        )


if __name__ == "__main__":
    main()
