"""A CPU transport for vLLM's weight transfer: backend "autotp-gloo", one gloo group between the sending trainer
rank and every engine worker, registered with vLLM's worker- and trainer-side factories.

Why: none of vLLM's own backends (nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n, modelexpress) runs on CPU, and
the base worker engine's `update_weights` calls `torch.accelerator.synchronize()`, which raises on CPU torch.
The stream is `autotp.sync_weights`' (a header, then one flat buffer per bucket; `send_tensors` and
`receive_weights`). The worker stages the whole round and loads it into the model only at
`finish_weight_update`, once every declared tensor has arrived (received in a thread, so the engine serves
meanwhile): vLLM's layerwise reload does not roll back, so a
round cut off midway (a trainer rank died, the link broke) leaves the engine serving the previous round's weights,
whole. The cost is one checkpoint-format copy of the model in each worker's host memory during a round.
vLLM 0.32's CPU MoE experts are prepacked into its grouped-GEMM layout on the first load only: a weight update
leaves them in checkpoint layout, read as packed (silently wrong experts), so the worker prepacks them again.
Its layerwise reload also skips the post-load processing of a layer that gets no weight of its own, a tied LM head,
whose CPU build keeps a packed copy of the embedding: the worker runs that processing again for those layers.
A round whose names or shapes do not fit the engine's model is refused before loading (`vllm_check`).
The worker side is `vllm_gloo_worker`; this module is the trainer side and the plugin hook `register`.
The server's processes register the backend through vLLM's general-plugin entry point (pyproject.toml's
`vllm.general_plugins`), the trainer through `vllm_sync`.
The channel is authenticated: every init and round carries a shared secret, compared with the server's
`AUTOTP_SYNC_TOKEN` before the worker touches its group or weights (vLLM's dev-mode routes have no auth of their
own), and the trainer's store listens on the one address that faces the engine.
"""

from __future__ import annotations

import datetime
import uuid
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, ClassVar, Iterator, Self

import requests
import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import (
    ParamMeta,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import TrainerInitInfo

from .sync import send_tensors
from .vllm_channel import BACKEND, CONNECT_S, TOKEN_ENV, gloo_group, in_background
from .vllm_gloo_worker import TAKEN, AutotpGlooWorkerEngine


def register() -> None:
    """vLLM's general-plugin hook, run in every vLLM process: the backend in both factories (once)."""
    for factory, engine in (
        (WeightTransferEngineFactory, AutotpGlooWorkerEngine),
        (WeightTransferTrainerFactory, AutotpGlooTrainerEngine),
    ):
        try:
            factory.register_engine(BACKEND, engine)
        except ValueError:  # registered already (this process loaded the plugin before)
            pass


@dataclass
class AutotpGlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side: where the sender hosts the group's store, the group's size (1 + the engine's workers across
    its DP replicas), the bucket size of the stream, how long any rank waits on another, and the shared secret
    (the server's `AUTOTP_SYNC_TOKEN`)."""

    backend: ClassVar[str] = BACKEND

    master_address: str
    master_port: int
    world_size: int
    bucket_bytes: int = 256 << 20
    timeout_s: float = 300.0
    token: str = ""


class AutotpGlooTrainerEngine(TrainerWeightTransferEngine[AutotpGlooTrainerInitInfo]):
    """Trainer side: on every trainer rank each round (the source's gathers need them all); rank 0 sends."""

    init_info_cls = AutotpGlooTrainerInitInfo

    def __init__(
        self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool, bucket_bytes: int, token: str = ""
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.bucket_bytes, self.token = bucket_bytes, token
        self.group: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        self.channel = uuid.uuid4().hex  # this connection's id: a round for another client's channel is refused

    @classmethod
    def trainer_init(
        cls, init_info: AutotpGlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError(f"{BACKEND}: the trainer engine needs a WeightSource")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            bucket_bytes=init_info.bucket_bytes,
            token=init_info.token,
        )
        if not engine.is_sender:
            return engine
        address = f"{init_info.master_address}:{init_info.master_port}"
        worker = dict(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            world_size=init_info.world_size,
            rank_offset=1,
            timeout_s=init_info.timeout_s,
            token=init_info.token,
            channel=engine.channel,
        )
        exe = ThreadPoolExecutor(max_workers=1)  # the workers join inside the RPC; the trainer joins meanwhile
        try:
            rpc = exe.submit(client.init_weight_transfer_engine, worker)
            group = in_background(
                gloo_group,
                init_info.master_address,
                init_info.master_port,
                0,
                init_info.world_size,
                init_info.timeout_s,
                engine.channel,
            )
            wait([rpc, group], return_when=FIRST_EXCEPTION)
            try:
                rpc.result()  # the server's refusal (an unknown backend, say) before waiting out the rendezvous
            except (requests.HTTPError, RuntimeError) as error:  # vLLM's client, or autotp's EngineClient
                raise RuntimeError(
                    f"{BACKEND}: the server refused to open the transfer channel ({error}). Either "
                    f"its {TOKEN_ENV} is unset or not this trainer's token (vllm_sync(token=) or {TOKEN_ENV}), or "
                    f"its workers could not reach this trainer's store at {address} within {CONNECT_S:g} s (pass "
                    f"vllm_sync(master_address=) an address of this host that the server reaches)"
                ) from error
            engine.store, engine.group = group.result()
        finally:
            exe.shutdown(wait=False)
        return engine

    def send_weights(self) -> None:
        """One round: every trainer rank iterates the source; the sender has the workers begin receiving (they do it
        off the engine's serving path), streams the round, has them check it, then load it. On any failure the
        sender aborts the group and the round, so the workers stop waiting at once and keep their previous weights;
        call `vllm_sync` again."""
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        if self.group is None:
            raise RuntimeError(
                f"{BACKEND}: the transfer group was closed by a failed round; call "
                f"autotp.rollout.vllm_sync again (on every trainer rank) before the next send"
            )
        info = {"names": [m.name for m in meta], "token": self.token, "channel": self.channel}
        self._start(info)
        try:
            self.client.update_weights(info)  # returns once the workers began receiving: a refusal is heard now
            send_tensors(_checked(self.source, meta), self.group, bucket_bytes=self.bucket_bytes)
            self.client.update_weights({**info, "collect": True})
        except BaseException as error:
            taken = self._taken()
            self.shutdown()
            if taken is not None:  # the channel's session is the other client's now: leave it
                raise RuntimeError(
                    f"{BACKEND}: another client took the engine's transfer channel (it re-initialised "
                    f"it, with its store at {taken}), so this round was refused and the engine keeps "
                    f"its weights; call autotp.rollout.vllm_sync again (on every trainer rank) to "
                    f"take it back"
                ) from error
            self._close_session({**info, "abandon": True})
            raise
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.abort()
            self.group = None

    def _start(self, info: dict[str, Any]) -> None:
        """vLLM's `start_weight_update`, after closing an update session a failed trainer left open (killed between
        the two calls of its round): vLLM refuses a new session until an update call fails or a finish runs."""
        try:
            self.client.start_weight_update()
        except RuntimeError as error:
            if "already active" not in str(error):  # vLLM's words for an open session
                raise
            self._close_session({**info, "collect": True})  # no round is being received: it fails at once
            self.client.start_weight_update()

    def _close_session(self, info: dict[str, Any]) -> None:
        """End the engine's update session of a failed round with an update call that fails (vLLM ends a session on
        a failed update): `abandon` (the workers close this channel's stream, so their receive stops now, not at its
        timeout), or `collect` where the workers have no round to collect."""
        try:
            self.client.update_weights(info)
        except Exception:  # noqa: BLE001 (its failure is the point)
            pass

    def _taken(self) -> str | None:
        """Where the client that took this channel hosts its store, if a worker marked it taken (read in 2 s)."""
        if self.store is None:  # no store: nothing to read
            return None
        try:
            self.store.set_timeout(datetime.timedelta(seconds=2))
            return self.store.get(TAKEN).decode() if self.store.check([TAKEN]) else None
        except Exception:  # noqa: BLE001 (no store, or it is gone: nothing to read)
            return None


def _checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's pairs, each checked against what `metadata()` declared (a mismatch is named, not streamed).
    On any stop the source's iterator is closed at once, so `export_weights` tells the other trainer ranks now
    (they raise at their next bucket) rather than when the traceback holding it is freed."""
    pairs = iter(source)
    try:
        for (name, tensor), declared in zip(pairs, meta, strict=True):
            if (name, tensor.dtype, tuple(tensor.shape)) != (declared.name, declared.dtype, declared.shape):
                raise ValueError(
                    f"{BACKEND}: the source yielded {name} {tensor.dtype} {tuple(tensor.shape)} where "
                    f"its metadata() declared {declared.name} {declared.dtype} {declared.shape}"
                )
            yield name, tensor
    finally:
        close = getattr(pairs, "close", None)
        if close is not None:
            close()
