"""The worker side of the CPU transport "autotp-gloo" (`vllm_gloo`): what each vLLM engine worker runs.

Why apart from the trainer side: it runs in vLLM's worker processes, against the engine's model. It joins the
trainer's gloo group, receives a round in a thread (the engine serves meanwhile), stages it whole in host memory,
checks its names and shapes (`vllm_check`) and loads it only at `finish_weight_update`, then redoes what vLLM
CPU's layerwise reload leaves undone (`vllm_reload`: the MoE prepack, a tied head). Every init and round is refused
unless it carries the server's token and is for the channel this worker holds.
"""

from __future__ import annotations

import datetime
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer import WeightTransferEngine
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo

from .sync import receive_weights
from .vllm_channel import BACKEND, CONNECT_S, check_token, gloo_group, in_background
from .vllm_check import check_round, expected_shapes
from .vllm_reload import CpuExpertPrepack, process_tied, unprocessed_layers

TAKEN = "taken"  # set in a trainer's store by a worker that another client's init moved to a new channel


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
        if self.group is not None and self.store is not None:  # set together, by init_transfer_engine
            try:
                self.store.set_timeout(datetime.timedelta(seconds=2))
                self.store.set(TAKEN, to)
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
