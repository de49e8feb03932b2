"""autotp on one GPU, in one run: its cost at tp=1, LoRA on an 8B shape, one tp=8 rank's compute, context
parallelism's variable-length path, and the `gpu` tests.

    PYTHONPATH=. timeout 560 python benchmarks/gpu.py --pytest --pytest-budget 100 --out $OUT/gpu.jsonl  # b, f, g
    PYTHONPATH=. timeout 590 python benchmarks/gpu.py --sections acde --pytest --out $OUT/gpu.jsonl  # the first run's
    PYTHONPATH=. timeout 200 python benchmarks/gpu.py --sections h --out $OUT/gpu-h.jsonl  # h: one pipeline stage
    python benchmarks/gpu.py --smoke --out /tmp/gpu.jsonl        # tiny sizes on CPU, seconds (tests run this)
    python benchmarks/gpu.py --table-from gpu.jsonl              # the docs table of a (possibly cut-off) run

Every figure is appended to --out as one JSON line the moment it is measured, so a run cut off keeps what it had;
every line names torch, transformers, PEFT and the GPU. The table for docs/performance.md ("On a GPU") is
rewritten next to it (same name, .md) after each section. Each section runs under its own time budget; one that
fails (out of memory, a piece torch 2.11 lacks) is written as an "error" line naming the exception, one past its
budget as a "timeout" line, and the run goes on. Models are Llama configs with random weights (no downloads).

(a) Cost at tp=1: `autotp.wrap(model, 1)` against the plain transformers model, Llama-3.2-1B shape, 4 x 2048
    tokens, full fine-tuning with AdamW, eager and with each decoder layer compiled (`layer.compile()`, as
    torchtitan compiles per block). Goal: the wrapped model at >= 0.97x plain tokens/s.
(b) LoRA (r 8, alpha 32, all seven projections) on the Llama-3-8B shape, micro-batch 2 x 4096, SDPA (its
    dispatcher picks the flash backend: bf16, no mask): PEFT alone, then PEFT under `autotp.wrap(model, 1)`, each
    in a process of its own, so each peak is its own (the first GPU run measured 73.7 GiB under autotp against 29.1
    for PEFT alone, both runs in one process, unexplained and not reproduced on CPU), with the memory of one more step by phase (held, forward peak, kept for the backward, backward
    peak), beside NeMo Automodel's 12,473 tok/s on one H100. Automodel differs: Transformer Engine layers and triton
    kernels, 16 micro-batches per optimizer step. If a run does not fit without activation checkpointing it is
    retried with it (the line says so; the FLOPs stay the model's, recomputation not counted).
(c) One rank of tp=8 on the 8B shape (1 x 8192 tokens, AdamW), on torch's fake process group: collectives
    return at once, so this is the per-rank compute of the sharded GEMMs, an upper bound on what a real tp=8 run
    keeps once its collectives are added. Beside torchtitan's 8B on 8 x H100 (FSDP, seq 8192): 5,762 tok/s/GPU
    eager, 6,667 compiled.
(d) Context parallelism's variable-length (flash) branch at cp=2: 2 ranks on this GPU over gloo, fp32, packed
    documents, one forward and backward against one process's SDPA (loss and every gradient). flash-attn is not
    installed there, so the variable-length function is `autotp.testing.varlen.varlen_reference`, one SDPA call
    per packed segment; the line says so.
(e) Expert parallelism: skipped; the fake process group carries no token counts, which EP's dispatch exchanges.
(f) (b)'s LoRA with each decoder layer compiled, activation checkpointing only if a run does not fit without:
    under autotp (its loss chunked by default: the logits are never whole), then PEFT alone; each in its own
    process, beside Automodel's 12,473 tok/s.
(g) Float8 through torchao (`convert_to_float8_training`, tensorwise and rowwise, the head kept in bf16) against
    bf16, full fine-tuning with AdamW, each run in its own process: the 1B shape at tp=1, each layer compiled; then
    one tp=8 rank of the 70B shape on the fake process group, 8 of its 80 layers (per-layer compute; the ratio to
    bf16 is the figure), eager. Skipped where torchao is not installed.
(h) One pipeline stage's compute: the last stage of pp 4 x tp 8 on the 70B shape (19 of its 80 layers, the final
    norm, the head and the loss), one tp=8 rank on the fake process group. A step is what that rank computes in a
    1F1B step: 8 micro-batches of 1 x 4096 tokens, each its forward and backward, then AdamW; the sends between
    stages, the collectives and the bubble cost nothing, so this is an upper bound. Beside it what a pipeline of
    4 such stages would give per GPU at 1F1B's bubble, (P - 1) / (M + P - 1). torch's schedule itself does not run
    on the fake group (its receives would read the fake backend's garbage shapes), so the micro-batches are driven
    here, as the stage's own forward and backward.
--pytest: `python -m pytest -m gpu tests` under --pytest-budget seconds; each test's outcome is a line.

FLOPs per token (MFU = achieved / the card's bf16 dense peak: 989 TFLOP/s for H100 SXM and H200, 756 for H100
PCIe; none on other cards): full fine-tuning 6N + 6LSHD, N the matmul weights (LM head included, the embedding
lookup not), attention causal (half the 12LSHD torchtitan counts). LoRA: 4N (the frozen base runs no
weight-gradient GEMMs) + 6LSHD + 6r(in + out) per adapter. Weights, gradients and AdamW's state are bf16.

The project's GPU machine (one H100 or H200, torch 2.11, transformers 5.17, Python 3.12, no network): autotp wants
torch >= 2.13 and transformers >= 5.19. Bring the tested wheels (constraints.txt's versions) from a machine with
network, and keep torch 2.11:

    pip download --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 --no-deps -d wheels \\
        -c constraints.txt transformers peft accelerate safetensors tokenizers huggingface_hub hf-xet httpx2 \\
        httpcore2 typer pytest pytest-timeout pluggy iniconfig torchao

then there `pip install --no-deps wheels/*.whl` and run from the checkout with PYTHONPATH=. (`pip install --no-deps
-e .` would fetch setuptools for its isolated build; `--no-build-isolation` works where setuptools is installed).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import importlib.metadata
import json
import multiprocessing
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=True,
)
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
LLAMA_70B_LAYERS = dict(  # the 70B shape with 8 of its 80 layers: one tp=8 rank's per-layer compute, in memory
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=8,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    tie_word_embeddings=False,
)
LLAMA_70B_STAGE = dict(LLAMA_70B_LAYERS, num_hidden_layers=19)  # (h): pp 4 cuts 80 layers at (0, 20, 40, 61, 80)
CP_MODEL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    tie_word_embeddings=False,
)
TINY = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=512,
    tie_word_embeddings=False,
)

LORA = dict(
    r=8,
    lora_alpha=32,
    lora_dropout=0.0,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
)
PEAKS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100", 989.0))  # bf16 dense TFLOP/s per GPU, first match by name
GOAL_A = 0.97
AUTOMODEL_LORA_8B = 12473  # tok/s, 1 x H100, Llama3-8B LoRA, bf16, seq 4096, MBS 2 (Automodel's performance page)
TORCHTITAN_8B = {"eager": 5762, "compiled": 6667}  # tok/s/GPU, 8 x H100, FSDP, seq 8192 (torchtitan's benchmarks)
VARLEN = "varlen_sdpa"  # the name the SDPA-backed variable-length function is registered under ("varlen": flash kind)
TP_C = 8
PP_H = 4


@dataclass(frozen=True)
class Sizes:
    """What each section runs: the full run for one H100, or tiny shapes for the CPU smoke test."""

    small: dict  # (a)
    large: dict  # (b), (c), (f)
    cp: dict  # (d)
    big: dict  # (g)'s tp=8 rank
    names: tuple[str, str, str]  # of small, large and big, for the lines
    a: tuple[int, int]  # (batch, seq)
    b: tuple[int, int]
    c: tuple[int, int]
    d: tuple[int, int]
    warmup: int
    steps: int
    budget: dict  # seconds per section
    compile: bool
    stage: dict  # (h)'s stage
    h: tuple[int, int, int]  # (micro-batches, rows, seq)


FULL = Sizes(
    LLAMA_1B,
    LLAMA_8B,
    CP_MODEL,
    LLAMA_70B_LAYERS,
    ("Llama-1B shape", "Llama-3-8B shape", f"Llama-3-70B shape ({LLAMA_70B_LAYERS['num_hidden_layers']} of 80 layers)"),
    (4, 2048),
    (2, 4096),
    (1, 8192),
    (2, 4096),
    3,
    8,
    {"a": 130, "b": 90, "c": 50, "d": 40, "e": 5, "f": 160, "g": 170, "h": 90},
    True,
    LLAMA_70B_STAGE,
    (8, 1, 4096),
)
SMOKE = Sizes(
    TINY,
    TINY,
    TINY,
    TINY,
    ("tiny Llama", "tiny Llama", "tiny Llama"),
    (2, 64),
    (2, 64),
    (1, 64),
    (2, 64),
    1,
    2,
    {"a": 30, "b": 60, "c": 30, "d": 30, "e": 5, "f": 60, "g": 90, "h": 30},
    False,
    TINY,
    (2, 1, 64),
)


# --- recording ----------------------------------------------------------------------------------------------------


def environment(device: torch.device) -> dict[str, Any]:
    """What every line carries: versions, the device and the peak MFU is taken against."""

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "(not installed)"

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    try:
        commit = (
            subprocess.run(
                ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
            ).stdout.strip()
            or None
        )
    except OSError:  # no git there
        commit = None
    return {
        "torch": torch.__version__,
        "transformers": version("transformers"),
        "peft": version("peft"),
        "accelerate": version("accelerate"),
        "python": platform.python_version(),
        "gpu": gpu,
        "device": str(device),
        "cuda": torch.version.cuda,
        "peak_tflops": peak_tflops(gpu),
        "commit": commit,
    }


def peak_tflops(gpu: str) -> float | None:
    return next((peak for name, peak in PEAKS if name in gpu), None)


class Recorder:
    """Appends each record to the JSON-lines file as soon as it exists (flushed and synced), and prints it."""

    def __init__(self, path: Path, env: dict[str, Any]):
        self.path, self.env, self.records = path, env, []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def write(self, section: str, kind: str, run: str = "", **fields: Any) -> dict[str, Any]:
        record = {"section": section, "kind": kind, "run": run, **fields, **self.env}
        with self.path.open("a") as out:
            out.write(json.dumps(record) + "\n")
            out.flush()
            os.fsync(out.fileno())
        self.records.append(record)
        print(describe(record), flush=True)
        return record

    def table(self) -> None:
        self.path.with_suffix(".md").write_text(table(self.records))


def describe(record: dict[str, Any]) -> str:
    figures = "".join(
        f", {label} {record[key]}"
        for key, label in (("tokens_per_s_per_gpu", "tok/s/GPU"), ("mfu", "MFU"), ("step_s", "s/step"))
        if record.get(key) is not None
    )
    said = record["reason"] if "reason" in record else note(record)
    return f"[{record['section']}] {record['kind']}: {record['run']}{figures}; {said}".rstrip("; ")


def note(record: dict[str, Any]) -> str:
    """A line's last column: what the figure stands beside, a test's outcome, or why nothing was measured."""
    if record["kind"] == "figure":
        return record.get("beside", "")
    if record["kind"] == "test":
        return record["outcome"]
    return f"{record['kind']}: {record.get('reason', '')}"


def table(records: list[dict[str, Any]]) -> str:
    """The docs/performance.md table of a run's records."""
    if not records:
        return ""
    env = records[0]
    peak = f"peak {env['peak_tflops']:g} TFLOP/s bf16" if env["peak_tflops"] else "peak unknown: no MFU"
    lines = [
        f"torch {env['torch']}, transformers {env['transformers']}, PEFT {env['peft']}, {env['gpu']} ({peak}), "
        f"commit {env['commit']}",
        "",
        "| section | run | tokens/s per GPU | MFU | beside |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        if r["kind"] == "env":
            continue
        rate = f"{r['tokens_per_s_per_gpu']:,.0f}" if r.get("tokens_per_s_per_gpu") is not None else ""
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else ""
        lines.append(f"| {r['section']} | {r['run']} | {rate} | {mfu} | {note(r)} |".replace("\n", " "))
    counted = {r["section"]: r for r in records if r.get("flops")}
    lines += [""] + [
        f"- ({section}) FLOPs per token: {r['flops']} = {r['flops_per_token'] / 1e9:.4g} GFLOP"
        for section, r in counted.items()
    ]
    return "\n".join(lines).rstrip() + "\n"


# --- time guards ----------------------------------------------------------------------------------------------------


class SectionTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise SectionTimeout in the main thread once `seconds` pass (checked between Python bytecodes, so a CUDA
    call or a compile in progress finishes first)."""

    def expire(signum: int, frame: Any) -> None:
        raise SectionTimeout(f"past its budget of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_section(
    rec: Recorder, section: str, fn: Callable[[Recorder, Sizes, torch.device], None], sizes: Sizes, device: torch.device
) -> None:
    """One section under its time budget; a failure is written as a line naming it, and the run goes on."""
    start = time.perf_counter()
    try:
        with time_limit(sizes.budget[section]):
            fn(rec, sizes, device)
    except SectionTimeout as err:
        rec.write(section, "timeout", reason=str(err))
    except Exception as err:  # noqa: BLE001 - named in the output, then the next section
        rec.write(
            section, "error", reason=f"{type(err).__name__}: {err}"[:2000], traceback=traceback.format_exc()[-4000:]
        )
    finally:
        free()
        if torch.distributed.is_initialized():  # (c)'s fake group, if the section stopped inside it
            torch.distributed.destroy_process_group()
    print(f"[{section}] {time.perf_counter() - start:.0f} s", flush=True)
    rec.table()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# --- models, FLOPs, timing -----------------------------------------------------------------------------------------


def build(config: dict, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A Llama from `config` with random weights (seed 0), made on `device` in `dtype`, SDPA attention, and no KV
    cache (transformers' default would fill one in every training forward)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(**config, use_cache=False), dtype=dtype, attn_implementation="sdpa"
        )
    return model.train()


def tokens(config: dict, batch: int, seq: int, device: torch.device) -> torch.Tensor:
    return torch.randint(0, config["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(1)).to(device)


def adamw(params: Any, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-5, fused=device.type == "cuda" or None)


def projections(config: dict) -> list[tuple[int, int]]:
    """(in, out) of one decoder layer's seven linears: q, k, v, o, gate, up, down."""
    h, f = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return [(h, q), (h, kv), (h, kv), (q, h), (h, f), (h, f), (f, h)]


def matmul_weights(config: dict) -> int:
    """N: the weights every token multiplies, the LM head included (tied or not); the embedding is a lookup."""
    return (
        config["num_hidden_layers"] * sum(i * o for i, o in projections(config))
        + config["vocab_size"] * config["hidden_size"]
    )


def attention_flops(config: dict, seq: int) -> int:
    """Per token, forward and backward: QK^T and PV are 4SHD per layer in the forward (HD the query width), half
    under the causal mask, times 3 with the backward."""
    query_width = projections(config)[0][1]
    return 6 * config["num_hidden_layers"] * seq * query_width


def full_flops(config: dict, seq: int) -> tuple[int, str]:
    n = matmul_weights(config)
    return 6 * n + attention_flops(config, seq), f"6N + 6LSHD, N = {n:.4g} (causal attention)"


def lora_flops(config: dict, seq: int, rank: int) -> tuple[int, str]:
    n = matmul_weights(config)
    adapters = 6 * rank * config["num_hidden_layers"] * sum(i + o for i, o in projections(config))
    return (
        4 * n + attention_flops(config, seq) + adapters,
        f"4N + 6LSHD + 6r(in + out) per adapter, N = {n:.4g} (frozen base: no weight-gradient GEMMs)",
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(
    model: torch.nn.Module,
    ids: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    sizes: Sizes,
    device: torch.device,
    rows: int | None = None,
) -> list[float]:
    """Seconds of each training step (forward, backward, optimizer) after the warm-up ones; with `rows`, the batch's
    forward and backward run one micro-batch of `rows` rows at a time, as a pipeline stage runs them."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(sizes.warmup + sizes.steps):
        start = time.perf_counter()
        for chunk in ids.split(rows or len(ids)):
            model(input_ids=chunk, labels=chunk).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if step >= sizes.warmup:
            times.append(time.perf_counter() - start)
    return times


def figure(
    rec: Recorder,
    section: str,
    run: str,
    times: list[float],
    ids: torch.Tensor,
    flops: tuple[int, str],
    ranks: int = 1,
    peak: float | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Write a throughput line: the median step, tokens/s per GPU (a TP group's tokens shared by its `ranks`), the
    FLOPs per token stated, TFLOP/s per GPU and MFU against the card's peak; the peak memory this process saw, or
    `peak` (GiB) measured in a child process."""
    step = statistics.median(times)
    per_gpu = ids.numel() / step / ranks
    achieved = per_gpu * flops[0] / 1e12
    card = rec.env["peak_tflops"]
    memory = (
        peak if peak is not None else torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    )
    return rec.write(
        section,
        "figure",
        run,
        tokens_per_s_per_gpu=round(per_gpu, 1),
        step_s=round(step, 4),
        step_s_range=[round(min(times), 4), round(max(times), 4)],
        steps=len(times),
        tokens_per_step=ids.numel(),
        batch=list(ids.shape),
        flops_per_token=flops[0],
        flops=flops[1],
        tflops_per_gpu=round(achieved, 1),
        mfu=round(achieved / card, 4) if card else None,
        peak_memory_gib=memory and round(memory, 1),
        **fields,
    )


# --- the sections --------------------------------------------------------------------------------------------------


def section_a(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    """autotp.wrap(model, 1) against the plain model: full fine-tuning, eager then per-layer compiled."""
    import autotp

    batch, seq = sizes.a
    ids, flops = tokens(sizes.small, batch, seq, device), full_flops(sizes.small, seq)
    models = {
        "plain transformers": build(sizes.small, device),
        "autotp.wrap(model, 1)": autotp.wrap(build(sizes.small, device), 1),
    }
    optimizers = {name: adamw(model.parameters(), device) for name, model in models.items()}
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            if not sizes.compile:
                rec.write("a", "skip", "compiled", reason="--smoke does not compile (minutes on a CPU)")
                return
            for model in models.values():
                for layer in model.model.layers:
                    layer.compile()
        plain = None
        for name, model in models.items():
            times = step_times(model, ids, optimizers[name], sizes, device)
            extra = {}
            if plain is not None:
                ratio = statistics.median(plain) / statistics.median(times)
                extra = {
                    "ratio_to_plain": round(ratio, 4),
                    "goal": GOAL_A,
                    "met": ratio >= GOAL_A,
                    "beside": f"{ratio:.3f}x plain (goal {GOAL_A})",
                }
            figure(rec, "a", f"{mode}, {name}, {sizes.names[0]}, {batch} x {seq}, AdamW", times, ids, flops, **extra)
            plain = plain or times


def fitting_step_times(
    model: torch.nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer, sizes: Sizes, device: torch.device
) -> tuple[list[float], bool]:
    """step_times, retried with activation checkpointing if the activations do not fit; (times, checkpointed)."""
    try:
        return step_times(model, ids, optimizer, sizes, device), False
    except torch.OutOfMemoryError:
        pass  # out of the except block: its traceback, and the activations its frames hold, are gone
    optimizer.zero_grad(set_to_none=True)
    free()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return step_times(model, ids, optimizer, sizes, device), True


def section_c(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    """One tp=8 rank of the 8B shape on the fake process group: the sharded GEMMs' compute, collectives free."""
    import autotp
    from autotp.compat.torch import init_fake_process_group

    batch, seq = sizes.c
    ids, flops = tokens(sizes.large, batch, seq, device), full_flops(sizes.large, seq)
    init_fake_process_group(TP_C)
    model = autotp.wrap(build(sizes.large, device), TP_C, timeout=timedelta(minutes=5))
    optimizer = adamw(model.parameters(), device)
    times = step_times(model, ids, optimizer, sizes, device)
    rate = ids.numel() / statistics.median(times) / TP_C
    figure(
        rec,
        "c",
        f"one rank of tp={TP_C}, fake process group, {sizes.names[1]}, {batch} x {seq}, AdamW, eager",
        times,
        ids,
        flops,
        ranks=TP_C,
        upper_bound=True,
        beside=f"upper bound (collectives cost nothing here); torchtitan 8B FSDP 8 x H100: "
        f"{TORCHTITAN_8B['eager']:,} eager ({rate / TORCHTITAN_8B['eager']:.2f}x), "
        f"{TORCHTITAN_8B['compiled']:,} compiled",
    )
    del model, optimizer
    torch.distributed.destroy_process_group()


def section_d(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    """cp=2's variable-length branch on 2 ranks of this device against one process's SDPA."""
    import importlib.util

    from autotp.testing import GRAD_RTOL, LOSS_ATOL
    from autotp.testing.spawn import run_ranks

    batch, seq = sizes.d
    reports = run_ranks(cp_varlen_check, 2, sizes.cp, batch, seq, device.type)
    loss, grad = max(r["loss"] for r in reports), max(r["grad"] for r in reports)
    passed = loss <= LOSS_ATOL and grad <= GRAD_RTOL
    flash = "installed (not used)" if importlib.util.find_spec("flash_attn") else "not installed"
    rec.write(
        "d",
        "figure",
        f"cp=2 variable-length branch, 2 ranks on one {device.type} over gloo, fp32, packed documents, {batch} x {seq}",
        attention="autotp.testing.varlen.varlen_reference: one "
        f"torch SDPA call per packed segment (flash-attn {flash})",
        loss_diff=loss,
        grad_error=grad,
        tolerances={"loss": LOSS_ATOL, "grad": GRAD_RTOL},
        passed=passed,
        devices=reports[0]["devices"],
        beside=f"{'matches' if passed else 'DIFFERS FROM'} one process's SDPA: loss {loss:.1e}, gradients "
        f"{grad:.1e} (fp32 tolerances {LOSS_ATOL:g}, {GRAD_RTOL:g}); SDPA per segment ran, not flash",
    )


def cp_varlen_check(rank: int, world: int, config: dict, batch: int, seq: int, device_type: str) -> dict[str, Any]:
    """Runs on each CP rank: a one-process SDPA model and its copy at cp=world through the variable-length function,
    one forward and backward on the same packed batch; the loss difference and the worst gradient error."""
    import transformers as tf

    import autotp
    from autotp.testing import grad_error
    from autotp.testing.varlen import varlen_reference

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    reference = build(config, device, torch.float32)
    model = copy.deepcopy(reference)
    tf.AttentionInterface.register(VARLEN, varlen_reference)
    model.set_attn_implementation(VARLEN)
    model = autotp.wrap(model, 1, cp_size=world)
    ids = tokens(config, batch, seq, device)
    lengths = [[seq // 8, seq // 2, seq - seq // 8 - seq // 2], [seq // 3, seq - seq // 3]]
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths[row % 2]]) for row in range(batch)])
    inputs = {"input_ids": ids, "labels": ids, "position_ids": positions.to(device), "use_cache": False}
    ref_loss = reference(**inputs).loss
    ref_loss.backward()
    loss = model(**inputs).loss
    loss.backward()
    autotp.allreduce_gradients(model)
    expected = dict(reference.named_parameters())
    worst = max(grad_error(p.grad, expected[name].grad) for name, p in model.named_parameters())
    return {
        "loss": abs(loss.item() - ref_loss.item()),
        "grad": worst,
        "devices": sorted({str(p.device) for p in model.parameters()}),
    }


def section_e(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    rec.write(
        "e",
        "skip",
        "expert parallelism",
        reason="not measured: EP's dispatch sends each rank's token counts "
        "over an all-to-all before the tokens, and the fake process group moves no data, so one rank alone "
        "cannot stand for an EP rank's step; it needs real ranks (benchmarks/moe.py on CPU)",
    )


# --- sections run in child processes, so each run's peak memory is its own -----------------------------------------


def in_child(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    """fn(*args) in a fresh spawned process: its allocator, compile caches and peak memory are its own, as a user's
    script's would be. Its result, or its exception (with the child's traceback) raised here; the child is killed if
    this one is stopped (a section past its budget)."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    proc = context.Process(target=_child, args=(send, fn, args))
    proc.start()
    send.close()
    try:
        while not receive.poll(1.0):
            if not proc.is_alive():
                raise ChildError(f"{fn.__name__}: its child process ended with code {proc.exitcode} and no result")
        ok, value = receive.recv()
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
    if not ok:
        raise ChildError(value)
    return value


class ChildError(RuntimeError):
    """A run that failed in its child process: the child's last line as the message, its traceback kept."""

    def __init__(self, traceback_text: str):
        super().__init__(traceback_text.strip().splitlines()[-1])
        self.traceback = traceback_text


def _child(send: Any, fn: Callable[..., dict[str, Any]], args: tuple) -> None:
    try:
        send.send((True, fn(*args)))
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        send.send((False, traceback.format_exc()[-3000:]))


def gib(value: int | None) -> float | None:
    """GiB, or None where nothing was measured (a CPU run: torch counts no CPU allocations)."""
    return None if value is None else round(value / 2**30, 2)


def memory_phases(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> dict[str, float]:
    """One more step's memory by phase (GiB): held before it (weights, optimizer state), peak during the forward,
    held after it (what the backward keeps: activations, logits), peak during the backward."""
    if device.type != "cuda":
        return {}
    sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss = model(input_ids=ids, labels=ids).loss
    sync(device)
    forward_peak, held = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    loss.backward()
    sync(device)
    backward_peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return {
        "held_before_step": gib(before),
        "forward_peak": gib(forward_peak),
        "held_for_backward": gib(held - before),
        "backward_peak": gib(backward_peak),
    }


def child_device(device_type: str) -> torch.device:
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def lora_run(sizes: Sizes, device_type: str, wrapped: bool, compiled: bool) -> dict[str, Any]:
    """One child's LoRA run on the 8B shape: PEFT alone or under autotp.wrap(model, 1) (whose loss is chunked by
    default where that is exact), eager or with each decoder layer compiled; step times and memory by phase."""
    from peft import LoraConfig, get_peft_model

    import autotp

    device = child_device(device_type)
    batch, seq = sizes.b
    ids = tokens(sizes.large, batch, seq, device)
    model = get_peft_model(build(sizes.large, device), LoraConfig(**LORA))
    cuda = device.type == "cuda"
    built = torch.cuda.memory_allocated(device) if cuda else None
    if wrapped:
        autotp.wrap(model.base_model.model, 1)
    if compiled and sizes.compile:
        for layer in model.base_model.model.model.layers:
            layer.compile()
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], device)
    times, checkpointing = fitting_step_times(model, ids, optimizer, sizes, device)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    return {
        "times": times,
        "checkpointing": checkpointing,
        "memory": {"after_build": gib(built), "step_peak": gib(peak), **memory_phases(model, ids, device)},
    }


def lora_figure(rec: Recorder, section: str, sizes: Sizes, device: torch.device, wrapped: bool, compiled: bool) -> None:
    """lora_run in its own process, written as one line beside Automodel's rate."""
    batch, seq = sizes.b
    ids, flops = tokens(sizes.large, batch, seq, torch.device("cpu")), lora_flops(sizes.large, seq, LORA["r"])
    result = in_child(lora_run, sizes, device.type, wrapped, compiled)
    mode = "compiled per layer" if compiled and sizes.compile else "eager"
    name = "PEFT LoRA under autotp.wrap(model, 1)" if wrapped else "PEFT LoRA"
    rate = ids.numel() / statistics.median(result["times"])
    memory = result["memory"]
    figure(
        rec,
        section,
        f"{name}, {mode}, own process, {sizes.names[1]}, {batch} x {seq}, r {LORA['r']}, SDPA",
        result["times"],
        ids,
        flops,
        peak=memory["step_peak"],
        memory_gib=memory,
        activation_checkpointing=result["checkpointing"],
        ratio_to_automodel=round(rate / AUTOMODEL_LORA_8B, 4),
        beside=f"{rate / AUTOMODEL_LORA_8B:.2f}x Automodel's {AUTOMODEL_LORA_8B:,}"
        + (f"; peak {memory['step_peak']} GiB" if memory["step_peak"] is not None else "")
        + (
            f" (held {memory['held_before_step']}, forward peak {memory['forward_peak']}, kept for the backward "
            f"{memory['held_for_backward']}, backward peak {memory['backward_peak']})"
            if "forward_peak" in memory
            else ""
        )
        + ("; activation checkpointing (did not fit without)" if result["checkpointing"] else ""),
    )


def section_b(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    """LoRA on the 8B shape, eager: PEFT alone, then PEFT under autotp.wrap(model, 1), each in its own process."""
    for wrapped in (False, True):
        lora_figure(rec, "b", sizes, device, wrapped, compiled=False)


def section_f(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    """LoRA on the 8B shape, each layer compiled, activation checkpointing only if it does not fit: under autotp
    (chunked loss) first, then PEFT alone, each in its own process."""
    for wrapped in (True, False):
        lora_figure(rec, "f", sizes, device, wrapped, compiled=True)


FP8_RECIPES = ("bf16", "tensorwise", "rowwise")


def fp8_run(sizes: Sizes, device_type: str, recipe: str, shape: str) -> dict[str, Any]:
    """One child's full fine-tuning step times: bf16, or torchao's float8 recipe converted before autotp.wrap.
    shape "small": the 1B shape at tp=1, each layer compiled; "rank": one rank of tp=8 on the 70B shape (its
    `sizes.rank70b_layers` layers), on the fake process group, eager."""
    import autotp
    from autotp.compat.torch import init_fake_process_group

    device = child_device(device_type)
    config, (batch, seq) = (sizes.small, sizes.a) if shape == "small" else (sizes.big, sizes.c)
    ids = tokens(config, batch, seq, device)
    model = build(config, device)
    if recipe != "bf16":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        keep = lambda module, name: name != "lm_head"  # noqa: E731 - torchao's filter signature
        convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe), module_filter_fn=keep)
    if shape == "rank":
        init_fake_process_group(TP_C)
        model = autotp.wrap(model, TP_C, timeout=timedelta(minutes=5))
    else:
        model = autotp.wrap(model, 1)
        if sizes.compile:
            for layer in model.model.layers:
                layer.compile()
    optimizer = adamw(model.parameters(), device)
    times = step_times(model, ids, optimizer, sizes, device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"times": times, "peak": gib(peak)}


def section_g(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    """Float8 (torchao, tensorwise and rowwise) against bf16: the 1B shape at tp=1 compiled, then one tp=8 rank of
    the 70B shape on the fake process group; each run in its own process, the head kept in bf16 (torchtitan's
    default)."""
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        rec.write("g", "skip", "float8", reason="torchao is not installed (pip install 'autotp[fp8]')")
        return
    for shape in ("small", "rank"):
        config, (batch, seq) = (sizes.small, sizes.a) if shape == "small" else (sizes.big, sizes.c)
        ids, flops = tokens(config, batch, seq, torch.device("cpu")), full_flops(config, seq)
        ranks = 1 if shape == "small" else TP_C
        where = (
            f"tp=1, {sizes.names[0]}, {'compiled per layer' if sizes.compile else 'eager'}"
            if shape == "small"
            else f"one rank of tp={TP_C}, fake process group, {sizes.names[2]}, eager"
        )
        base = None
        for recipe in FP8_RECIPES:
            run = f"{recipe}, {where}, {batch} x {seq}, AdamW"
            try:
                result = in_child(fp8_run, sizes, device.type, recipe, shape)
            except ChildError as err:  # this recipe refused or failed: named, and the next one runs
                rec.write("g", "error", run, reason=str(err)[:2000], traceback=err.traceback)
                continue
            ratio = base and statistics.median(base) / statistics.median(result["times"])
            figure(
                rec,
                "g",
                run,
                result["times"],
                ids,
                flops,
                ranks=ranks,
                peak=result["peak"],
                recipe=recipe,
                ratio_to_bf16=ratio and round(ratio, 4),
                upper_bound=shape == "rank",
                beside=(f"{ratio:.2f}x bf16" if ratio else "the baseline")
                + (" (collectives cost nothing here)" if shape == "rank" else ""),
            )
            base = base or result["times"]


def section_h(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    """One tp=8 rank of pp 4's last stage on the 70B shape, on the fake process group: M micro-batches' forwards and
    backwards through the stage's layers, head and loss, then AdamW."""
    import autotp
    from autotp.compat.torch import init_fake_process_group
    from autotp.pp.report import bubble

    micro, rows, seq = sizes.h
    ids = tokens(sizes.stage, micro * rows, seq, device)
    init_fake_process_group(TP_C)
    model = autotp.wrap(build(sizes.stage, device), TP_C, timeout=timedelta(minutes=5))
    optimizer = adamw(model.parameters(), device)
    times = step_times(model, ids, optimizer, sizes, device, rows)
    rate, idle = ids.numel() / statistics.median(times) / TP_C, bubble("1F1B", PP_H, micro)
    layers = sizes.stage["num_hidden_layers"]
    figure(
        rec,
        "h",
        f"one rank of pp {PP_H} x tp={TP_C}, its last stage ({layers} layers, the head and the loss), fake process "
        f"group, {micro} micro-batches of {rows} x {seq}, AdamW, eager",
        times,
        ids,
        full_flops(sizes.stage, seq),
        ranks=TP_C,
        upper_bound=True,
        pipeline_tokens_per_s_per_gpu=round(rate / PP_H * (1 - idle), 1),
        beside=f"upper bound (sends, collectives and the bubble cost nothing here); a pp {PP_H} pipeline of such "
        f"stages: {rate / PP_H * (1 - idle):,.0f} tok/s per GPU at 1F1B's bubble {idle:.3f}",
    )
    del model, optimizer
    torch.distributed.destroy_process_group()


SECTIONS = {
    "a": section_a,
    "b": section_b,
    "c": section_c,
    "d": section_d,
    "e": section_e,
    "f": section_f,
    "g": section_g,
    "h": section_h,
}


# --- the gpu tests --------------------------------------------------------------------------------------------------


def run_pytest(rec: Recorder, budget: float, log: Path) -> None:
    """`python -m pytest -m gpu tests` in its own process group, stopped with everything it started after `budget`
    seconds; each test's outcome (from -v's lines, so a stopped run keeps what finished) and the summary."""
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "tests",
        "-v",
        "-rfE",
        "-p",
        "no:cacheprovider",
        "--continue-on-collection-errors",
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=budget)
        stopped = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        stopped = True
    log.write_text(out)
    outcomes = re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", out, flags=re.M)
    collection = re.findall(r"^ERROR collecting (\S+)", out, flags=re.M)
    for test, outcome in outcomes:
        rec.write("pytest", "test", test, outcome=outcome)
    counts = {o: sum(1 for _, seen in outcomes if seen == o) for o in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    summary = ", ".join(f"{n} {o.lower()}" for o, n in counts.items() if n) or "no test ran"
    rec.write(
        "pytest",
        "figure",
        "python -m pytest -m gpu tests",
        returncode=proc.returncode,
        stopped=stopped,
        counts=counts,
        collection_errors=collection,
        log=str(log),
        beside=summary
        + (f"; stopped after {budget:.0f} s" if stopped else "")
        + (f"; {len(collection)} modules failed to import: {', '.join(collection)}" if collection else ""),
    )


# --- main ----------------------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-results.jsonl"), help="the JSON-lines file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, no compile: the CPU smoke test")
    parser.add_argument(
        "--sections", default="bfg", help="which sections to run, e.g. 'ac' (a, c, d, e: measured in the first run)"
    )
    parser.add_argument("--pytest", action="store_true", help="then run `pytest -m gpu` under --pytest-budget")
    parser.add_argument("--pytest-budget", type=float, default=200.0, help="seconds")
    parser.add_argument("--table-from", type=Path, help="print the table of an earlier run's JSON lines and stop")
    args = parser.parse_args()
    if args.table_from:
        print(table([json.loads(line) for line in args.table_from.read_text().splitlines() if line.strip()]), end="")
        return
    sizes = SMOKE if args.smoke else FULL
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rec = Recorder(args.out, environment(device))
    rec.write("env", "env", "smoke" if args.smoke else "full", sections=args.sections, budgets=sizes.budget)
    if device.type == "cpu" and not args.smoke:
        rec.write("env", "skip", "full sizes", reason="no CUDA device: the full sizes need a GPU; use --smoke")
        return
    for section, fn in SECTIONS.items():
        if section in args.sections:
            run_section(rec, section, fn, sizes, device)
    if args.pytest:
        run_pytest(rec, args.pytest_budget, args.out.with_name(args.out.stem + "-pytest.log"))
    else:
        rec.write("pytest", "skip", "python -m pytest -m gpu tests", reason="not asked for (--pytest)")
    rec.table()
    print(f"\n{rec.path} and {rec.path.with_suffix('.md')}:\n\n{table(rec.records)}", end="")


if __name__ == "__main__":
    main()
