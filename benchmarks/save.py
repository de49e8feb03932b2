"""Saving and loading at tp=2 (2 CPU ranks, gloo, 1 thread each), each beside its one-process peer in the same run.

    python benchmarks/save.py            # 1 GiB and 76 MiB fp32 Llamas; checkpoints of the 76 MiB one (a few minutes)
    python benchmarks/save.py --quick    # the 76 MiB model only, fewer rounds (under a minute)
    python benchmarks/save.py --checkpoint-sizes "76 MiB" "1 GiB"   # training checkpoints of the large model too

(a) `autotp.save_pretrained` at tp=2 against transformers' `model.save_pretrained` in one process, into a new
    directory and over an existing one (`overwrite=True`; transformers writes over its files in place).
(b) `autotp.save_checkpoint(dir, model, AdamW)` sync and `async_save=True` (the time the training loop is blocked,
    and the time until the write is complete: what the next save or `autotp.finish()` waits for) against
    `torch.save` of a one-process model + optimizer state_dict.
(c) `autotp.load_checkpoint` of (b)'s tp=2 checkpoint at tp=2 and at tp=1 (2 replicas), against `torch.load` and
    `load_state_dict` in one process.

Models are built from configs (no downloads) in persistent processes, so that the rounds of autotp and its peer
alternate (a slow spell of the shared machine hits both alike); the first round of each is a warm-up, not counted.
Reported per row: the best and median seconds over rounds, the throughput ratio (peer's time / autotp's time, from
the best of each), and per rank the RSS before the call, its peak during the call, and what it held: its shard and
the largest full tensor (save_pretrained must stay under shard + that tensor).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

SIZES = {  # Llama, fp32, untied; 1.007 GiB and 76.3 MiB of weights
    "1 GiB": dict(
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "76 MiB": dict(
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=8000,
        tie_word_embeddings=False,
    ),
}
MiB = 2**20


def rss(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def cpu() -> float:
    """CPU seconds of this process, every thread's (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def measured(call: Callable[[], Any]) -> dict[str, float]:
    """Seconds, CPU seconds, and RSS before and at its peak during `call` (VmHWM reset just before)."""
    Path("/proc/self/clear_refs").write_text("5")
    before, used = rss(), cpu()
    start = time.perf_counter()
    call()
    return {"s": time.perf_counter() - start, "cpu": cpu() - used, "before": before, "peak": rss("VmHWM")}


# --- the processes ----------------------------------------------------------------------------------------


class Worker:
    """The state one process keeps between commands: its models, optimizers and scratch directory."""

    def __init__(self, rank: int, world: int, size: str, work: Path):
        from transformers import AutoModelForCausalLM, LlamaConfig

        self.rank, self.world, self.work = rank, world, work
        torch.manual_seed(0)
        self.config = LlamaConfig(**SIZES[size])
        self.build = lambda: AutoModelForCausalLM.from_config(self.config)
        model = self.build()
        self.largest = max(p.numel() * p.element_size() for p in model.state_dict().values())
        if world > 1:
            import autotp

            model = autotp.wrap(model, world)
        self.model, self.optimizer = model, None
        self.shard = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def timed(self, call: Callable[[], Any]) -> dict[str, float]:
        self.barrier()
        out = measured(call)
        self.barrier()
        return {**out, "shard": self.shard, "largest": self.largest}

    def remove(self, path: Path) -> None:
        self.barrier()
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        self.barrier()

    def with_optimizer(self) -> None:
        """AdamW with its state, as after a step (gradients of zero: the state's size is what matters)."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
            for p in self.model.parameters():
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.model.zero_grad(set_to_none=True)

    # (a)
    def pretrained(self, target: str, overwrite: bool) -> dict[str, float]:
        if self.world == 1:
            return self.timed(lambda: self.model.save_pretrained(target))
        import autotp

        return self.timed(lambda: autotp.save_pretrained(self.model, target, overwrite=overwrite))

    # (b)
    def checkpoint(self, target: str, mode: str) -> dict[str, float]:
        self.with_optimizer()
        if self.world == 1:

            def state() -> dict:
                return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

            return self.timed(lambda: torch.save(state(), Path(target) / "checkpoint.pt"))
        import autotp
        from autotp.io.checkpoint.save import wait_for_pending  # what the next save and autotp.finish() wait for

        if mode == "sync":
            return self.timed(lambda: autotp.save_checkpoint(target, self.model, self.optimizer, overwrite=True))
        returned: list[float] = []

        def save_and_wait() -> None:
            start = time.perf_counter()
            autotp.save_checkpoint(target, self.model, self.optimizer, overwrite=True, async_save=True)
            returned.append(time.perf_counter() - start)
            wait_for_pending()

        return {**self.timed(save_and_wait), "blocked": returned[0]}

    # (c)
    def load(self, source: str, tp: int) -> dict[str, float]:
        self.with_optimizer()
        if self.world == 1:

            def load() -> None:
                state = torch.load(Path(source) / "checkpoint.pt", weights_only=True)
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])

            return self.timed(load)
        import autotp

        model, optimizer = self.model, self.optimizer
        if tp != self.world:
            if not hasattr(self, "other"):
                torch.manual_seed(1)
                other = autotp.wrap(self.build(), tp)
                self.other = (other, torch.optim.AdamW(other.parameters(), lr=1e-4))
            model, optimizer = self.other
        return self.timed(lambda: autotp.load_checkpoint(source, model, optimizer))


def serve(conn, rank: int, world: int, port: int, size: str, work: str) -> None:
    torch.set_num_threads(1)
    sys.stderr = open(os.devnull, "w")  # both sides' progress bars and warnings; errors come back through `conn`
    try:
        if world > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            dist.init_process_group("gloo", rank=rank, world_size=world)
        worker = Worker(rank, world, size, Path(work))
        conn.send("ready")
        while (command := conn.recv()) is not None:
            name, *args = command
            try:
                conn.send(getattr(worker, name)(*args))
            except Exception as err:
                conn.send(f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class Team:
    """`world` persistent processes of one model size answering the same commands (world 1: the peer)."""

    def __init__(self, world: int, size: str, work: Path):
        from autotp.testing.spawn import free_port

        ctx, port = mp.get_context("fork"), free_port()
        self.pipes, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child, rank, world, port, size, str(work)), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)
        for pipe in self.pipes:
            if pipe.recv() != "ready":
                raise RuntimeError("a worker failed to start")

    def __call__(self, *command: Any) -> list[Any]:
        for pipe in self.pipes:
            pipe.send(command)
        out = [pipe.recv() for pipe in self.pipes]
        errors = [o for o in out if isinstance(o, str)]
        if errors:
            raise RuntimeError(errors[0])
        return out

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for proc in self.procs:
            proc.join(60)


# --- the comparisons --------------------------------------------------------------------------------------


def rounds(count: int, runs: dict[str, Callable[[int], list[dict]]]) -> dict[str, list[list[dict]]]:
    """Every run once per round, in alternating order; round 0 is a warm-up, dropped."""
    out: dict[str, list[list[dict]]] = {name: [] for name in runs}
    for index in range(count + 1):
        names = list(runs) if index % 2 == 0 else list(reversed(runs))
        for name in names:
            result = runs[name](index)
            if index:
                out[name].append(result)
    return out


def row(label: str, results: list[list[dict]], peer: list[list[dict]] | None, key: str = "s") -> str:
    times = [max(r[key] for r in ranks) for ranks in results]
    best, median = min(times), statistics.median(times)
    ratio = f"{min(max(r['s'] for r in ranks) for ranks in peer) / best:.2f}" if peer else ""
    memory = (
        "; ".join(
            f"{r['before'] / MiB:.0f} -> {r['peak'] / MiB:.0f} ({(r['peak'] - r['before']) / MiB:+.0f})"
            for r in results[-1]
        )
        if key == "s"
        else ""
    )
    used = f"{min(sum(r['cpu'] for r in ranks) for ranks in results):.3f}" if key == "s" else ""
    return f"| {label} | {best:.3f} | {median:.3f} | {ratio} | {used} | {memory} |"


def save_pretrained_rows(size: str, count: int, work: Path) -> list[str]:
    ours, theirs = Team(2, size, work), Team(1, size, work)
    try:

        def run(team: Team, who: str, overwrite: bool) -> Callable[[int], list[dict]]:
            def one(index: int) -> list[dict]:
                target = work / f"{who}-{'over' if overwrite else index}"
                out = team("pretrained", str(target), overwrite)
                if not overwrite:
                    team("remove", target)
                return out

            return one

        new = rounds(count, {"autotp": run(ours, "autotp", False), "transformers": run(theirs, "plain", False)})
        over = rounds(count, {"autotp": run(ours, "autotp", True), "transformers": run(theirs, "plain", True)})
        shard, largest = new["autotp"][0][0]["shard"], new["autotp"][0][0]["largest"]
        extra = max(r["peak"] - r["before"] for ranks in new["autotp"] + over["autotp"] for r in ranks)
    finally:
        ours.close()
        theirs.close()
    return [
        row(f"{size}: autotp.save_pretrained, new directory", new["autotp"], new["transformers"]),
        row(f"{size}: transformers save_pretrained, new directory", new["transformers"], None),
        row(f"{size}: autotp.save_pretrained, overwrite=True", over["autotp"], over["transformers"]),
        row(f"{size}: transformers save_pretrained, over its files", over["transformers"], None),
        f"| {size}: per rank: shard {shard / MiB:.0f} MiB, largest full tensor {largest / MiB:.0f} MiB; most "
        f"RSS rose during a save: {extra / MiB:.0f} MiB ({'within' if extra <= largest else 'OVER'} one tensor) "
        f"| | | | | |",
    ]


def checkpoint_rows(size: str, count: int, work: Path) -> list[str]:
    import inspect

    import autotp

    if "async_save" not in inspect.signature(autotp.save_checkpoint).parameters:
        return [
            f"| {size}: training checkpoints skipped: this autotp's save_checkpoint has no async_save (the DCP "
            f"checkpoints) | | | | | |"
        ]
    ours, theirs = Team(2, size, work), Team(1, size, work)
    source, plain = work / "ckpt-tp2", work / "ckpt-plain"
    plain.mkdir(exist_ok=True)
    try:
        saves = rounds(
            count,
            {
                "sync": lambda i: ours("checkpoint", str(source), "sync"),
                "async": lambda i: ours("checkpoint", str(source), "async"),
                "torch.save": lambda i: theirs("checkpoint", str(plain), "sync"),
            },
        )
        loads = rounds(
            count,
            {
                "tp=2": lambda i: ours("load", str(source), 2),
                "tp=1": lambda i: ours("load", str(source), 1),
                "torch.load": lambda i: theirs("load", str(plain), 1),
            },
        )
    finally:
        ours.close()
        theirs.close()
    files = sum(f.stat().st_size for f in source.rglob("*") if f.is_file()) / MiB
    return [
        f"| {size}: model + AdamW, {files:.0f} MiB on disk at tp=2 | | | | | |",
        row(f"{size}: autotp.save_checkpoint", saves["sync"], saves["torch.save"]),
        row(
            f"{size}: autotp.save_checkpoint(async_save=True), blocked",
            saves["async"],
            saves["torch.save"],
            key="blocked",
        ),
        row(f"{size}: autotp.save_checkpoint(async_save=True), until written", saves["async"], saves["torch.save"]),
        row(f"{size}: torch.save, one process", saves["torch.save"], None),
        row(f"{size}: autotp.load_checkpoint at tp=2", loads["tp=2"], loads["torch.load"]),
        row(f"{size}: autotp.load_checkpoint at tp=1 (2 replicas)", loads["tp=1"], loads["torch.load"]),
        row(f"{size}: torch.load + load_state_dict, one process", loads["torch.load"], None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the 76 MiB model only, 2 rounds (under a minute)")
    parser.add_argument("--rounds", type=int, default=None, help="counted rounds per comparison (default 5, quick 2)")
    parser.add_argument("--sizes", nargs="+", default=None, choices=list(SIZES), help="save_pretrained's models")
    parser.add_argument(
        "--checkpoint-sizes",
        nargs="*",
        default=["76 MiB"],
        choices=list(SIZES),
        help="models of (b) and (c); none to skip them",
    )
    args = parser.parse_args()
    count = args.rounds or (2 if args.quick else 5)
    sizes = args.sizes or (["76 MiB"] if args.quick else list(SIZES))
    work = Path(tempfile.mkdtemp(prefix="autotp-bench-save-"))
    lines = []
    try:
        for size in sizes:
            lines += save_pretrained_rows(size, count, work)
        for size in args.checkpoint_sizes:
            lines += checkpoint_rows(size, 1 if args.quick else count, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n2 ranks x 1 thread (gloo) against one process x 1 thread; {count} rounds after a warm-up; seconds")
    print(
        "| run | best s | median s | throughput ratio (peer s / autotp s, best of each) | CPU s, all ranks (least) | "
        "RSS MiB per rank: before -> peak (+rise) |"
    )
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
