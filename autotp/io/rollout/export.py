"""Weights out to a rollout engine (vLLM, SGLang, TRL): a sharded model's weights as transformers' checkpoint names,
gathered bucket by bucket, LoRA merged on the fly, optionally cut to the engine's own tensor-parallel rows.

Why: an RL trainer sends its weights to the engine after every step. Saving and reloading from disk is slow, and
gathering one parameter at a time is thousands of collectives. `export_weights` reuses `save_pretrained`'s layout
(`autotp.io.hf.parts`: names, MoE experts one per expert, tied weights left out) and gathers each bucket of tensors in
one message per rank (`autotp.io.rollout.row_gather`). Every bucket opens with a one-int agreement over the ranks
taking part, so a rank that stops iterating early (a `break`, `close()`) makes the others raise, not hang.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...compat.hf_conversion import SavedTensor
from ...compat.peft import adapter_state_dict, base_keys, merged_weight, peft_inner
from ...mesh import device_of
from ...options import WrapOptions
from ...planning.placement import window
from ...planning.planner import plan_for
from ...planning.sharding import Partition
from ...runtime.collectives import all_reduce, buckets
from ...runtime.dimension import Collected, collected
from ...runtime.shards import held_part, held_shard, holders
from ...state import find_state, outside_module_holders
from ...tp.lora import adapt_all
from ..hf.parts import finish_part, full_shape, local_part, saved_layout
from .gathers import Gathers
from .row_gather import RowRequest, dp_full_many
from .vllm_layout import vllm_partitions


@dataclass(frozen=True)
class EngineLayout:
    """The rollout engine's tensor parallelism: `tp_size` ranks, each holding the rows `autotp.wrap(model, tp_size)`
    would hold (the same plan, computed for `tp_size` on a meta copy of the model); `EngineLayout.vllm(tp_size)`:
    the rows vLLM's own loader cuts (`autotp.io.rollout.vllm_layout`)."""

    tp_size: int
    engine: str | None = None

    @classmethod
    def vllm(cls, tp_size: int) -> EngineLayout:
        """vLLM's rows: its vocabulary padded to a multiple of 64 and cut in equal blocks."""
        return cls(tp_size, engine="vllm")

    def partitions(self, model: nn.Module) -> dict[str, Partition]:
        """Model tensor name -> its partition over the engine's ranks (absent: whole on every engine rank)."""
        if self.tp_size == 1:
            return {}
        state = find_state(model)
        options = state.options if state is not None else WrapOptions()
        with torch.device("meta"):
            twin = type(model)(copy.deepcopy(model.config))
        plan = plan_for(twin, self.tp_size, options, split_vocab=self.engine == "vllm")  # vLLM always splits it
        if self.engine == "vllm":
            return vllm_partitions(twin, plan, plan.sharded_params(twin))
        return plan.sharded_params(twin)


def export_weights(
    model: nn.Module,
    *,
    merge_lora: bool = True,
    dtype: torch.dtype | None = None,
    bucket_bytes: int = 256 << 20,
    target: EngineLayout | None = None,
) -> Iterator[tuple]:
    """The model's weights as transformers' `save_pretrained` of the same one-process model writes them.

    Call it and iterate it on every rank of the TP group (under `autotp.fully_shard` or `ep_size > 1`, on every rank):
    TP rank 0 of each group gets `(name, tensor)` (under EP the experts too, each gathered over its EP group), the
    other ranks take part in the gathers and get nothing. Every rank must exhaust the iterator; one that stops early
    (`break`, `close()`) makes the others raise at their next bucket. Under a pipeline (every rank iterates) each stage
    sends its buckets on to PP rank 0's TP rank 0, which yields every tensor, in one process's order.
    Tensors are gathered `bucket_bytes` at a time (one message per rank per bucket; under FSDP, one DP all-gather
    too): a rank holds at most one bucket plus one tensor beyond its shards, when the consumer drops each tensor
    before asking for the next (as `load_weights` does). Each yielded tensor is new (the model, its shards and its
    optimizer are left as they were); `dtype` casts it. `model` may be held by DDP or `AutoTPTrainer`'s
    `model_wrapped` (the names are still the model's own), and may be inside `GatherReplacedLayerParams` (its full
    weights then go out as they are).

    `merge_lora`: PEFT's active LoRA adapters (added before or after `wrap`) merged in fp32 into the base weights as
    `merge_and_unload()` would, `modules_to_save` copies under the base names; the model keeps its adapters.
    False: the base weights alone (the adapters come from `export_adapters`).
    `target`: an `EngineLayout`; TP rank 0 then gets `(name, engine_rank, rows)` for every engine rank (checkpoint
    names again): the rows `autotp.wrap(model, target.tp_size)` holds on that rank, assembled from the trainer
    ranks' rows; no full tensor of a sharded weight is built (replicated ones go whole to every engine rank).
    """
    check_bucket_bytes(bucket_bytes, "autotp.export_weights")
    root = peft_inner(outside_module_holders(model))
    state = find_state(root)
    for dimension in [] if state is None or target is None else state.dims.values():
        dimension.refuse_export(target)
    if state is not None and state.tp_group is not None:
        adapt_all(root, state)  # adapters PEFT added since the last forward: split now (collective over TP)
    keys, params, parts = exported_tensors(root, merge_lora)
    loras = _loras_by_tensor(root, keys, params) if merge_lora else {}
    layout = saved_layout(root, params)
    engine = None if target is None else target.partitions(root)
    engine_tp = 0 if target is None else target.tp_size  # read only where engine (so target) is set
    items = [(name, saved) for name, saved in layout.items()]
    joined = [name for name, saved in items if len(saved.parts) > 1]
    if engine is not None and joined:  # refused before any collective, on every rank alike
        raise NotImplementedError(
            f"autotp.export_weights(target=...): {joined[0]} is several model tensors joined; "
            f"slicing it for an engine is not supported"
        )

    def local(name: str) -> torch.Tensor:
        tensor = params[name]
        for lora in loras.get(name, ()):
            tensor = merged_weight(lora, tensor)
        return tensor

    def requests(name: str, saved: SavedTensor, gathered: dict[str, torch.Tensor]) -> list[RowRequest]:
        out_dtype = dtype or saved.dtype
        reqs = []
        for part in saved.parts:
            tensor = gathered[part.source] if part.source in gathered else local(part.source)
            rows, partition = local_part(tensor, held_part(params[part.source]), part)
            if engine is None:
                reqs.append(RowRequest(rows, partition, None, out_dtype))
                continue
            for rank in range(engine_tp):
                reqs.append(
                    _engine_request(rows, partition, engine.get(part.source), part.index, rank, out_dtype, name)
                )
        return reqs

    def results(name: str, saved: SavedTensor, assembled: Iterator[torch.Tensor]) -> Iterator[tuple]:
        if engine is not None:
            for rank in range(engine_tp):
                yield name, rank, finish_part(next(assembled), saved.parts[0])
            return
        parts = [finish_part(next(assembled), part) for part in saved.parts]
        yield name, parts[0] if len(parts) == 1 else torch.cat(parts, dim=saved.dim)

    def size(saved: SavedTensor) -> int:
        nbytes = torch.Size(saved.shape).numel() * (dtype or saved.dtype).itemsize
        replicated = engine is not None and saved.parts[0].source not in engine
        return nbytes * (engine_tp if replicated else 1)

    tp_group = None if state is None else state.tp_group
    everyone = state is not None and (state.fsdp or bool(state.split_groups()))
    agree_group = (dist.group.WORLD if everyone else tp_group) if state is not None else None
    groups = {name: {holders(params[part.source], tp_group) for part in saved.parts} for name, saved in items}
    mixed = [name for name, held in groups.items() if len(held) > 1]
    if mixed:  # refused before any collective, on every rank alike
        raise NotImplementedError(
            f"autotp.export_weights: {mixed[0]} joins experts split over the EP group with "
            f"tensors split over TP; not supported"
        )
    sources = {name: saved.parts[0].source for name, saved in items}  # one expert's name: its experts tensor's stage
    gathers = Gathers(state, {name: held.pop() for name, held in groups.items()}, parts, sources)
    return _exported(items, size, requests, results, bucket_bytes, gathers, agree_group, local)


def exported_tensors(root: nn.Module, merge_lora: bool) -> tuple[dict, dict[str, torch.Tensor], Collected | None]:
    """What `export_weights` reads of `root` (PEFT's inner model): the checkpoint names' state-dict keys and LoRA
    paths (`base_keys`), the tensors by name, and where the model is held in parts every part's (collective over
    their ranks: `Dimension.collect`)."""
    raw = root.state_dict(keep_vars=True)
    keys = base_keys(root, list(raw), copies=merge_lora)
    params = {name: raw[key] for name, (key, _) in keys.items()}
    parts = collected(root, params, find_state(root))
    return keys, params if parts is None else dict(parts.params), parts


def _loras_by_tensor(
    root: nn.Module, keys: dict[str, tuple[str, str | None]], params: dict[str, torch.Tensor]
) -> dict[str, list[nn.Module]]:
    """Name -> the LoRA layers whose base weight is that tensor, under every name the tensor has: a tied LM head's
    adapter merges into the embedding, the name transformers keeps for the pair (`merge_and_unload` merges in place
    into the one shared tensor)."""
    by_tensor: dict[int, list[nn.Module]] = {}
    for name, (_, path) in keys.items():
        if path is not None:
            by_tensor.setdefault(id(params[name]), []).append(root.get_submodule(path))
    return {name: by_tensor[id(tensor)] for name, tensor in params.items() if id(tensor) in by_tensor}


def check_bucket_bytes(bucket_bytes: int, caller: str) -> None:
    """Refuse a bucket size of no bytes, before anything runs: every tensor would go in a bucket of its own, one
    message each, silently."""
    if not bucket_bytes > 0:
        raise ValueError(
            f"{caller}(bucket_bytes={bucket_bytes!r}): the bucket size must be a positive number of "
            f"bytes, for example 256 << 20 (256 MiB, the default)"
        )


def _exported(items: list, size, requests, results, bucket_bytes: int, gathers, agree_group, local) -> Iterator[tuple]:
    """The buckets, each opened by an agreement that every rank is still iterating, at the same export."""
    agreement = _Agreement(agree_group)
    done = False
    try:
        for bucket in _buckets(items, size, bucket_bytes, gathers.key):
            agreement(stopping=False)
            gathered = _dp_gathered(bucket, local)
            reqs = [r for name, saved in bucket for r in requests(name, saved, gathered)]
            del gathered
            assembled = gathers(bucket, reqs)
            del reqs
            if assembled is not None:
                for name, saved in bucket:
                    yield from results(name, saved, assembled)
            del assembled  # this bucket's received bytes, before the next bucket's arrive
        agreement(stopping=False)
        done = True
    except GeneratorExit:
        if not done:
            agreement(stopping=True)  # the other ranks wait in the next agreement: tell them
        raise
    finally:
        agreement.finish()


def _buckets(items: list, size, bucket_bytes: int, key) -> Iterator[list]:
    """Consecutive runs of `items` of about `bucket_bytes` (`size` of each), as `collectives.buckets` cuts tensors;
    a bucket holds items of one `key(name)` only (one group gathers it)."""
    for _, same_key in itertools.groupby(items, key=lambda item: key(item[0])):
        run = list(same_key)
        stand_ins = [torch.empty(size(saved), dtype=torch.uint8, device="meta") for _, saved in run]
        index = {id(t): i for i, t in enumerate(stand_ins)}
        for cut in buckets(stand_ins, bucket_bytes):
            yield [run[index[id(t)]] for t in cut]


def _dp_gathered(bucket: list, local) -> dict[str, torch.Tensor]:
    """Under FSDP: the whole TP shard of every model tensor the bucket reads whole (not one expert's rows, which
    `local_part` fetches from the DP rank holding them), gathered over DP in one all-gather per dtype."""
    sources = list(
        dict.fromkeys(
            part.source for _, saved in bucket for part in saved.parts if not part.index or part.index[0] is None
        )
    )
    tensors = [local(source) for source in sources]
    if not any(isinstance(t, DTensor) for t in tensors):
        return {}
    return dict(zip(sources, dp_full_many(tensors)))


_started: dict[tuple[int, ...], int] = {}  # an agreement group's ranks -> exports started over it in this process
_open: dict[tuple[int, ...], set] = {}  # an agreement group's ranks -> its exports started and not finished here


class _Agreement:
    """Every bucket opens with one all-reduce over `group` of each rank's (stopping?, export, bucket): the ranks
    started exports over the group in the same order, so they number them alike. A rank that stopped iterating makes
    the others raise. So does a rank at another export or bucket: two exports iterated together (`zip()`), where a
    rank that yields nothing runs each one to its end inside one `next()`, would otherwise send one export's gathers
    against another's. That raises on every rank at once, and this rank's other open exports over the group then
    close without a collective (the others no longer wait in them)."""

    def __init__(self, group) -> None:
        self.group = None if group is None or dist.get_world_size(group) == 1 else group
        self.at, self.broken = 0, False
        if self.group is None:
            return
        self.key = tuple(dist.get_process_group_ranks(self.group))
        self.serial = _started.get(self.key, 0)
        _started[self.key] = self.serial + 1
        _open.setdefault(self.key, set()).add(self)

    def __call__(self, stopping: bool) -> None:
        if self.group is None or self.broken:
            return
        group = self.group
        rows = torch.zeros(dist.get_world_size(group), 3, dtype=torch.int64, device=device_of(group))
        rows[dist.get_rank(group)] = torch.tensor([int(stopping), self.serial, self.at])
        all_reduce(rows, group)
        where = [
            (dist.get_global_rank(group, r), flag, serial, at) for r, (flag, serial, at) in enumerate(rows.tolist())
        ]
        self.at += 1
        if any((serial, at) != (where[0][2], where[0][3]) for _, _, serial, at in where):
            for run in _open[self.key]:
                run.broken = True
            _started[self.key] = max(serial for _, _, serial, _ in where) + 1  # the next export: one number again
            places = ", ".join(f"rank {rank} at export #{serial} bucket {at}" for rank, _, serial, at in where)
            raise RuntimeError(
                f"autotp.export_weights: the ranks are at different exports ({places}): two exports "
                f"were iterated together (zip(), or one inside the other's loop). A rank that gets "
                f"no tensors runs an export to its end in one next(), so the ranks' gathers would "
                f"not match. Iterate one export to its end before the next (list() it first)"
            )
        stopped = [rank for rank, flag, _, _ in where if flag]
        if stopped and not stopping:
            raise RuntimeError(
                f"autotp.export_weights: rank(s) {stopped} stopped iterating before the end; every "
                f"rank taking part must exhaust the iterator (the others would wait for it forever)"
            )

    def finish(self) -> None:
        if self.group is not None:
            _open[self.key].discard(self)


def _engine_request(
    rows: torch.Tensor,
    partition: Partition | None,
    engine: Partition | None,
    index: tuple,
    rank: int,
    dtype: torch.dtype,
    name: str,
) -> RowRequest:
    """Engine rank `rank`'s rows of a part (`rows` this trainer rank's, cut by `local_part`)."""
    if engine is None:
        return RowRequest(rows, partition, None, dtype)
    run = index[engine.dim] if engine.dim < len(index) else None
    if run is not None:
        engine = window(engine, *((run, 1) if isinstance(run, int) else run))
    if partition is not None and partition.dim != engine.dim:
        raise NotImplementedError(
            f"autotp.export_weights(target=...): {name} is split on dim {partition.dim} here and "
            f"on dim {engine.dim} at the engine's tp_size; not supported"
        )
    return RowRequest(rows, partition, engine.runs[rank], dtype, dim=engine.dim)


def export_adapters(
    model: nn.Module, *, adapter_name: str = "default", dtype: torch.dtype | None = None, bucket_bytes: int = 256 << 20
) -> Iterator[tuple[str, torch.Tensor]]:
    """PEFT adapter `adapter_name` of the `PeftModel` `model` as `(name, tensor)` under PEFT's saved names (what its
    `save_pretrained` writes, full size), for engines that take LoRA adapters beside `export_weights(merge_lora=False)`.
    Iterated like `export_weights`: on every TP rank, to the end; TP rank 0 gets the tensors."""
    check_bucket_bytes(bucket_bytes, "autotp.export_adapters")
    model = outside_module_holders(model)
    root = peft_inner(model)
    state = find_state(root)
    if state is not None and state.tp_group is not None:
        adapt_all(root, state)
    tensors = adapter_state_dict(model, model.state_dict(keep_vars=True), adapter_name)
    items = [(name, SavedTensor((), 0, full_shape(t), t.dtype, (0, 0))) for name, t in tensors.items()]

    def requests(name: str, _: SavedTensor, __: dict) -> list[RowRequest]:
        tensor = tensors[name].detach()
        shard = held_shard(tensors[name])
        return [RowRequest(tensor, None if shard is None else shard.partition, None, dtype or tensor.dtype)]

    def results(name: str, _: SavedTensor, assembled: Iterator[torch.Tensor]) -> Iterator[tuple]:
        yield name, next(assembled)

    def size(entry: SavedTensor) -> int:
        return torch.Size(entry.shape).numel() * (dtype or entry.dtype).itemsize

    tp_group = None if state is None else state.tp_group
    gathers = Gathers(None, {name: tp_group for name in tensors})
    return _exported(items, size, requests, results, bucket_bytes, gathers, tp_group, lambda name: tensors[name])
