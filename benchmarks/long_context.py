"""Context parallelism on CPU: activation memory per rank and step time at cp = 1, 2, 4 for the same global sequence.

    python benchmarks/long_context.py            # lengths 1024, 2048, 4096
    python benchmarks/long_context.py 2048 8192  # other lengths

A tiny Llama (hidden 64, 2 layers, 8 heads, 2 KV heads, vocab 256, sdpa) reads one sequence of S tokens. Each cp
runs in cp freshly forked CPU ranks (gloo, 1 thread each) wrapped with `autotp.wrap(model, 1, cp_size=cp)`. A rank
reports the bytes autograd saved for the backward and still holds when the forward ends (`autotp.testing.memory`:
every saved tensor's storage once, parameters excluded), and the mean time of 3 steps (forward, backward,
`allreduce_gradients`) after a warm-up. The longest sequence that fits 4 GiB per rank is extrapolated from the
measured bytes with a fit a + b S per cp: what autograd holds is linear in S, since the attention (and its
[S/cp, S] mask, built in blocks of at most `context_kernels.MASK_ELEMENTS` entries) is recomputed in backward.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers as tf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import autotp  # noqa: E402
from autotp.testing.memory import KeptForBackward  # noqa: E402
from autotp.testing.spawn import run_ranks  # noqa: E402

CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=1 << 20,
)
BUDGET = 4 << 30


def rank_run(rank: int, world: int, seq: int) -> dict:
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**CONFIG))
    model.set_attn_implementation("sdpa")
    model = autotp.wrap(model, 1, cp_size=world)
    ids = torch.randint(0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    kept = KeptForBackward(model)
    with kept.hooks:
        loss = model(input_ids=ids, labels=ids).loss
    held = kept.bytes()
    loss.backward()
    autotp.allreduce_gradients(model)
    model.zero_grad()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        autotp.allreduce_gradients(model)
        times.append(time.perf_counter() - start)
        model.zero_grad()
    return {"held": held, "step": sum(times) / len(times)}


def main(lengths: list[int]) -> None:
    results: dict[int, dict[int, dict]] = {}
    for cp in (1, 2, 4):
        for seq in lengths:
            reports = run_ranks(rank_run, cp, seq)
            results.setdefault(cp, {})[seq] = {
                "held": max(r["held"] for r in reports),
                "step": max(r["step"] for r in reports),
            }
    print(f"{'seq':>6} {'cp':>3} {'held per rank':>14} {'vs cp 1':>8} {'step s':>8} {'vs cp 1':>8}")
    for seq in lengths:
        base = results[1][seq]
        for cp in (1, 2, 4):
            r = results[cp][seq]
            print(
                f"{seq:>6} {cp:>3} {r['held'] / 2**20:>11.1f} MiB {r['held'] / base['held']:>7.2f}x "
                f"{r['step']:>8.3f} {r['step'] / base['step']:>7.2f}x"
            )
    print(
        f"longest sequence whose held activations fit {BUDGET >> 30} GiB per rank (a + b S fitted; they are linear "
        f"in S: the [S/cp, S] masks are built per layer and recomputed, never held):"
    )
    for cp in (1, 2, 4):
        seqs = np.array(lengths, dtype=float)
        held = np.array([results[cp][s]["held"] for s in lengths], dtype=float)
        b, a = np.polyfit(seqs, held, 1)
        print(f"  cp {cp}: ~{int((BUDGET - a) / b):,} tokens")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1024, 2048, 4096])
