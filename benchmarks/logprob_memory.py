"""Memory of per-token log-probabilities (what GRPO, RLOO and DPO train on) at tp=2, on the 64k-vocabulary row of
`benchmarks/activation_memory.py` (the same Llama, 4 x 512 tokens, every token scored).

    python benchmarks/logprob_memory.py

Each configuration runs in 2 freshly spawned CPU ranks (gloo, 1 thread), with `MALLOC_MMAP_THRESHOLD_=131072` so
that RSS follows the live bytes. One step: per-token log-probabilities of the next tokens, `-mean` of them, backward.
- `log_softmax(logits).gather`: the model's logits, whole (vocab_parallel=False), then log_softmax and gather, as
  one process computes them without a fused head;
- TRL's fused LM head (`add_fused_lm_head`, vocab_parallel=False): the head replicated, projected in tiles;
- autotp under vocab_parallel=True: TRL's fused head replaced by autotp's (`autotp.integrations.fused_head`), the
  logits this rank's vocabulary shard only.
Reported per rank: bytes autograd saved for backward, RSS growth peak over the step, and the log-probabilities'
largest difference from the first configuration's (the same numbers).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from activation_memory import VOCAB, VOCAB_BATCH, rss, spawn_ranks  # noqa: E402

RUNS = [
    ("`log_softmax(logits).gather`, logits gathered (vocab_parallel=False)", "gather", False),
    ("TRL's fused LM head (vocab_parallel=False)", "trl", False),
    ("autotp's vocab-parallel fused head (vocab_parallel=True)", "trl", True),
]


def rank_main(rank: int, world: int, how: str, vocab_parallel: bool, port: int, out) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, LlamaConfig
    from trl.trainer.utils import add_fused_lm_head

    import autotp
    from autotp.integrations.fused_head import make_vocab_parallel
    from autotp.state import find_state
    from autotp.testing.memory import KeptForBackward

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = autotp.wrap(AutoModelForCausalLM.from_config(LlamaConfig(**VOCAB)), world, vocab_parallel=vocab_parallel)
    if how == "trl":
        add_fused_lm_head(model)
        if vocab_parallel:
            make_vocab_parallel(model, find_state(model), vars(model)["forward"], "benchmark")
    model.train()
    ids = torch.randint(0, VOCAB["vocab_size"], VOCAB_BATCH, generator=torch.Generator().manual_seed(1))
    kept = KeptForBackward(model)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    baseline = rss("VmRSS")
    with kept.hooks:
        if how == "gather":
            logits = model(input_ids=ids).logits[:, :-1]
            log_probs = logits.log_softmax(-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        else:
            log_probs = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    saved = kept.bytes()
    (-log_probs.mean()).backward()
    peak = rss("VmHWM") - baseline
    out.put((rank, saved, peak, log_probs.detach().numpy()))  # by value: the rank exits before it is read
    dist.barrier()
    dist.destroy_process_group()


def run(how: str, vocab_parallel: bool) -> list[tuple]:
    return spawn_ranks(rank_main, 2, (how, vocab_parallel), {"MALLOC_MMAP_THRESHOLD_": "131072"})


def main() -> None:
    print(
        "| per-token log-probs, Llama vocab 64k, 4 x 512 tokens, tp=2 | saved for backward (rank 0 / 1) "
        "| peak RSS growth (rank 0 / 1) | largest log-prob difference from the first row |"
    )
    print("|---|---|---|---|")
    mib = lambda rows, i: " / ".join(f"{row[i] / 2**20:.0f}" for row in rows) + " MiB"  # noqa: E731
    first = None
    for label, how, vocab_parallel in RUNS:
        rows = run(how, vocab_parallel)
        first = rows[0][3] if first is None else first
        gap = max(float(abs(row[3] - first).max()) for row in rows)
        print(f"| {label} | {mib(rows, 1)} | {mib(rows, 2)} | {gap:.1e} |", flush=True)


if __name__ == "__main__":
    main()
