"""Time and peak RSS per rank of `autotp.export_weights` against the save-and-reload path (transformers'
`save_pretrained` of the one-process model, and `autotp.save_pretrained` of the wrapped one), at tp=1 and tp=2.

    python benchmarks/export.py [--layers 4] [--bucket-mib 64]

A Llama of about 0.3 B parameters (fp32; 1.2 GB). Each rank (gloo, 1 thread, forked) records the seconds and its
peak RSS above the start of each call (VmHWM reset just before; large buffers mmapped so freed ones leave RSS).
The export consumer drops each tensor, as an engine's `load_weights` does after copying it. Bound for the export:
peak <= bucket + the largest tensor.
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import torch

CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5504,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=False,
)


def rss(field: str = "VmRSS") -> int:
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field))


def measured(call) -> tuple[float, int]:
    """(seconds, peak RSS above the start) of `call()`, every rank starting together."""
    import torch.distributed as dist

    dist.barrier()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    before, start = rss(), time.perf_counter()
    call()
    return time.perf_counter() - start, rss("VmHWM") - before


def rank_main(rank: int, world: int, layers: int, bucket: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import autotp

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD fixed: a freed large buffer leaves RSS
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, num_hidden_layers=layers))
    plain = model if world == 1 else None
    if world > 1:
        model = autotp.wrap(model, world)
    out = {"largest": 0}

    def export(dtype):
        def run():
            for _, tensor in autotp.export_weights(model, dtype=dtype, bucket_bytes=bucket):
                out["largest"] = max(out["largest"], tensor.nbytes)
                del tensor

        return run

    for name, call in [("export fp32", export(None)), ("export bf16", export(torch.bfloat16))]:
        out[name] = measured(call)
    with tempfile.TemporaryDirectory() as tmp:
        out["autotp.save_pretrained"] = measured(lambda: autotp.save_pretrained(model, Path(tmp) / "a"))
        if plain is not None:
            out["transformers save_pretrained"] = measured(lambda: plain.save_pretrained(Path(tmp) / "t"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--bucket-mib", type=int, default=64)
    args = parser.parse_args()
    from autotp.testing.spawn import run_ranks

    bucket = args.bucket_mib << 20
    for world in (1, 2):
        reports = run_ranks(rank_main, world, args.layers, bucket)
        largest = reports[0]["largest"]
        print(
            f"tp={world}  bucket {bucket >> 20} MiB, largest tensor {largest / 2**20:.0f} MiB, "
            f"bound {(bucket + largest) / 2**20:.0f} MiB"
        )
        for name in [k for k in reports[0] if k != "largest"]:
            cells = "  ".join(
                f"rank {r}: {rep[name][0]:6.2f} s, peak +{rep[name][1] / 2**20:6.0f} MiB"
                for r, rep in enumerate(reports)
            )
            print(f"  {name:<30} {cells}")


if __name__ == "__main__":
    main()
