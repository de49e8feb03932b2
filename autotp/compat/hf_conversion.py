"""transformers' weight conversions, in one module: how a checkpoint's tensors become a model's on load, and back on save.

transformers renames keys, stacks MoE experts and concatenates projections while loading
(`transformers.conversion_mapping`, `transformers.core_model_loading`), and reverts all that when it
saves. autotp reads the same conversions: to read each rank's rows of a converted tensor
(`checkpoint_sources`), and to write what transformers writes, one cut at a time (`checkpoint_layout`).
Part of the transformers boundary (`autotp.compat.hf`), checked against the same versions.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, cast

import torch
import transformers
from torch import nn

from .hf import internal


def keys_to_ignore_on_save(model: nn.Module) -> set[str]:
    """State-dict keys transformers leaves out of a saved checkpoint."""
    return set(getattr(model, "_keys_to_ignore_on_save", None) or ())


def remove_tied_weights(state_dict: dict[str, torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without the tied aliases transformers leaves out of a checkpoint."""
    return internal("transformers.modeling_utils", "remove_tied_weights_from_state_dict")(state_dict, model)


@dataclass(frozen=True)
class SavedPart:
    """The part of model tensor `source` that (part of) a checkpoint tensor holds, as transformers' save cuts it.

    `index` has one entry per dim of `source`: None keeps the dim whole, (start, length) keeps a run, an int keeps
    one row and drops the dim (one expert of a fused experts tensor); `order` lists the kept dims of `source` in the
    order the checkpoint tensor holds them (a transpose).
    """

    source: str
    index: tuple[int | tuple[int, int] | None, ...]
    order: tuple[int, ...]

    @property
    def whole(self) -> bool:
        return all(i is None for i in self.index) and self.order == tuple(range(len(self.index)))

    def cut(self, full: torch.Tensor) -> torch.Tensor:
        """This part of `full` (the whole `source`), contiguous."""
        for dim in reversed(range(len(self.index))):  # last dim first: the earlier dims keep their numbers
            i = self.index[dim]
            full = full.select(dim, i) if isinstance(i, int) else full if i is None else full.narrow(dim, *i)
        kept = sorted(self.order)
        return full.permute([kept.index(d) for d in self.order]).contiguous()


@dataclass(frozen=True)
class SavedTensor:
    """One tensor of the checkpoint transformers' `save_pretrained` writes: `parts` concatenated along `dim`.

    `storage` (an id, its bytes) is the storage it shares in transformers' own save (every expert's tensor is a view
    of one fused tensor): the shard split sizes and places the tensors of one storage together, so ours must too.
    """

    parts: tuple[SavedPart, ...]
    dim: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def checkpoint_layout(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, SavedTensor]:
    """Checkpoint key -> how transformers' `save_pretrained` builds it from the model tensors `tensors` (meta tensors
    at full shape), in its order.

    transformers renames keys and converts tensors on save (fused MoE experts split into one tensor per expert,
    Mixtral's `mlp` written as `block_sparse_moe`). Its own reverse conversion runs here on meta stand-ins that record
    which rows each operation cuts, so names and cuts are transformers' for every family. An operation that is not a
    cut (a reshape, an interleave) raises, naming the tensor, the family and the operation.
    """
    revert = internal("transformers.core_model_loading", "revert_weight_conversion")
    traced = {key: _Traced.leaf(t, key) for key, t in tensors.items()}
    family = f"{getattr(getattr(model, 'config', None), 'model_type', '?')} ({type(model).__name__})"
    try:
        converted = revert(_FullShapes(model), traced)
    except Exception as err:
        raise NotImplementedError(
            f"transformers' save-time conversion of {family} failed on autotp's stand-ins "
            f"({type(err).__name__}: {err}); autotp.save_pretrained cannot write it"
        ) from err
    refused = [
        f"{key!r} through {getattr(t, 'unsupported', '') or 'an untracked tensor'}"
        for key, t in converted.items()
        if not isinstance(t, _Traced) or t.unsupported
    ]
    if refused:
        more = f" (and {len(refused) - 3} more)" if len(refused) > 3 else ""
        raise NotImplementedError(
            f"transformers builds {', '.join(refused[:3])}{more} of {family} when saving; "
            f"autotp.save_pretrained writes only cuts of model tensors (rows, experts, "
            f"transposes, concatenations), so it cannot stream this checkpoint"
        )
    out = {}
    for key, t in converted.items():
        parts = tuple(SavedPart(source, tuple(index), tuple(dims)) for source, index, dims in t.cuts)
        out[key] = SavedTensor(parts, t.cat_dim, tuple(t.shape), t.dtype, t.storage)
    return out


_STORAGE_IDS = itertools.count()
_VIEWS = ("narrow", "select", "transpose", "squeeze", "chunk", "split", "detach")


class _Traced(torch.Tensor):
    """A meta tensor that records how it was cut out of model tensors: `cuts` is [(source, index, dims)] (see
    `SavedPart`; dims: the source dim behind each dim of this tensor), concatenated along `cat_dim`; `storage` is its
    (id, bytes) as eager torch would share it; `unsupported` names the first operation that is not a cut."""

    cuts: list[tuple[str, list, list[int]]] = []
    cat_dim: int = 0
    storage: tuple[int, int] = (-1, 0)
    unsupported: str = ""

    @classmethod
    def leaf(cls, meta: torch.Tensor, source: str) -> _Traced:
        out = torch.Tensor._make_subclass(cls, meta.to("meta"))
        out.cuts = [(source, [None] * meta.dim(), list(range(meta.dim())))]
        out.storage = (next(_STORAGE_IDS), meta.nbytes)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = super().__torch_function__(func, types, args, kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, _Traced)]
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else (arg,))]
        inputs = [a for a in flat if isinstance(a, _Traced)]
        if not outs or not inputs:  # sizes, dtypes, comparisons of shapes
            return out
        name, source = getattr(func, "__name__", str(func)), inputs[0]
        view = name in _VIEWS or (name == "contiguous" and out is source)
        unsupported = next((t.unsupported for t in inputs if t.unsupported), "")
        for i, o in enumerate(outs):
            o.storage = source.storage if view else (next(_STORAGE_IDS), o.nbytes)
            try:
                o.cuts, o.cat_dim = _follow(name, source, args, kwargs, outs, i)
                o.unsupported = unsupported
            except (_NotACut, IndexError, TypeError):
                o.cuts, o.unsupported = [], unsupported or f"{name}()"
        return out


class _NotACut(Exception):
    pass


def _follow(name: str, source: _Traced, args: tuple, kwargs: dict, outs: list[_Traced], i: int) -> tuple[list, int]:
    """The cuts (and concatenation dim) of output `i` of torch's `name` on `args` (`source` the first tensor)."""

    def arg(k: int, key: str, default: Any = None) -> Any:
        return kwargs.get(key, args[k + 1] if k + 1 < len(args) else default)

    if name == "cat":
        dim = arg(0, "dim", 0) % source.dim()
        if not all(isinstance(t, _Traced) and (len(t.cuts) == 1 or t.cat_dim == dim) for t in args[0]):
            raise _NotACut
        return [c for t in args[0] for c in t.cuts], dim
    if len(source.cuts) != 1 or args[0] is not source:
        raise _NotACut
    (key, index, dims), ndim = source.cuts[0], source.dim()
    index, dims = list(index), list(dims)
    if name in ("chunk", "split"):
        dim = arg(1, "dim", 0) % ndim
        _narrow(index, dims[dim], sum(o.shape[dim] for o in outs[:i]), outs[i].shape[dim])
    elif name == "narrow":
        dim = arg(0, "dim") % ndim
        _narrow(index, dims[dim], arg(1, "start") % source.shape[dim], arg(2, "length"))
    elif name in ("select", "squeeze"):
        picked = (
            [arg(0, "dim") % ndim]
            if name == "select"
            else [d % ndim for d in _dims(arg(0, "dim"), ndim) if source.shape[d] == 1]
        )
        for d in sorted(picked, reverse=True):
            _narrow(index, dims[d], arg(1, "index", 0) % source.shape[d] if name == "select" else 0, 1)
            index[dims[d]] = index[dims[d]][0]
            del dims[d]
    elif name == "transpose":
        a, b = arg(0, "dim0") % ndim, arg(1, "dim1") % ndim
        dims[a], dims[b] = dims[b], dims[a]
    elif name not in ("contiguous", "clone", "detach"):
        raise _NotACut
    return [(key, index, dims)], 0


def _narrow(index: list, dim: int, start: int, length: int) -> None:
    before = index[dim]
    index[dim] = ((0 if before is None else before[0]) + start, length)


def _dims(dim: Any, ndim: int) -> list[int]:
    return list(range(ndim)) if dim is None else list(dim) if isinstance(dim, (tuple, list)) else [dim]


def initialised_if_missing(model: nn.Module, name: str, param: nn.Parameter, shape: torch.Size) -> torch.Tensor | None:
    """`name` at full `shape` as transformers makes it when a checkpoint leaves it out on purpose (a key matching the
    model's `_keys_to_ignore_on_load_missing`, such as Marian's sinusoidal positions), else None."""
    patterns = getattr(model, "_keys_to_ignore_on_load_missing", None) or ()
    if not any(re.search(p, name) for p in patterns):
        return None
    path, _, leaf = name.rpartition(".")
    module = model.get_submodule(path)
    fresh = nn.Parameter(torch.empty(shape, dtype=param.dtype), requires_grad=param.requires_grad)
    module._parameters[leaf] = fresh
    try:
        model._init_weights(module)
    finally:
        module._parameters[leaf] = param
    param.requires_grad_(_left_out_trainable(param))
    return fresh.detach()


def _left_out_trainable(param: nn.Parameter) -> bool:
    """Whether transformers' own load leaves a parameter the checkpoint leaves out trainable. From 5.24 it puts a plain
    tensor in its place (`modeling_utils._load_parameter_into_model`), which makes every floating-point one trainable,
    frozen in the model or not (Marian's sinusoidal positions); before, the model's own flag stayed."""
    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    return param.is_floating_point() if release >= (5, 24) else param.requires_grad


@dataclass(frozen=True)
class ConvertedSource:
    """A model tensor that transformers builds from several checkpoint tensors (or a part of one) while loading.

    `parts[j]` are the checkpoint keys matching the converter's `patterns[j]` (one per expert for MoE
    experts). With `run` None, the tensor is those keys stacked over the experts (dim 0) and, with several
    patterns (gate, up), concatenated along dim 1, so each rank can read its rows of each key. Otherwise
    `run` applies transformers' own operations to the whole tensors ({pattern: [tensor, ...]}) and
    returns this model tensor in full; `ops` names them.
    """

    parts: tuple[tuple[str, ...], ...]
    patterns: tuple[str, ...] = ()
    run: Callable[[dict[str, list[torch.Tensor]]], torch.Tensor] | None = None
    ops: str = ""


def checkpoint_sources(model: nn.Module, keys: Iterable[str]) -> dict[str, str | ConvertedSource]:
    """Model tensor name -> where transformers' own loading takes it from the checkpoint `keys`.

    A key stored under another name (a renamed module) maps to that key; tensors that transformers
    converts on load (MoE experts saved one per expert, fused projections saved apart, a fused one saved
    whole) map to a `ConvertedSource`. A transformers without this machinery (before 5.19) converts
    nothing, so every name maps to itself.
    """
    try:
        transforms = internal("transformers.conversion_mapping", "get_model_conversion_mapping")(model)
        rename = internal("transformers.core_model_loading", "rename_source_key")
        natural = internal("transformers.core_model_loading", "dot_natural_key")
        renaming = cast(type, internal("transformers.core_model_loading", "WeightRenaming"))  # a class
    except RuntimeError:
        return {key: key for key in keys}
    renamings = [t for t in transforms if isinstance(t, renaming)]  # subclasses too (offset indices, prefixes)
    converters = [t for t in transforms if not isinstance(t, renaming)]
    names = {name: True for name, _ in model.named_parameters(remove_duplicate=False)}
    names.update({name: True for name, _ in model.named_buffers(remove_duplicate=False)})
    out: dict[str, str | ConvertedSource] = {}
    fused: dict[str, dict[str, list[str]]] = {}
    for key in sorted(keys, key=natural):
        target, pattern = rename(key, renamings, converters, getattr(model, "base_model_prefix", None), names)
        if pattern is None and target not in names and key in names:
            target = key  # a rename meant for other modules (DeepSeek-V4's ".norm." -> ".kv_norm." hits model.norm)
        if pattern is None:
            out.setdefault(target, key)
        else:
            fused.setdefault(target, {}).setdefault(pattern, []).append(key)
    for target, by_pattern in fused.items():
        converter = next(c for c in converters if set(by_pattern) <= set(c.source_patterns))
        ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(converter, "operations", ())]
        parts = tuple(tuple(by_pattern.get(p, ())) for p in converter.source_patterns)
        stacked = [("MergeModulelist", 0)] + ([("Concatenate", 1)] if len(parts) > 1 else [])
        first = converter.target_patterns[0]
        for other in converter.target_patterns:  # several when one checkpoint tensor becomes several
            name = target.replace(first, other)
            run = None if ops == stacked else _conversion(converter, model, other, target)
            out.setdefault(
                name,
                ConvertedSource(
                    parts, tuple(converter.source_patterns), run, ", ".join(f"{op}(dim={dim})" for op, dim in ops)
                ),
            )
    return out


def _conversion(
    converter: Any, model: nn.Module, pattern: str, first: str
) -> Callable[[dict[str, list[torch.Tensor]]], torch.Tensor]:
    """transformers' operations of `converter` on whole checkpoint tensors, returning in full the model tensor of target
    pattern `pattern`. `first` is the model tensor of the converter's first target: transformers names the layer by
    it (`Split` finds each target's size by putting the target's pattern in place of the first's)."""

    def run(tensors: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        sources, targets = list(converter.source_patterns), list(converter.target_patterns)
        for op in converter.operations:
            tensors = op.convert(
                tensors,
                source_patterns=sources,
                target_patterns=targets,
                config=model.config,
                model=_FullShapes(model),
                full_layer_name=first,
            )
        return tensors[pattern]

    return run


class _FullShapes:
    """The model as transformers' conversions see it: parameters at their full shapes, not this rank's shard
    (Transpose(check_dims=True) and Split compare the checkpoint tensor with the parameter's shape)."""

    def __init__(self, model: nn.Module):
        self._model = model

    def get_parameter(self, name: str) -> torch.Tensor:
        param = self._model.get_parameter(name)
        region = getattr(param, "autotp_expert", None)  # an EP rank's experts (autotp.ep.dispatch.ExpertRegion)
        shard = getattr(param, "autotp_shard", None) if region is None else region.held(param)
        return param if shard is None else torch.empty(shard.full_shape(param.shape), device="meta")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)
