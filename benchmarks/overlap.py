"""Where the backward's all-reduce time goes, with and without overlap (tp=2, 2 CPU ranks, rank 0's timings).

    python benchmarks/overlap.py

The same Llama-style model and batch as peers.py (hidden 512, 4 layers, batch 4 x 128, fp32). Each
step's `loss.backward()` is timed, and inside it: with overlap, the weight-gradient matmuls a block
entry runs while its all-reduce is in flight and the wait after them; without, the time blocked in the
synchronous all-reduces. Medians of 6 steps after 2 warm-up.

Then `torch.profiler` records one backward on rank 0 each way: gloo runs each all-reduce on its own
thread (`gloo:all_reduce` events), and the `aten::mm` time on the main thread inside those intervals
is what ran while the collective was in flight. The Chrome traces are written next to the system's
temporary files (open them in chrome://tracing or Perfetto).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from autotp.testing.spawn import run_ranks
from autotp.tp.overlap import DeferredWeights

CONFIG = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=8000,
    tie_word_embeddings=False,
)


class _Timed:
    """An async all-reduce's handle that times its wait."""

    def __init__(self, work, log: list) -> None:
        self.work, self.log = work, log

    def wait(self) -> None:
        start = time.perf_counter()
        self.work.wait()
        self.log.append(("wait", time.perf_counter() - start))


def rank_main(rank: int, world: int, overlap: bool) -> list[float]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    import autotp

    torch.manual_seed(0)
    model = autotp.wrap(AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)), world, overlap=overlap)
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(1))
    log: list = []
    reduce, grads = dist.all_reduce, DeferredWeights.grads

    def timed_reduce(tensor, *args, async_op=False, **kwargs):
        if async_op:
            return _Timed(reduce(tensor, *args, async_op=True, **kwargs), log)
        start = time.perf_counter()
        out = reduce(tensor, *args, **kwargs)
        log.append(("blocked", time.perf_counter() - start))
        return out

    def timed_grads(self):
        start = time.perf_counter()
        out = grads(self)
        log.append(("matmuls", time.perf_counter() - start))
        return out

    dist.all_reduce, DeferredWeights.grads = timed_reduce, timed_grads
    steps = []
    try:
        for step in range(8):
            loss = model(input_ids=ids, labels=ids).loss
            log.clear()  # the backward's events only
            start = time.perf_counter()
            loss.backward()
            backward = time.perf_counter() - start
            model.zero_grad()
            if step >= 2:
                steps.append(
                    [backward] + [sum(t for kind, t in log if kind == k) for k in ("matmuls", "wait", "blocked")]
                )
    finally:
        dist.all_reduce, DeferredWeights.grads = reduce, grads
    return [statistics.median(column) for column in zip(*steps)]


def traced(rank: int, world: int, overlap: bool) -> dict | None:
    """One profiled backward: the all-reduces on gloo's threads and the main thread's matmuls inside them."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM, LlamaConfig

    import autotp

    torch.manual_seed(0)
    model = autotp.wrap(AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG)), world, overlap=overlap)
    ids = torch.randint(0, CONFIG["vocab_size"], (4, 128), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    loss = model(input_ids=ids, labels=ids).loss
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    if rank:
        return None
    path = Path(tempfile.gettempdir()) / f"autotp-backward-overlap-{overlap}.json"
    prof.export_chrome_trace(str(path))
    events = [(e.name, e.thread, e.time_range.start, e.time_range.end) for e in prof.events()]
    reduces = [(start, end) for name, _, start, end in events if name == "gloo:all_reduce"]
    main_thread = next(thread for name, thread, *_ in events if name.startswith("aten::mm"))
    inside = sum(
        max(0.0, min(end, r_end) - max(start, r_start))
        for name, thread, start, end in events
        if name == "aten::mm" and thread == main_thread
        for r_start, r_end in reduces
    )
    return {
        "reduces": len(reduces),
        "reduce_ms": sum(e - s for s, e in reduces) / 1e3,
        "mm_inside_ms": inside / 1e3,
        "trace": str(path),
    }


def main() -> None:
    for overlap in (False, True):
        backward, matmuls, wait, blocked = run_ranks(rank_main, 2, overlap)[0]
        print(
            f"overlap={overlap}: backward {backward * 1e3:.1f} ms; weight-gradient matmuls while all-reduces run "
            f"{matmuls * 1e3:.1f} ms, then waiting {wait * 1e3:.1f} ms; blocked in synchronous all-reduces "
            f"{blocked * 1e3:.1f} ms"
        )
    for overlap in (False, True):
        trace = run_ranks(traced, 2, overlap)[0]
        print(
            f"torch.profiler, overlap={overlap}: {trace['reduces']} gloo:all_reduce in the backward, "
            f"{trace['reduce_ms']:.1f} ms in all; aten::mm on the main thread inside them {trace['mm_inside_ms']:.1f} "
            f"ms; trace {trace['trace']}"
        )


if __name__ == "__main__":
    main()
