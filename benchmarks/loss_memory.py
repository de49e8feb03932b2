"""Peak memory of one training step's loss at a 128k vocabulary (Llama-3's 128,256), small hidden size, at tp 1 and 2.

    python benchmarks/loss_memory.py [--seq 4096] [--chunks 256,512,1024,4096,0] [--skip-gathered]

A one-layer Llama of hidden size 64 runs one forward with labels and one backward on 2 x `--seq` tokens, so the step's
memory is the LM head's logits and their loss. Each row runs in freshly spawned CPU ranks (gloo, 1 thread), with
`MALLOC_MMAP_THRESHOLD_=131072` so that RSS follows the live bytes (as `benchmarks/logprob_memory.py` measures):
- plain transformers, one process (no autotp);
- `autotp.wrap(model, tp)` with `vocab_parallel=False` (at tp=2 each rank holds the whole batch x seq x vocab logits)
  and with `vocab_parallel=True` (the vocab-parallel loss: each rank holds batch x seq x vocab / tp), both with
  `loss_chunk=None` (the whole logits, as before the chunked loss);
- the chunked loss (`loss_chunk`, default 512 tokens) at tp 1 and 2: a chunk's logits and softmax at a time.
Reported per rank: bytes autograd saved for backward (`autotp.testing.memory.KeptForBackward`), the RSS growth peak
over the step, the step's seconds (forward and backward) and the loss. A second table times the step at tp 1 for each
chunk size of `--chunks` (0: off). `--skip-gathered` leaves out the tp=2 `vocab_parallel=False` whole-logits row,
the one that needs the whole logits on two ranks at once. At 2 x 4096 tokens plain transformers needs about 12 GiB per rank: `--seq` smaller runs
the same rows on a smaller machine (every figure here scales linearly with the tokens).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from activation_memory import rss, spawn_ranks  # noqa: E402

CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128256,
)
WHOLE = dict(loss_chunk=None)
GATHERED = "`autotp.wrap(model, 2, vocab_parallel=False, loss_chunk=None)` (logits gathered)"
RUNS = [
    ("plain transformers, one process", 1, None),
    ("`autotp.wrap(model, 1, loss_chunk=None)`", 1, WHOLE),
    ("`autotp.wrap(model, 1)`, chunked loss (512 tokens)", 1, {}),
    (GATHERED, 2, dict(vocab_parallel=False, **WHOLE)),
    ("`autotp.wrap(model, 2, loss_chunk=None)`, vocab-parallel loss", 2, WHOLE),
    ("`autotp.wrap(model, 2)`, vocab-parallel chunked loss (512 tokens)", 2, {}),
    ("`autotp.wrap(model, 2, vocab_parallel=False)`, replicated head, chunked loss", 2, dict(vocab_parallel=False)),
]


def rank_main(rank: int, world: int, options: dict | None, seq: int, port: int, out) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, LlamaConfig

    import autotp
    from autotp.testing.memory import KeptForBackward

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    if options is not None:
        model = autotp.wrap(model, world, **options)
    model.train()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, seq), generator=torch.Generator().manual_seed(1))
    kept = KeptForBackward(model)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = rss("VmRSS")
    start = time.perf_counter()
    with kept.hooks:
        loss = model(input_ids=ids, labels=ids).loss
    saved = kept.bytes()
    loss.backward()
    seconds = time.perf_counter() - start
    peak = rss("VmHWM") - baseline
    out.put((rank, saved, peak, float(loss.detach()), seconds))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, options: dict | None, seq: int) -> list[tuple]:
    return spawn_ranks(rank_main, world, (options, seq), {"MALLOC_MMAP_THRESHOLD_": "131072"})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence (2 sequences)")
    parser.add_argument("--chunks", default="256,512,1024,4096,0", help="chunk sizes timed at tp 1 (0: off)")
    parser.add_argument("--skip-gathered", action="store_true", help="leave out the tp=2 whole-logits gathered row")
    args = parser.parse_args()
    seq = args.seq
    print(
        f"| loss step, vocab 128,256, hidden 64, 2 x {seq} tokens | saved for backward | peak RSS growth | step | loss |"
    )
    print("|---|---|---|---|---|")
    mib = lambda rows, i: " / ".join(f"{row[i] / 2**20:.0f}" for row in rows) + " MiB"  # noqa: E731
    seconds = lambda rows: " / ".join(f"{row[4]:.2f}" for row in rows) + " s"  # noqa: E731
    for label, world, options in RUNS:
        if args.skip_gathered and label == GATHERED:
            continue
        rows = run(world, options, seq)
        print(f"| {label} | {mib(rows, 1)} | {mib(rows, 2)} | {seconds(rows)} | {rows[0][3]:.6f} |", flush=True)
    print(f"\n| `autotp.wrap(model, 1, loss_chunk=...)`, 2 x {seq} tokens | step | peak RSS growth | loss |")
    print("|---|---|---|---|")
    for chunk in (int(c) for c in args.chunks.split(",")):
        rows = run(1, dict(loss_chunk=chunk or None), seq)
        label = f"{chunk} tokens" if chunk else "off (whole logits)"
        print(f"| {label} | {seconds(rows)} | {mib(rows, 2)} | {rows[0][3]:.6f} |", flush=True)


if __name__ == "__main__":
    main()
