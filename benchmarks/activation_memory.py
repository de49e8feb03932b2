"""Activation memory of one training step at tp=2: vocab parallelism and sequence parallelism on and off.

    python benchmarks/activation_memory.py

Each configuration runs in 2 freshly spawned CPU ranks (gloo, 1 thread). A rank wraps the model and
runs one forward/backward. It reports the bytes autograd saved for the backward pass and still holds when the
forward ends (every saved tensor's storage counted once, parameters excluded; `autotp.testing.memory`): the
activation memory. It also reports how
far its RSS peaked above where the step began (the peak, VmHWM, is reset just before the step), which
adds gradients and temporaries. That is measured twice: with glibc's default allocator, whose heap keeps
freed blocks mapped (so it also measures fragmentation), and with `MALLOC_MMAP_THRESHOLD_=131072`, which
maps every tensor on its own and unmaps it when freed, so the peak is the live bytes'. Rows are compared
in pairs that differ in one option. "Held after forward" is how far RSS rose during the forward: what the
backward will need (under activation checkpointing, where autograd's saved tensors inside the
checkpointed layers are the checkpoint's, the layers' inputs). Last, the bytes each rank sends in the step's collectives, as ring
algorithms send them: an all-reduce of N bytes sends 2 (p-1)/p N, an all-gather into N bytes or a
reduce-scatter of N bytes sends (p-1)/p N.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

VOCAB = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=65536,
)
VOCAB_BATCH = (4, 512)
SEQUENCE = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=8000,
)  # issue 15's configuration
SEQUENCE_BATCH = (8, 256)

RUNS = [  # (label, config, batch, wrap options); RUNS[int(sys.argv[1]):] with an argument
    ("vocab 64k: logits gathered (vocab_parallel=False)", VOCAB, VOCAB_BATCH, dict(vocab_parallel=False)),
    ("vocab 64k: sharded logits + vocab-parallel loss", VOCAB, VOCAB_BATCH, dict(vocab_parallel=True)),
    (
        "hidden 1024, 8 layers, 8 x 256 tokens: sequence_parallel=False",
        SEQUENCE,
        SEQUENCE_BATCH,
        dict(sequence_parallel=False),
    ),
    (
        "hidden 1024, 8 layers, 8 x 256 tokens: sequence_parallel=True",
        SEQUENCE,
        SEQUENCE_BATCH,
        dict(sequence_parallel=True),
    ),
    (
        "same, recompute_glu=False, sequence_parallel=False",
        SEQUENCE,
        SEQUENCE_BATCH,
        dict(sequence_parallel=False, recompute_glu=False),
    ),
    (
        "same, recompute_glu=False, sequence_parallel=True",
        SEQUENCE,
        SEQUENCE_BATCH,
        dict(sequence_parallel=True, recompute_glu=False),
    ),
    (
        "same, activation checkpointing, sequence_parallel=False",
        SEQUENCE,
        SEQUENCE_BATCH,
        dict(sequence_parallel=False, checkpointing=True),
    ),
    (
        "same, activation checkpointing, sequence_parallel=True",
        SEQUENCE,
        SEQUENCE_BATCH,
        dict(sequence_parallel=True, checkpointing=True),
    ),
]


def rss(field: str) -> int:
    """VmRSS or VmHWM (the peak since the last reset) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field}")


def sent_bytes(counter: dict) -> dict:
    """Wrap torch.distributed's collectives so `counter["sent"]` adds what each sends (ring algorithms); returns the
    originals to put back."""
    originals = {}

    def wrap(name: str, size) -> None:
        real = getattr(dist, name, None)
        if real is None:
            return
        originals[name] = real

        def call(*args, **kwargs):
            world = dist.get_world_size(kwargs.get("group"))
            counter["sent"] += size(*args) * (world - 1) // world
            return real(*args, **kwargs)

        setattr(dist, name, call)

    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    wrap("all_reduce", lambda tensor, *_: 2 * nbytes(tensor))
    for name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single"):
        wrap(name, lambda out, inp, *_: max(nbytes(out), nbytes(inp)))
    wrap("all_gather", lambda outs, tensor, *_: nbytes(tensor) * len(outs))
    return originals


def rank_main(rank: int, world: int, config: dict, shape: tuple[int, int], options: dict, port: int, out) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, LlamaConfig

    import autotp
    from autotp.testing.memory import KeptForBackward

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    options = dict(options)
    checkpointing = options.pop("checkpointing", False)
    model = autotp.wrap(AutoModelForCausalLM.from_config(LlamaConfig(**config)), world, **options)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, config["vocab_size"], shape, generator=torch.Generator().manual_seed(1))
    kept = KeptForBackward(model)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = rss("VmRSS")
    with kept.hooks:
        loss = model(input_ids=ids, labels=ids).loss
    held = rss("VmRSS") - baseline
    saved = kept.bytes()
    loss.backward()
    peak = rss("VmHWM") - baseline
    counter = {"sent": 0}
    originals = sent_bytes(counter)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)
    out.put((rank, saved, peak, counter["sent"], held))
    dist.barrier()
    dist.destroy_process_group()


def spawn_ranks(rank_main, world: int, args: tuple, env: dict[str, str]) -> list[tuple]:
    """What each rank put on the queue (its rank first), in rank order: `rank_main(rank, world, *args, port, out)` in
    freshly spawned processes, with `env` added to their environment (glibc reads `MALLOC_*` as they start)."""
    from autotp.testing.spawn import free_port

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    before = dict(os.environ)
    os.environ.update(env)
    try:
        mp.start_processes(rank_main, args=(world, *args, free_port(), out), nprocs=world, start_method="spawn")
    finally:
        os.environ.clear()
        os.environ.update(before)
    return sorted((out.get() for _ in range(world)), key=lambda row: row[0])


def run(
    config: dict, shape: tuple[int, int], options: dict, malloc: dict[str, str]
) -> list[tuple[int, int, int, int, int]]:
    """(rank, saved bytes, peak RSS growth, bytes sent, RSS held after forward) of each rank, spawned with `malloc` added to the environment."""
    return spawn_ranks(rank_main, 2, (config, shape, options), malloc)


def main() -> None:
    print(
        "| configuration (tp=2, 2 CPU ranks) | saved for backward (rank 0 / 1) | peak RSS growth, glibc default "
        "| peak RSS growth, `MALLOC_MMAP_THRESHOLD_=131072` | held after forward, live bytes | sent per rank per step |"
    )
    print("|---|---|---|---|---|---|")
    mib = lambda rows, i: " / ".join(f"{row[i] / 2**20:.0f}" for row in rows) + " MiB"  # noqa: E731
    for label, config, shape, options in RUNS[int(sys.argv[1]) if len(sys.argv) > 1 else 0 :]:
        default = run(config, shape, options, {})
        mapped = run(config, shape, options, {"MALLOC_MMAP_THRESHOLD_": "131072"})
        print(
            f"| {label} | {mib(default, 1)} | {mib(default, 2)} | {mib(mapped, 2)} | {mib(mapped, 4)} | "
            f"{mib(default, 3)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
