"""Does gathering logits lazily cost a training step that reads only its loss? tp=2, 2 CPU ranks.

A vocab-parallel training forward returns its output with the logits gathered on first read (a class swap and a
closure per forward). This times the step that never reads them, on the activation benchmark's 64k-vocabulary row,
against the old gate that returned this rank's shard (patched in, per run), alternating three times in one run:
the median of 6 steps after 2 warm-up steps, the slower rank's.

    python benchmarks/lazy_logits.py      # prints both lists of step times and the ratio of their medians
"""

from __future__ import annotations

import json
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import autotp
from autotp.testing.spawn import run_ranks

CONFIG = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=65536,
)  # benchmarks/activation_memory.py's VOCAB row
BATCH = (4, 512)


def median_step(rank: int, world: int, lazy: bool) -> float:
    if not lazy:  # the old gate: the output keeps this rank's logit shard
        import autotp.vocab.layers as vocab

        vocab.lazy_logits = lambda output, gather: output
    torch.manual_seed(0)
    model = autotp.wrap(AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **CONFIG)), world)
    ids = torch.randint(0, CONFIG["vocab_size"], BATCH, generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    times = []
    for _ in range(8):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return sorted(times[2:])[3]


def main() -> None:
    out: dict = {"lazy": [], "shard": []}
    for _ in range(3):
        for lazy in (True, False):
            out["lazy" if lazy else "shard"].append(round(max(run_ranks(median_step, 2, lazy)), 3))
    out["ratio lazy / shard"] = round(sorted(out["lazy"])[1] / sorted(out["shard"])[1], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
