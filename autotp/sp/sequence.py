"""Sequence parallelism (Megatron-SP): the residual stream between blocks is split along the sequence.

Each attention / MLP block all-gathers its input along the sequence (its backward reduce-scatters
the gradient, which also does the column layers' gradient sum), and its row projection
reduce-scatters its output instead of all-reducing it. The decoder layers' own norms then work on
a sequence chunk, so their weight gradients are summed over TP. The first decoder layer's input is
split, and the last one's output gathered, so masks, positions and the LM head see the whole
sequence: HF models need no extra arguments.

A chunk is a rank's share of the tokens in memory order (Megatron splits its [seq, batch] layout the
same way), shaped [batch, seq / tp, hidden], so no collective copies: that is correct because what runs
between blocks (norms, residual adds, scaling) treats every token alike."""

from __future__ import annotations

import warnings
from contextlib import contextmanager, nullcontext
from typing import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..mesh import Group, group_size
from ..planning.plan import Plan
from ..runtime.grad_hooks import GradHook, grad_allreduce_hook
from ..runtime.process_hooks import patch_attribute
from ..runtime.seq_collectives import all_gather_seq_to_tp, gather_from_seq, own_chunk, scatter_to_seq
from ..tp.layers import LinearAllreduce


def sequence_layout(
    model: nn.Module, plan: Plan, experts: tuple[str, ...] = (), full: Plan | None = None
) -> tuple[str, list[str], list[str]]:
    """(decoder layer list path, block paths, names of the layer-level weights whose gradients are partial over TP)
    or a clear refusal: every weight between the sharded blocks must be per-channel (1-D), since that code sees one
    chunk of the sequence. `experts`: the experts modules expert parallelism splits (`autotp.ep`); their MoE blocks
    (router, top-k, token dispatch) are per-token code, so they run on the chunk too: the router's gradients are
    partial like the norms', the experts' are expert parallelism's to sync. `full`: the plan before the dimensions
    cut it; a decoder layer it shards and `plan` does not is another pipeline stage's (`autotp.pp`), not run here."""
    if plan.regions or plan.head_inputs:
        raise ValueError(
            "sequence_parallel supports dense attention and MLP blocks; this plan has MoE experts "
            "or per-head inputs (ALiBi)"
        )
    mixing = (
        [p.block for p in plan.params if not p.in_span] + [s.path for s in plan.states] + list(plan.gathered_outputs)
    )
    if mixing:  # a state-space mixer (`in_span`) mixes tokens after its column projection, on the gathered sequence
        mixer = mixing[0]
        raise ValueError(
            f"sequence_parallel supports dense attention and MLP blocks; this plan shards a token mixer or a gated "
            f"output ({mixer}), whose code mixes tokens or gates on the whole sequence; use sequence_parallel=False"
        )
    if plan.whole:  # a module kept whole inside a sharded block (an adapter's down-projection) would see one chunk
        raise ValueError(
            f"sequence_parallel supports dense attention and MLP blocks; this plan keeps {plan.whole[0]} whole inside "
            f"a sharded block, where it would see one chunk of the sequence; use sequence_parallel=False"
        )
    blocks = _blocks(plan)
    moe = tuple(f"{path.rpartition('.')[0]}." for path in experts)
    nested = [b for b in blocks if b.startswith(moe)]
    if nested:  # its gather and reduce-scatter would sit inside the MoE block, beside a router on the chunk
        raise ValueError(
            f"sequence_parallel at ep_size > 1 with a tensor-parallel block inside a MoE block "
            f"({nested[0]}: shared experts) is not supported; use sequence_parallel=False"
        )
    lists = {b.rsplit(".", 2)[0] for b in blocks}
    if len(lists) != 1 or not isinstance(model.get_submodule(next(iter(lists))), nn.ModuleList):
        raise ValueError(
            f"sequence_parallel needs every sharded block directly inside one list of decoder layers; "
            f"found blocks under {sorted(lists)}"
        )
    list_path = next(iter(lists))
    inside = {name for b in blocks for name, _ in model.get_submodule(b).named_parameters(prefix=b)}
    moe = tuple(prefix for prefix in moe if prefix.count(".") > list_path.count(".") + 2)  # not a whole layer
    split = tuple(f"{path}." for path in experts)
    if full is not None:  # the layers other pipeline stages run
        ours = {b.rsplit(".", 1)[0] for b in blocks}
        split += tuple(f"{layer}." for layer in {b.rsplit(".", 1)[0] for b in _blocks(full)} - ours)
    outside = [
        (name, p)
        for name, p in model.get_submodule(list_path).named_parameters(prefix=list_path)
        if name not in inside and not name.startswith(split)
    ]
    mixers = [f"{name} {list(p.shape)}" for name, p in outside if p.dim() > 1 and not name.startswith(moe)]
    if mixers:  # a replicated attention, MLP, convolution or state-space mixer would see one chunk of the sequence
        raise ValueError(
            f"sequence_parallel runs what sits between the sharded blocks on a chunk of the sequence, which is right "
            f"only for per-token code (norms, residual adds, scales); these weights there are not: "
            f"{', '.join(mixers[:4])}{f' and {len(mixers) - 4} more' if len(mixers) > 4 else ''}. Their modules are "
            f"left replicated by the plan (see `autotp plan`); use sequence_parallel=False"
        )
    return list_path, blocks, [name for name, _ in outside]


def _blocks(plan: Plan) -> list[str]:
    """The sharded attention and MLP blocks of `plan`'s decoder layers."""
    return sorted(
        {layer.block for layer in plan.layers if layer.block and (plan.vocab is None or layer.path != plan.vocab.head)}
    )


def apply_sequence_parallel(
    model: nn.Module, plan: Plan, group: Group, state, experts: tuple[str, ...] = (), full: Plan | None = None
) -> list[GradHook | LayerScope]:
    """Install the sequence split; returns what `remove()` undoes it on the layers (their scopes) and on the tensors
    (the gradient hooks on the layers' own norms and row biases)."""
    list_path, blocks, norms = sequence_layout(model, plan, experts, full)
    layers = model.get_submodule(list_path)
    chunked = Chunked()
    dropout = ChunkDropout(
        chunked, group, _config_dropout(model.config), [m for m in layers.modules() if isinstance(m, nn.Dropout)]
    )
    only = state.sharded_only  # gathered, the model computes as the original: none of these hooks acts
    whole = WholeHiddenStates(group)
    layers[0].register_forward_pre_hook(only(_on_hidden(whole.scatter)), with_kwargs=True)
    base = model.get_submodule(list_path.rpartition(".")[0])  # the model holding the layer list returns hidden_states
    base.register_forward_hook(only(whole.gather_outputs))
    scopes = [LayerScope(layer, chunked, dropout, state) for layer in layers]
    layers[-1].register_forward_hook(only(_on_output(lambda x: gather_from_seq(x, group))))
    layers[-1].register_forward_hook(only(chunked.hook(False)))
    for path in blocks:  # its layers were built sequence-parallel (apply_plan)
        block = model.get_submodule(path)
        block.register_forward_pre_hook(only(_on_hidden(lambda x: all_gather_seq_to_tp(x, group))), with_kwargs=True)
        block.register_forward_pre_hook(only(chunked.hook(False)))
        for module in block.modules():
            if isinstance(module, LinearAllreduce):
                module.register_forward_hook(only(chunked.hook(True)))  # after the sharded stream's restore
    # The layers' norms, and the row layers' biases (added to a chunk after the reduce-scatter), see one chunk's
    # tokens: their gradients are partial sums, completed over TP.
    partial = [(model.get_submodule(name.rpartition(".")[0]), model.get_parameter(name)) for name in norms]
    partial += [
        (m, m.bias)
        for path in blocks
        for m in model.get_submodule(path).modules()
        if isinstance(m, LinearAllreduce) and m.bias is not None
    ]
    return [*scopes, *(GradHook(owner, param, only(grad_allreduce_hook(group))) for owner, param in partial)]


class WholeHiddenStates:
    """The hidden states HF collects for `output_hidden_states=True` (and, at ep_size > 1, the routers' logits for the
    load-balancing loss) are the decoder layers' inputs and outputs, which under sequence parallelism are this rank's
    chunks (token-major, so not even a batch of samples): they are
    gathered back into whole sequences, differentiably, before the user sees them. The whole input's shape is
    recorded as the first layer splits it, so a chunk is told by its shape."""

    def __init__(self, group: Group):
        self.group = group
        self.chunk_shape: torch.Size | None = None

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        chunk = scatter_to_seq(x, self.group)
        self.chunk_shape = chunk.shape
        return chunk

    def gather_outputs(self, module: nn.Module, args, output):
        if isinstance(output, dict):  # a ModelOutput: its hidden-state tuples (hidden_states, decoder_hidden_states...)
            for key in [k for k in output.keys() if k.endswith("hidden_states") and k != "last_hidden_state"]:
                output[key] = self._whole(output[key])
            if isinstance(output.get("router_logits"), tuple):  # EP's routers ran on the chunk: the aux loss reads all
                output["router_logits"] = self._whole_rows(output["router_logits"])
            return output
        if isinstance(output, tuple):  # return_dict=False: the hidden-state tuples are tuples of tensors
            return tuple(self._whole(item) if isinstance(item, tuple) else item for item in output)
        return None

    def _whole(self, states):
        if not isinstance(states, tuple) or self.chunk_shape is None:
            return states
        return tuple(
            gather_from_seq(h, self.group) if torch.is_tensor(h) and h.shape == self.chunk_shape else h for h in states
        )

    def _whole_rows(self, logits: tuple) -> tuple:
        """Per-token rows of the chunk's tokens ([tokens, ...]: the routers' logits), gathered into the whole batch's;
        the backward keeps this rank's rows, as every TP rank computes the same loss from them."""
        rows = None if self.chunk_shape is None else self.chunk_shape[0] * self.chunk_shape[1]
        return tuple(
            gather_from_seq(x, self.group, 0) if torch.is_tensor(x) and x.shape[0] == rows else x for x in logits
        )


class Chunked:
    """Whether the hidden states now flowing are this rank's chunk: on at each decoder layer's start (`LayerScope`) and
    after each row layer's reduce-scatter, off at each block's gather and after the last layer, so a checkpointed
    layer's recomputation sets it the same way."""

    def __init__(self):
        self.on = False

    def hook(self, on: bool):
        def set_on(module: nn.Module, *_) -> None:
            self.on = on

        return set_on


class LayerScope:
    """Runs a decoder layer's own `forward` with its input marked a chunk and, in training, under `ChunkDropout`.

    HF checkpoints a layer's `forward`, not its `__call__` (`GradientCheckpointingLayer`), so forward hooks on the
    layer do not run when backward recomputes it: a recomputation without the dropout mode draws chunk-size masks,
    unlike the forward, and the gradients are wrong. The layer is given a subclass of its class whose `forward` opens
    this scope, which HF's checkpointing then wraps like the original's (only the outermost `forward` checkpoints, as
    for FSDP2's subclass); `remove()` gives the layer its class back."""

    def __init__(self, layer: nn.Module, chunked: Chunked, dropout: ChunkDropout, state):
        self.layer, self.chunked, self.dropout, self.state = layer, chunked, dropout, state
        self.original = type(layer)
        layer.autotp_sequence_scope = self
        self.scoped = patch_attribute(layer, "__class__", _scoped_class(self.original))

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if self.state.is_gathered():  # the model computes as the original
            yield
            return
        self.chunked.on = True
        with self.dropout if self.layer.training and self.dropout.can_drop() else nullcontext():
            yield

    def remove(self) -> None:
        self.scoped.remove()
        del self.layer.autotp_sequence_scope


_SCOPED: dict[type, type] = {}


def _scoped_class(cls: type) -> type:
    """`cls` with a `forward` that runs the original inside the instance's `LayerScope` (one subclass per class), and
    hook registration that warns when a user's hook would see a chunk."""
    if cls not in _SCOPED:

        def forward(self, *args, **kwargs):
            with self.autotp_sequence_scope():
                return cls.forward(self, *args, **kwargs)

        def register_forward_hook(self, hook, *args, **kwargs):
            _warn_chunk_hook(cls, hook)
            return cls.register_forward_hook(self, hook, *args, **kwargs)

        def register_forward_pre_hook(self, hook, *args, **kwargs):
            _warn_chunk_hook(cls, hook)
            return cls.register_forward_pre_hook(self, hook, *args, **kwargs)

        _SCOPED[cls] = type(
            cls.__name__,
            (cls,),
            {
                "forward": forward,
                "register_forward_hook": register_forward_hook,
                "register_forward_pre_hook": register_forward_pre_hook,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
            },
        )
    return _SCOPED[cls]


def _warn_chunk_hook(cls: type, hook) -> None:
    """A hook of the user's on a decoder layer sees this rank's chunk of the sequence: say so (transformers' own output
    recorders, torch's and autotp's hooks are fine: their outputs are gathered or are chunks by design)."""
    owner = getattr(hook, "__module__", None) or type(hook).__module__ or ""
    if owner.split(".")[0] not in ("transformers", "torch", "autotp", "accelerate", "peft"):
        warnings.warn(
            f"autotp: a hook on a {cls.__name__} under sequence_parallel sees this rank's chunk of the "
            f"sequence (token-major: its batch axis is not samples). Read output_hidden_states=True "
            f"(gathered into whole sequences) instead, or wrap with sequence_parallel=False",
            stacklevel=3,
        )


class ChunkDropout(TorchFunctionMode):
    """Dropout under sequence parallelism, `nn.Dropout` or `nn.functional.dropout` alike (StarCoder2 and Falcon call
    the function). On a chunk it draws the whole tensor's mask from the TP group's shared stream, as torch's dropout
    does, and keeps its own tokens' part: a chunk-size draw would give every rank the same mask. Elsewhere (the
    gathered block input, a TP span) it is torch's dropout.

    `LayerScope` enters it around each decoder layer's forward (recomputations included), in training and only where
    a dropout can be on (a dropout setting above 0 in the config, or an `nn.Dropout` whose p is): it sees every torch
    call there, a few microseconds each."""

    def __init__(self, chunked: Chunked, group: Group, config_dropout: bool, modules: list[nn.Dropout]):
        super().__init__()
        self.chunked, self.group, self.config_dropout, self.modules = chunked, group, config_dropout, modules

    def can_drop(self) -> bool:
        return self.config_dropout or any(m.p > 0 for m in self.modules)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.dropout and self.chunked.on:
            return self._on_chunk(*args, **kwargs)
        return func(*args, **kwargs)

    def _on_chunk(self, x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not (training and 0 < p < 1):
            return torch.nn.functional.dropout(x, p, training, inplace)
        whole = list(x.shape)
        whole[1] *= group_size(self.group)
        noise = x.new_empty(whole).bernoulli_(1 - p).div_(1 - p)
        return x * own_chunk(noise, self.group, 1, copy=False)


def _config_dropout(config) -> bool:
    """Whether any dropout probability in the config (its sub-configs included) is above 0."""

    def nonzero(values: dict) -> bool:
        return any(
            nonzero(v)
            if isinstance(v, dict)
            else (
                isinstance(k, str)
                and ("dropout" in k or "pdrop" in k)
                and isinstance(v, (int, float))
                and not isinstance(v, bool)
                and v > 0
            )
            for k, v in values.items()
        )

    return nonzero(config.to_dict())


def _on_hidden(fn):
    """Forward pre-hook applying `fn` to the hidden states (first positional or `hidden_states=`), wherever the
    same tensor is passed (CTRL's attention takes it as query, key and value)."""

    def hook(module, args, kwargs):
        x = args[0] if args and torch.is_tensor(args[0]) else kwargs.get("hidden_states")
        if not torch.is_tensor(x):
            return None
        y = fn(x)
        swap = lambda value: y if value is x else value  # noqa: E731
        return tuple(swap(a) for a in args), {key: swap(value) for key, value in kwargs.items()}

    return hook


def _on_output(fn):
    """Forward hook applying `fn` to a layer's hidden-state output (a tensor or a tuple's first item)."""

    def hook(module, args, output):
        if torch.is_tensor(output):
            return fn(output)
        return (fn(output[0]), *output[1:])

    return hook
