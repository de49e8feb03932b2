"""The "autotp-gloo" weight channel's connection: the trainer's store and the gloo group its workers join, the
shared secret that gates every init and round, and the bounds on how long a worker tries to reach the trainer.

Why apart from the backend (`vllm_gloo`): how the two sides find and trust each other is one concern (addresses,
ports, a listening socket narrowed to one interface, a constant-time token check); what a round carries and how the
engine loads it is another.
"""

from __future__ import annotations

import datetime
import errno
import hmac
import os
import socket
import threading
import time
from concurrent.futures import Future

import torch.distributed as dist

BACKEND = "autotp-gloo"
TOKEN_ENV = "AUTOTP_SYNC_TOKEN"  # the shared secret: the server's environment, and the trainer's (or vllm_sync(token=))
# How long a worker tries to reach the trainer's store and join its group. The engine serves nothing while its
# worker waits, so a trainer it cannot reach fails the init within this, not within the transfer's timeout_s.
CONNECT_S = 5.0


def gloo_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    channel: str = "",
    connect_s: float | None = None,
) -> tuple[dist.Store, dist.ProcessGroup]:
    """The trainer (rank 0, the store's host) and the workers, outside either side's own world: the channel's
    store (its keys under the channel's id) and group. Rank 0's store listens on `address` alone. `connect_s`:
    how long this rank tries to reach the store and join the group (default `timeout_s`); every later wait,
    a transfer's included, is `timeout_s`."""
    timeout = datetime.timedelta(seconds=timeout_s)
    connect = datetime.timedelta(seconds=min(connect_s or timeout_s, timeout_s))
    if rank != 0:
        _reach(address, port, connect.total_seconds())
    fd = _listening(address, port) if rank == 0 else None
    try:
        store = dist.TCPStore(address, port, world_size, is_master=rank == 0, timeout=connect, master_listen_fd=fd)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    store = dist.PrefixStore(f"{BACKEND}/{channel}", store)
    group = dist.ProcessGroupGloo(store, rank, world_size, connect)
    store.set_timeout(timeout)
    group._set_default_timeout(timeout)
    return store, group


def _listening(address: str, port: int) -> int:
    """A socket listening on `address` only, its descriptor handed to the store (which closes it): torch's own
    listens on every interface. An address that is not this host's (a NAT's, forwarded here) gets every interface,
    as nothing narrower receives it."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError as error:
            if error.errno != errno.EADDRNOTAVAIL:
                raise
            listener.bind(("", port))
        listener.listen()
    except BaseException:
        listener.close()
        raise
    return listener.detach()


def _reach(address: str, port: int, seconds: float) -> None:
    """Wait until the store at `address:port` accepts a connection, for `seconds` at most: torch's client retries
    past its own timeout (10 s took 19 to 27 s here, on 2 busy cores)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            socket.create_connection((address, port), timeout=max(deadline - time.monotonic(), 0.1)).close()
            return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConnectionError(f"no store answers at {address}:{port} ({error})") from error
            time.sleep(0.2)


def check_token(token: str, what: str) -> None:
    """The worker's gate: `token` must equal the server's `AUTOTP_SYNC_TOKEN` (compared in constant time), else
    `what` is refused before anything changes."""
    expected = os.environ.get(TOKEN_ENV, "")
    if not expected:
        raise PermissionError(
            f"{BACKEND}: {what} refused: the server has no {TOKEN_ENV} in its environment; start "
            f"it with the shared secret the trainer passes to vllm_sync (token= or {TOKEN_ENV})"
        )
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise PermissionError(
            f"{BACKEND}: {what} refused: its token is not the server's {TOKEN_ENV}; the engine "
            f"keeps its weights and its transfer channel"
        )


def in_background(fn, *args) -> Future:
    """`fn(*args)` in a daemon thread: a rendezvous the server refused does not hold the trainer's process open
    at exit until it times out."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 (handed to the caller)
            future.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return future
