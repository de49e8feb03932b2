"""autotp on one GPU, in one run: its cost at tp=1, LoRA on an 8B shape, one tp=8 rank's compute, context
parallelism's variable-length path, and the `gpu` tests.

    PYTHONPATH=. timeout 590 python benchmarks/gpu.py --pytest --out $OUT/gpu.jsonl   # H100: sections < 6 min
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
    dispatcher picks the flash backend: bf16, no mask): PEFT alone, then PEFT under `autotp.wrap(model, 1)`,
    beside NeMo Automodel's 12,473 tok/s on one H100. Automodel differs: Transformer Engine layers and triton
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
        httpcore2 typer pytest pytest-timeout pluggy iniconfig

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


@dataclass(frozen=True)
class Sizes:
    """What each section runs: the full run for one H100, or tiny shapes for the CPU smoke test."""

    small: dict  # (a)
    large: dict  # (b), (c)
    cp: dict  # (d)
    names: tuple[str, str]  # of small and large, for the lines
    a: tuple[int, int]  # (batch, seq)
    b: tuple[int, int]
    c: tuple[int, int]
    d: tuple[int, int]
    warmup: int
    steps: int
    budget: dict  # seconds per section
    compile: bool


FULL = Sizes(
    LLAMA_1B,
    LLAMA_8B,
    CP_MODEL,
    ("Llama-1B shape", "Llama-3-8B shape"),
    (4, 2048),
    (2, 4096),
    (1, 8192),
    (2, 4096),
    3,
    8,
    {"a": 130, "b": 75, "c": 50, "d": 40, "e": 5},
    True,
)
SMOKE = Sizes(
    TINY,
    TINY,
    TINY,
    ("tiny Llama", "tiny Llama"),
    (2, 64),
    (2, 64),
    (1, 64),
    (2, 64),
    1,
    2,
    {"a": 30, "b": 30, "c": 30, "d": 30, "e": 5},
    False,
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
    model: torch.nn.Module, ids: torch.Tensor, optimizer: torch.optim.Optimizer, sizes: Sizes, device: torch.device
) -> list[float]:
    """Seconds of each training step (forward, backward, optimizer) after the warm-up ones."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for step in range(sizes.warmup + sizes.steps):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
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
    **fields: Any,
) -> dict[str, Any]:
    """Write a throughput line: the median step, tokens/s per GPU (a TP group's tokens shared by its `ranks`), the
    FLOPs per token stated, TFLOP/s per GPU and MFU against the card's peak."""
    step = statistics.median(times)
    per_gpu = ids.numel() / step / ranks
    achieved = per_gpu * flops[0] / 1e12
    peak = rec.env["peak_tflops"]
    memory = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
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
        mfu=round(achieved / peak, 4) if peak else None,
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


def section_b(rec: Recorder, sizes: Sizes, device: torch.device) -> None:
    """LoRA on the 8B shape: PEFT alone, then under autotp.wrap(model, 1)."""
    from peft import LoraConfig, get_peft_model

    import autotp

    batch, seq = sizes.b
    ids, flops = tokens(sizes.large, batch, seq, device), lora_flops(sizes.large, seq, LORA["r"])
    for wrapped in (False, True):
        model = get_peft_model(build(sizes.large, device), LoraConfig(**LORA))
        if wrapped:
            autotp.wrap(model.base_model.model, 1)
        optimizer = adamw([p for p in model.parameters() if p.requires_grad], device)
        times, checkpointing = fitting_step_times(model, ids, optimizer, sizes, device)
        name = "PEFT LoRA under autotp.wrap(model, 1)" if wrapped else "PEFT LoRA"
        rate = ids.numel() / statistics.median(times)
        figure(
            rec,
            "b",
            f"{name}, {sizes.names[1]}, {batch} x {seq}, r {LORA['r']}, SDPA",
            times,
            ids,
            flops,
            activation_checkpointing=checkpointing,
            ratio_to_automodel=round(rate / AUTOMODEL_LORA_8B, 4),
            beside=f"{rate / AUTOMODEL_LORA_8B:.2f}x Automodel's {AUTOMODEL_LORA_8B:,} (1 x H100; Transformer "
            f"Engine + triton kernels, 16 micro-batches per step)"
            + ("; activation checkpointing (did not fit without)" if checkpointing else ""),
        )
        del model, optimizer
        free()


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


SECTIONS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": section_e}


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
    parser.add_argument("--sections", default="abcde", help="which sections to run, e.g. 'ac'")
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
