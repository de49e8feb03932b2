"""Greedy decoding speed under tensor parallelism, against one process, and what bounds it (2 CPU ranks over gloo).

    python benchmarks/generate.py            # the README demo's tiny Llama (hidden 128, 4 layers), 64 new tokens
    python benchmarks/generate.py --quick    # 16 new tokens

Each run decodes the same prompt with `model.generate(do_sample=False)`; ms per token is the median of
3 runs after a warm-up. At tp=2 every token costs one all-reduce per row-parallel layer (2 per decoder
layer), one for the vocab-parallel embedding and one all-gather of the last position's logits: the
script counts them on rank 0 and times a bare gloo all-reduce of one token's hidden state in the same
processes, so `collectives x latency` is the floor the figures are compared with. tp=4 on 2 cores is
oversubscribed and not timed (tests/integrations/test_generate.py checks its tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from autotp.testing.spawn import run_ranks

CONFIG = dict(
    hidden_size=128,
    intermediate_size=344,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=512,
    max_position_embeddings=256,
)


def build() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)).eval()


def ms_per_token(model: torch.nn.Module, new: int) -> float:
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm-up
    times = []
    for _ in range(3):
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        times.append((time.perf_counter() - start) / new * 1e3)
    return statistics.median(times)


def count_collectives(model: torch.nn.Module) -> int:
    """Collectives of one decoding step (rank 0 counts, every rank runs it)."""
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "all_gather_into_tensor")}

    def counting(original):
        def run(*args, **kwargs):
            calls.append(original)
            return original(*args, **kwargs)

        return run

    for name, original in originals.items():
        setattr(dist, name, counting(original))
    ids = torch.randint(0, CONFIG["vocab_size"], (1, 8), generator=torch.Generator().manual_seed(0))
    counts = []
    try:
        for new in (2, 3):  # the prefill and 1 or 2 decoding steps: the difference is one decoding step
            start = len(calls)
            model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            counts.append(len(calls) - start)
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
    return counts[1] - counts[0]


def all_reduce_ms() -> float:
    x = torch.randn(1, 1, CONFIG["hidden_size"])
    for _ in range(20):
        dist.all_reduce(x)
    start = time.perf_counter()
    for _ in range(200):
        dist.all_reduce(x)
    return (time.perf_counter() - start) / 200 * 1e3


def rank_main(rank: int, world: int, new: int, wrap: bool = True) -> dict:
    """One rank's figures; `wrap=False` is the one-process reference, in a process set up alike (one thread)."""
    import autotp

    model = autotp.wrap(build(), world) if wrap else build()
    return {"ms": ms_per_token(model, new), "collectives": count_collectives(model), "latency": all_reduce_ms()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    new = 16 if parser.parse_args().quick else 64
    one = run_ranks(rank_main, 1, new, False)[0]["ms"]
    tp1 = run_ranks(rank_main, 1, new)[0]
    tp2 = run_ranks(rank_main, 2, new)[0]
    floor = tp2["collectives"] * tp2["latency"]
    print(f"{'run':<14}{'ms/token':>10}{'tokens/s':>10}{'x one process':>15}")
    for label, ms in (("one process", one), ("tp=1", tp1["ms"]), ("tp=2", tp2["ms"])):
        print(f"{label:<14}{ms:>10.2f}{1e3 / ms:>10.1f}{ms / one:>15.2f}")
    print(
        f"tp=2: {tp2['collectives']} collectives per token x {tp2['latency']:.3f} ms (a bare gloo all-reduce of one "
        f"token's hidden state) = {floor:.2f} ms of latency alone, against a {tp2['ms']:.2f} ms step"
    )


if __name__ == "__main__":
    main()
