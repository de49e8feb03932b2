"""Run the README's and the guides' launch commands exactly as written, with launchers from the environment under test;
and a multi-node job as one launcher per "node" on this machine."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from autotp.testing.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]


def readme_command(pattern: str) -> list[str]:
    """The command matching `pattern` in the README or a guide under docs/, with its launcher taken from the
    environment under test (the guides hold the commands the short README no longer shows)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found = next((m for page in pages if (m := re.search(pattern, page.read_text()))), None)
    assert found, f"README.md and docs/ lost the command {pattern!r}"
    argv = found.group(0).split()
    argv[0] = str(Path(sys.executable).with_name(argv[0]))
    return argv


def launch_env() -> dict[str, str]:
    """The environment with CPU threads of one each and a free rendezvous port for a standalone launcher."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PET_MASTER_PORT": str(free_port())}


def run(argv: list[str], timeout: int = 300) -> str:
    """Run from the repository root in `launch_env()`; returns stdout."""
    done = subprocess.run(argv, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def run_nodes(argvs: list[list[str]], logs: Path, timeout: int = 240) -> str:
    """Run one launcher per "node" of a multi-node job together on this machine; returns their stdouts joined.

    The launchers write to files under `logs` (pipes read one after another could fill and stall the job). If one
    fails, or `timeout` passes, every launcher is stopped with its workers and the assertion shows each log's end.
    """
    logs.mkdir(parents=True, exist_ok=True)
    names = [(logs / f"node{n}.out", logs / f"node{n}.err") for n in range(len(argvs))]
    launchers: list[subprocess.Popen] = []
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as files:
        try:
            for argv, (out, err) in zip(argvs, names):
                launchers.append(
                    subprocess.Popen(
                        argv,
                        cwd=ROOT,
                        env=launch_env(),
                        stdout=files.enter_context(open(out, "w")),
                        stderr=files.enter_context(open(err, "w")),
                    )
                )
            # a failed node is not waited for: the others would wait on it until the rendezvous times out
            while any(p.poll() is None for p in launchers) and not any(p.poll() for p in launchers):
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        finally:
            ran_out = time.monotonic() > deadline
            stop_launchers(launchers)
    codes = [p.returncode for p in launchers]
    tails = "\n".join(
        f"--- node {n}:\n{out.read_text()[-2000:]}{err.read_text()[-4000:]}" for n, (out, err) in enumerate(names)
    )
    assert codes == [0] * len(argvs), f"exit codes {codes}{f', stopped after {timeout} s' * ran_out}:\n{tails}"
    return "".join(out.read_text() for out, _ in names)


def stop_launchers(launchers: list[subprocess.Popen], grace: float = 45) -> None:
    """Stop the launchers still running and the workers they started, which run in sessions of their own (a signal
    to the launcher's group would miss them): SIGTERM makes torchrun stop its workers (SIGKILL after its 30 s);
    whatever outlives `grace` is killed."""
    running = {p: children(p.pid) for p in launchers if p.poll() is None}
    for launcher in running:
        launcher.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for launcher, workers in running.items():
        try:
            launcher.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            for pid in [launcher.pid, *workers]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            launcher.wait()


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, read from Linux's /proc (none where there is no /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the field after the state
        except (OSError, IndexError, ValueError):
            continue
        if parent == pid:
            found.append(int(stat.parent.name))
    return found
