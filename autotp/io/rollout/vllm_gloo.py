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
The server's processes register the backend through vLLM's general-plugin entry point (pyproject.toml's
`vllm.general_plugins`), the trainer through `vllm_sync`.
The channel is authenticated: every init and round carries a shared secret, compared with the server's
`AUTOTP_SYNC_TOKEN` before the worker touches its group or weights (vLLM's dev-mode routes have no auth of their
own), and the trainer's store listens on the one address that faces the engine.
"""

from __future__ import annotations

import datetime
import uuid
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from concurrent.futures import TimeoutError as FutureTimeout
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
    WeightTransferEngine,
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)
from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferInitInfo, WeightTransferUpdateInfo

from .sync import receive_weights, send_tensors
from .vllm_channel import BACKEND, CONNECT_S, TOKEN_ENV, check_token, gloo_group, in_background
from .vllm_check import check_round, expected_shapes
from .vllm_reload import CpuExpertPrepack, process_tied, unprocessed_layers

_TAKEN = "taken"  # set in a trainer's store by a worker that another client's init moved to a new channel


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
class AutotpGlooInitInfo(WeightTransferInitInfo):
    """What a worker needs to join the group: the trainer's store, the group's size, its own rank's offset."""

    master_address: str
    master_port: int
    world_size: int
    rank_offset: int = 1
    timeout_s: float = 300.0
    token: str = ""
    channel: str = ""


@dataclass
class AutotpGlooUpdateInfo(WeightTransferUpdateInfo):
    """One round: the names the trainer declared (its source's `metadata()`), so a worker applies only a whole one."""

    names: list[str]
    token: str = ""
    channel: str = ""
    collect: bool = False  # the second call of a round: wait for the receive the first one started, and check it
    abandon: bool = False  # instead, a failed trainer's: close the channel's stream and fail (vLLM ends the session)


class AutotpGlooWorkerEngine(WeightTransferEngine[AutotpGlooInitInfo, AutotpGlooUpdateInfo]):
    """Worker side: receives a round into host memory, loads it at `finish_weight_update` if it is complete."""

    init_info_cls = AutotpGlooInitInfo
    update_info_cls = AutotpGlooUpdateInfo

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.group: dist.ProcessGroup | None = None
        self.receiving: Future | None = None  # this round's staged tensors, received off the serving path
        self.staged: list[tuple[str, torch.Tensor]] | None = None
        self.store: dist.Store | None = None
        self.channel: str | None = None
        self.timeout_s = 300.0

    def init_transfer_engine(self, init_info: AutotpGlooInitInfo) -> None:
        check_token(init_info.token, "init_weight_transfer_engine")  # a refused client leaves the channel as it was
        address = f"{init_info.master_address}:{init_info.master_port}"
        self._hand_over(address)  # a trainer reconnecting after a failed round, or another client taking over
        parallel = self.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank + init_info.rank_offset
        try:
            self.store, self.group = gloo_group(
                init_info.master_address,
                init_info.master_port,
                rank,
                init_info.world_size,
                init_info.timeout_s,
                init_info.channel,
                connect_s=CONNECT_S,
            )
        except Exception as error:
            raise RuntimeError(
                f"{BACKEND}: this engine worker could not join the trainer's transfer group at "
                f"{address} within {CONNECT_S:g} s ({type(error).__name__}: {error}); is that "
                f"address reachable from the server? vllm_sync(master_address=...) sets it"
            ) from error
        self.channel, self.timeout_s = init_info.channel, init_info.timeout_s

    def _hand_over(self, to: str) -> None:
        """Close the current channel, first marking it taken in its trainer's store, so that trainer's next round
        says another client took it (rather than gloo's "Connection closed by peer")."""
        if self.group is not None:
            try:
                self.store.set_timeout(datetime.timedelta(seconds=2))
                self.store.set(_TAKEN, to)
            except Exception:  # noqa: BLE001 (that trainer is gone: no one to tell)
                pass
        self._close()

    def _close(self) -> None:
        """Abort the channel's group (a receive still waiting on it fails at once) and forget its store and round."""
        self.shutdown()
        self.store, self.receiving = None, None

    def start_weight_update(self) -> None:
        self.staged = None
        if self.receiving is None or self.receiving.done():  # a receive still waiting keeps the channel's stream
            self.receiving = None

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """The base class's, without its `torch.accelerator.synchronize()` (which raises on CPU torch), refused
        unless the round carries the server's token and is for the channel this worker holds. A round is two calls.
        The first starts receiving it in a thread, off the serving path, and returns: the engine goes on answering
        requests while it waits on the trainer (whose other ranks may still be finishing their step). The second
        (`collect`), sent once the trainer has streamed the whole round, waits for it and checks it; its failure
        ends vLLM's update session, as a failed update must."""
        info = self.parse_update_info(update_info)
        check_token(info.token, "update_weights")
        if self.group is not None and info.channel != self.channel:
            raise RuntimeError(
                f"{BACKEND}: update_weights refused: another client took the transfer channel "
                f"(re-initialised it) after this round's trainer opened it; the weights are unchanged"
            )
        if self.group is None:
            raise RuntimeError(
                f"{BACKEND}: no transfer group (never initialised, or closed by a failed round); the "
                f"trainer calls autotp.rollout.vllm_sync again to rebuild it"
            )
        if info.abandon:
            self._close()
            raise RuntimeError(f"{BACKEND}: the trainer abandoned this round; the model keeps its previous weights")
        if info.collect:
            self.staged = self._collect()
            return
        if self.receiving is not None and not self.receiving.done():
            raise RuntimeError(
                f"{BACKEND}: update_weights refused: a round is still being received on this channel "
                f"(an update_weights its trainer never sent to, waiting up to {self.timeout_s:g} s); "
                f"call autotp.rollout.vllm_sync again to open a new channel"
            )
        self.receiving = in_background(self.receive_weights, info, self.group)

    def receive_weights(
        self, update_info: AutotpGlooUpdateInfo, group: dist.ProcessGroup
    ) -> list[tuple[str, torch.Tensor]]:
        """The round from `group`, whole and checked against the engine's model, staged in host memory."""
        try:
            staged = [(name, tensor.clone()) for name, tensor in receive_weights(group)]
        except BaseException:
            group.abort()  # the stream is cut: nothing more can be read from this group
            if self.group is group:
                self.group = None
            raise
        names = [name for name, _ in staged]
        if names != update_info.names:
            missing = sorted(set(update_info.names) - set(names))[:3]
            raise RuntimeError(
                f"{BACKEND}: the round brought {len(names)} tensors, not the {len(update_info.names)} "
                f"declared (missing e.g. {missing}); the model keeps its previous weights"
            )
        expected = expected_shapes(self.model_config.hf_config)
        if expected is not None:
            check_round(staged, expected, type(self.model).__name__)
        return staged

    def _collect(self) -> list[tuple[str, torch.Tensor]]:
        """The round the first call began receiving (what is left once the trainer has sent it: its last bucket)."""
        receiving, self.receiving = self.receiving, None
        if receiving is None:
            raise RuntimeError(f"{BACKEND}: no round is being received on this channel; the model keeps its weights")
        try:
            return receiving.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise RuntimeError(
                f"{BACKEND}: the round had not arrived after {self.timeout_s:g} s; the model keeps its previous weights"
            ) from None

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        if self.staged is None:
            raise RuntimeError(f"{BACKEND}: finish_weight_update without a complete round received")
        staged, self.staged = self.staged, None
        unpacked = CpuExpertPrepack(self.model)
        with unpacked:
            initialize_layerwise_reload(self.model)
            with disable_mtp_completeness_check():
                self.model.load_weights(staged)
            skipped = unprocessed_layers(self.model)
            finalize_layerwise_reload(self.model, self.model_config)
        unpacked.prepack()
        process_tied(self.model, skipped)

    def shutdown(self) -> None:
        if self.group is not None:
            self.group.abort()
            self.group = None


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
        try:
            self.store.set_timeout(datetime.timedelta(seconds=2))
            return self.store.get(_TAKEN).decode() if self.store.check([_TAKEN]) else None
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
