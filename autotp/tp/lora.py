"""LoRA on sharded layers: PEFT's `lora.Linear` around an autotp layer, made tensor-parallel in place.

Column layer (`LinearLayer`, weight split by output rows):
    lora_A replicated, lora_B split by the base weight's rows (fused and replicated-KV layouts included).
    The input enters the TP span once for the base layer and every adapter, and lora_A's weight
    enters with it: its gradient (partial, as each rank sees only its rows of lora_B) is summed in the
    same backward all-reduce as dL/dX, which the block's sibling layers share.
Row layer (`LinearAllreduce`, weight split by input columns):
    lora_A split by the base weight's columns, lora_B replicated. The base output and lora_A's output
    are both partial; one all-reduce sums them together, then the bias and lora_B apply on full
    values, so lora_B's gradient is whole on every rank.
A block thus keeps one all-reduce forward and one backward, as without LoRA (one per dtype: fp32
adapters on a bf16 model, PEFT's default, add one of the adapter's small tensors).

The LoRA layer runs autotp's forward (`TPLora.forward`, PEFT's computation for plain LoRA with the
collectives placed as above); inside `GatherReplacedLayerParams` it runs PEFT's own on full weights.
After `wrap`, PEFT builds each adapter around a sharded layer at the layer's full size, as one process
does (`build_adapter`, around PEFT's `update_layer` while a wrapped model lives): the same shapes draw the
same values and leave the random stream where one process leaves it. The adapter is split at once, so
no one sees it at the shard's size. What PEFT builds otherwise (a variant, or inside
GatherReplacedLayerParams) is adapted or refused when its block next runs (the guard on each block sees
the swap); anything else PEFT puts around a sharded layer is refused by that guard. LoRA put on before
`wrap` is handled by `autotp.tp.lora_lift`.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ..compat import peft as peft_compat
from ..planning.sharding import Partition, Shard
from ..runtime.collectives import reduce_from_tp_joined
from ..runtime.grad_hooks import GradHook, replica_grad_hook
from ..runtime.replicas import broadcast_tensors
from ..runtime.shards import gather_parameter_, partition_parameter_
from ..state import TPState, state_of
from .layers import LinearAllreduce, LinearLayer, ParallelLinear
from .streams import shared_draws


def is_lora_linear(module: nn.Module | None, layer: nn.Module) -> bool:
    """Whether `module` is PEFT's LoRA `Linear` wrapped directly around the autotp `layer`."""
    return peft_compat.is_lora_linear(module) and getattr(module, "base_layer", None) is layer


class TPLora:
    """One PEFT `lora.Linear` around one autotp layer: its hooks, and its adapters' shards (gather_/partition_)."""

    def __init__(self, lora: nn.Module, layer: ParallelLinear, path: str, state: TPState):
        self.lora, self.layer, self.path, self.state = lora, layer, path, state
        self.column = isinstance(layer, LinearLayer)
        self.adapted: set[str] = set()
        self.hooks: list[GradHook] = []
        lora.forward = self.forward  # this instance's forward; PEFT's class keeps its own
        if not self.column:
            layer.reduce_output = False  # its partial output is reduced together with the adapter's
        layer.autotp_lora = lora.autotp_lora = self
        state.regions.append(self)

    def release(self) -> None:
        """The base layer is back in its slot (PEFT's merge_and_unload or unload): it reduces its own output again."""
        vars(self.lora).pop("forward", None)
        for hook in self.hooks:
            hook.remove()
        if self.column:
            self.layer.entry.unjoin([m.weight for m in self.lora.lora_A.values()])
        else:
            self.layer.reduce_output = True
        del self.layer.autotp_lora
        self.state.regions.remove(self)

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """PEFT's `lora.Linear.forward` for plain LoRA, with one all-reduce for the layer and its adapters."""
        lora = self.lora
        peft_compat.check_forward_args(lora, x, *args, **kwargs)
        if kwargs.get("adapter_names") is not None:
            return self._mixed_batch(x, *args, **kwargs)
        if lora.disable_adapters and lora.merged:
            lora.unmerge()
        active = [] if lora.disable_adapters or lora.merged else [n for n in lora.active_adapters if n in lora.lora_A]
        return self._column(x, active, args, kwargs) if self.column else self._row(x, active, args, kwargs)

    def _mixed_batch(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """PEFT's mixed-adapter batches (`adapter_names`, evaluation only): PEFT's forward on the replicated input of a
        column layer; on a row layer every term is partial, so its sum is reduced once, then the bias added."""
        if torch.is_grad_enabled() and any(p.requires_grad for p in self.lora.parameters()):
            raise NotImplementedError(
                f"autotp: {self.path}: PEFT's mixed-adapter batches (adapter_names=...) run "
                f"under torch.no_grad() only with tensor parallelism"
            )
        if self.column:
            return type(self.lora).forward(self.lora, self.layer.entry(x), *args, **kwargs)
        (result,) = reduce_from_tp_joined([type(self.lora).forward(self.lora, x, *args, **kwargs)], self.layer.group)
        return result if self.layer.bias is None else result + self.layer.bias

    def _column(self, x: torch.Tensor, active: list[str], args: tuple, kwargs: dict) -> torch.Tensor:
        """The input is replicated: its LoRA dropout draws from the shared stream, the masks one process draws."""
        entry = self.layer.entry
        x = entry(x)
        result = self.layer(x, *args, **kwargs)
        dtype = result.dtype
        for name in active:
            a = self.lora.lora_A[name]
            with shared_draws(self.layer):
                dropped = self.lora.lora_dropout[name](peft_compat.cast_input_dtype(self.lora, x, a.weight.dtype))
            h = F.linear(dropped, entry.weight(a.weight), a.bias)
            result = result + self.lora.lora_B[name](h) * self.lora.scaling[name]
        return result.to(dtype)

    def _row(self, x: torch.Tensor, active: list[str], args: tuple, kwargs: dict) -> torch.Tensor:
        partial = self.layer(x, *args, **kwargs)
        dtype = partial.dtype
        hs = []
        for name in active:
            a = self.lora.lora_A[name]
            hs.append(a(self._dropout_columns(name, peft_compat.cast_input_dtype(self.lora, x, a.weight.dtype))))
        result, *hs = reduce_from_tp_joined([partial, *hs], self.layer.group)
        if self.layer.bias is not None:
            result = result + self.layer.bias
        for name, h in zip(active, hs):
            result = result + self.lora.lora_B[name](h) * self.lora.scaling[name]
        return result.to(dtype)

    def _dropout_columns(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """LoRA dropout on this rank's input columns: its columns of the mask one process draws for the full input
        (drawn whole from the shared stream), so the ranks' masks are one mask, not copies of one pattern."""
        dropout = self.lora.lora_dropout[name]
        if not (isinstance(dropout, nn.Dropout) and dropout.training and dropout.p > 0):
            return dropout(x)
        cols = self.layer.partition.with_dim(1)  # lora_A's, split like the row layer's columns
        with shared_draws(self.layer):
            mask = dropout(x.new_ones(*x.shape[:-1], cols.full_size))
        return x * cols.with_dim(x.ndim - 1).shard(mask, self.layer.tp_rank)

    def adapt_new(self, full: bool = False) -> None:
        """Shard and synchronise the adapters PEFT added since the last call (collective over TP).

        `full`: the adapters hold the whole layer's values (PEFT before wrap, or `build_adapter`'s full-size draw):
        TP rank 0's are split, not redrawn.
        """
        for name in [n for n in self.lora.lora_A if n not in self.adapted]:
            self._refuse(name)
            if full:
                self._share(name)
            a, b = self.lora.lora_A[name].weight, self.lora.lora_B[name].weight
            if self.column:
                self._adapt_column(a, b, full)
            else:
                self._adapt_row(a, b, full)
            self.adapted.add(name)
        self.lora.in_features, self.lora.out_features = self.layer.in_features, self.layer.out_features

    def _share(self, name: str) -> None:
        """TP rank 0's full adapter on every rank, so that the parts the ranks keep are parts of one adapter (the one
        a process seeded as TP rank 0 draws), whatever each rank drew."""
        params = []
        for half in ("lora_A", "lora_B"):
            partition = adapter_partition(self.layer, half)
            for param in getattr(self.lora, half)[name].parameters():
                if partition is not None and param.shape[partition.dim] != partition.full_size:
                    raise RuntimeError(
                        f"autotp: LoRA on {self.path} holds a tensor of shape {tuple(param.shape)}; dim "
                        f"{partition.dim} should be the layer's full {partition.full_size}"
                    )
                params.append(param)
        broadcast_tensors(params, self.layer.group)

    def _refuse(self, name: str) -> None:
        where = f"autotp: LoRA adapter {name!r} on {self.path}"
        if name in getattr(self.lora, "lora_variant", {}):
            variant = type(self.lora.lora_variant[name]).__name__
            raise NotImplementedError(
                f"{where} uses {variant} (DoRA or another LoRA variant), which autotp does not "
                f"shard yet; use plain LoRA"
            )
        if self.state.is_gathered():
            raise RuntimeError(f"{where} was added inside GatherReplacedLayerParams; add adapters outside it")
        if self.layer.sequence_parallel:
            raise NotImplementedError(
                f"{where}: LoRA with sequence parallelism is not supported yet; wrap with sequence_parallel=False"
            )
        if not self.column and self.lora.lora_B[name].bias is not None:
            raise NotImplementedError(
                f"{where}: lora_bias on a row-parallel layer would be added once per rank; use lora_bias=False"
            )

    def _adapt_column(self, a: nn.Parameter, b: nn.Parameter, full: bool) -> None:
        """lora_A replicated (same on every rank, gradient summed); lora_B split like the base weight's rows."""
        rows = self.layer.partition.with_dim(0)
        for param in self.lora.lora_B[self._name_of(b)].parameters():  # lora_bias too
            self._split(param, rows, full)
        self._replicate(a, 1, self.layer.full_in, shared=full)
        self.layer.entry.join(a)  # its gradient is summed with the input's (BlockEntry.weight)
        if rows.replicas(self.layer.tp_rank):  # replicated KV rows: summed over their holders, as the base weight's
            owner = self.lora.lora_B[self._name_of(b)]
            self.hooks.append(
                GradHook(
                    owner,
                    b,
                    self.state.sharded_only(replica_grad_hook(rows, self.layer.tp_rank, self.state.replica_groups)),
                )
            )

    def _adapt_row(self, a: nn.Parameter, b: nn.Parameter, full: bool) -> None:
        """lora_A split like the base weight's columns, drawn as PEFT draws it over the full width; lora_B replicated."""
        cols = self.layer.partition.with_dim(1)
        self._split(a, cols, full)
        loaded = self._name_of(b) in getattr(self.lora, "autotp_loaded", ())
        if not full and not loaded and not b.detach().any():  # PEFT's init at the shard's width: redraw A at full width
            drawn = torch.empty(a.shape[0], cols.full_size, dtype=a.dtype, device=a.device)
            nn.init.kaiming_uniform_(drawn, a=math.sqrt(5))
            broadcast_tensors([drawn], self.layer.group)
            with torch.no_grad():
                a.copy_(cols.shard(drawn, self.layer.tp_rank))
        self._replicate(b, 0, self.layer.full_out, shared=full)

    def _split(self, param: nn.Parameter, partition: Partition, full: bool) -> None:
        """`param` held as this rank's part along `partition.dim` (cut from its full values when `full`), tagged."""
        rank, dim = self.layer.tp_rank, partition.dim
        if full:
            param.data = partition.shard(param.detach(), rank)
        if param.shape[dim] != partition.local_size(rank):
            raise RuntimeError(
                f"autotp: LoRA on {self.path} holds a tensor of shape {tuple(param.shape)}; dim {dim} "
                f"should be this rank's {partition.local_size(rank)} of {partition.full_size}"
            )
        param.autotp_shard = Shard(partition, rank)

    def _replicate(self, param: nn.Parameter, dim: int, size: int, shared: bool) -> None:
        """`param` the same on every TP rank (TP rank 0's values, broadcast unless `shared` already); the forward
        keeps its gradient whole on each."""
        if param.shape[dim] != size:
            raise RuntimeError(
                f"autotp: LoRA on {self.path} holds a tensor of shape {tuple(param.shape)}; dim {dim} "
                f"should be the layer's full {size}"
            )
        if not shared:
            broadcast_tensors([param], self.layer.group)

    def _name_of(self, b: nn.Parameter) -> str:
        return next(n for n, m in self.lora.lora_B.items() if m.weight is b)

    def _sharded(self) -> list[nn.Parameter]:
        return [
            p
            for m in (*self.lora.lora_A.values(), *self.lora.lora_B.values())
            for p in m.parameters()
            if hasattr(p, "autotp_shard")
        ]

    def gather_(self) -> None:
        """Full adapter weights, as for the base layer (GatherReplacedLayerParams, saving); PEFT's own forward runs."""
        for param in self._sharded():
            gather_parameter_(param, self.layer.group)
        vars(self.lora).pop("forward", None)

    def partition_(self) -> None:
        for param in self._sharded():
            partition_parameter_(param)
        self.lora.forward = self.forward


def adapter_partition(layer: ParallelLinear, half: str) -> Partition | None:
    """How `half` ("lora_A" or "lora_B", weight and bias) of a LoRA around `layer` is split; None: replicated."""
    if isinstance(layer, LinearLayer):
        return layer.partition.with_dim(0) if half == "lora_B" else None
    return layer.partition.with_dim(1) if half == "lora_A" else None


def sharded_loras(model: nn.Module) -> Iterator[tuple[str, nn.Module, ParallelLinear]]:
    """(path, PEFT LoRA layer, the sharded layer it wraps) for every LoRA around a split autotp linear in `model`."""
    for path, module in model.named_modules():
        layer = getattr(module, "base_layer", None)
        if is_lora_linear(module, layer) and isinstance(layer, (LinearLayer, LinearAllreduce)) and layer.tp_size > 1:
            yield path, module, layer


def adapt_all(model: nn.Module, state: TPState) -> None:
    """Make every LoRA in `model` tensor-parallel now rather than at its block's next forward (collective over TP)."""
    for path, lora, layer in list(sharded_loras(model)):
        adapt(lora, layer, path, state)


def trainable_copies(module: nn.Module) -> list[ParallelLinear]:
    """The trainable copies PEFT's `modules_to_save` wrapper `module` holds of a sharded layer, when all are sharded
    alike (same partition, same group), so they train like the layer itself; [] for anything else."""
    if not peft_compat.is_modules_to_save(module):
        return []
    original = getattr(module, "original_module", None)
    copies = list(getattr(module, "modules_to_save", {}).values())
    if not isinstance(original, ParallelLinear) or original.tp_size == 1:
        return []
    alike = all(type(copy) is type(original) and copy.partition == original.partition for copy in copies)
    return copies if alike else []


def adapt(current: nn.Module | None, layer: ParallelLinear, path: str, state: TPState) -> bool:
    """Make PEFT's LoRA around `layer` (`current` holds its slot) tensor-parallel; False if `current` is something
    else. The layer itself back in its slot releases the LoRA that held it."""
    if current is layer:
        if hasattr(layer, "autotp_lora"):
            layer.autotp_lora.release()
        return True
    if state.fsdp and peft_compat.is_peft_module(current):
        raise NotImplementedError(
            f"autotp: {path} was wrapped by PEFT ({type(current).__name__}) after "
            f"autotp.fully_shard; PEFT adapters under FSDP are not supported yet (FSDP would "
            f"not reduce their gradients over data parallelism). Train adapters under DDP over "
            f"autotp.dp_group, as AutoTPTrainer does"
        )
    if getattr(current, "original_module", None) is layer and trainable_copies(current):
        return True
    if not is_lora_linear(current, layer) or not isinstance(layer, (LinearLayer, LinearAllreduce)):
        return False
    tp_lora = getattr(current, "autotp_lora", None) or TPLora(current, layer, path, state)
    tp_lora.adapt_new()
    return True


RANDOM_INITS = (True, False, "gaussian")  # init_lora_weights that draw without reading the base weight


def build_adapter(request: peft_compat.AdapterRequest, build: Callable[[], None], models: Iterable[nn.Module]) -> None:
    """PEFT's `update_layer` (`build`) for an adapter around a sharded layer of one of `models`: drawn at the layer's
    full size, then split at once (collective over TP). Adapters that `adapt` refuses at the block's next forward
    are built as PEFT builds them; one computed from the layer's weight or inputs (PiSSA, EVA...), a shard here,
    is refused before PEFT builds it."""
    lora, layer = request.lora, getattr(request.lora, "base_layer", None)
    if request.modules_to_save:
        _refuse_copied_embedding(request, _locate(layer, models))
    if not (is_lora_linear(lora, layer) and isinstance(layer, (LinearLayer, LinearAllreduce)) and layer.tp_size > 1):
        return build()
    if (found := _locate(layer, models)) is None or _refused_later(request, layer, found[1]):
        return build()
    path, state = found
    if request.init not in RANDOM_INITS:
        raise NotImplementedError(
            f"autotp: LoRA adapter {request.name!r} on {path}: init_lora_weights="
            f"{request.init!r} computes the adapter from the layer's weight or inputs, which "
            f"are this rank's shard after wrap; call get_peft_model (and the init) before "
            f"autotp.wrap, or use init_lora_weights=True or 'gaussian'"
        )
    lora.in_features, lora.out_features = layer.full_in, layer.full_out  # what PEFT sizes the adapter by
    try:
        build()
    finally:
        lora.in_features, lora.out_features = layer.in_features, layer.out_features
    if any(p.is_meta for half in (lora.lora_A, lora.lora_B) for p in half[request.name].parameters()):
        _shrink(lora, layer, request.name)  # low_cpu_mem_usage: no values yet; adapted once loaded, at the forward
        return
    (getattr(lora, "autotp_lora", None) or TPLora(lora, layer, path, state)).adapt_new(full=True)


def _refuse_copied_embedding(request: peft_compat.AdapterRequest, found: tuple[str, TPState] | None) -> None:
    """PEFT's `modules_to_save` copies a module with `copy.deepcopy`; a copy of the vocab-parallel embedding would hold
    this rank's rows with no vocab-parallel lookup (PEFT fails to copy its process group). Refused at PEFT's first
    adapter, before it changes the model (it copies the modules once every adapter is built)."""
    state = None if found is None else found[1]
    embedding = None if state is None or state.plan.vocab is None else state.plan.vocab.embedding
    named = [n for n in request.modules_to_save if embedding and embedding.endswith(n)]
    if named:
        raise NotImplementedError(
            f"autotp: modules_to_save={list(request.modules_to_save)} asks PEFT for a trainable copy of {embedding}, "
            f"which autotp.wrap split by vocabulary (vocab parallelism); autotp does not shard such a copy yet. "
            f"Nothing was changed. Wrap with vocab_parallel=False (the embedding is then whole on every rank and its "
            f"copy trains as in one process), or leave {named[0]!r} out of modules_to_save (a copy of the LM head "
            f"works under vocab parallelism)"
        )


def _refused_later(request: peft_compat.AdapterRequest, layer: ParallelLinear, state: TPState) -> bool:
    """An adapter `TPLora._refuse` (or `adapt`, under FSDP) refuses at the block's next forward: built as before."""
    row_bias = request.bias and isinstance(layer, LinearAllreduce)
    return state.is_gathered() or state.fsdp or layer.sequence_parallel or row_bias or request.uses_variant()


def _locate(layer: nn.Module, models: Iterable[nn.Module]) -> tuple[str, TPState] | None:
    """The path of `layer` (its slot, when LoRA already wraps it) in one of the wrapped `models`, and its state."""
    for model in models:
        for path, module in model.named_modules():
            if module is layer:
                return path.removesuffix(".base_layer"), state_of(model)
    return None


def _shrink(lora: nn.Module, layer: ParallelLinear, name: str) -> None:
    """The split halves of an empty (meta) adapter at this rank's size, so loading cuts full tensors to fit."""
    for half in ("lora_A", "lora_B"):
        if (partition := adapter_partition(layer, half)) is not None:
            for param in getattr(lora, half)[name].parameters():
                param.data = partition.shard(param.detach(), layer.tp_rank)
