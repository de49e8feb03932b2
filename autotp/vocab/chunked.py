"""The LM head and the causal-LM loss over chunks of tokens: a training forward never holds its logits whole.

In a training forward with labels the head returns `PendingLogits`, a stand-in of the logits' shape that holds no
memory and keeps the head's input. The loss, given that stand-in (untouched, or multiplied, divided by a number or
through tanh: Gemma 2's softcap, Cohere's logit_scale), computes each chunk's logits, loss and gradients (the hidden
states' and the head's, Liger-style) in its forward and keeps only those gradients, O(tokens x hidden + vocab/tp x
hidden), for its backward. Any other use of the stand-in (LoRA's sum, a user reading `output.logits`) computes the
real logits through the head, differentiably, so it stays exact.

The head is a vocab-parallel `LinearLayer` (its loss the sharded `VocabParallelLoss`, three small all-reduces a chunk)
or, without vocab parallelism (at tp 1 too), a replicated `nn.Linear` whose model's causal-LM loss `WholeHeadLoss`
stands in for. The head's class is given a `forward` that returns the stand-in when armed: its instance `forward` is
left alone, which a gathered `ParallelLinear` and torchao's float8 layers own.
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..compat.hf import causal_lm_loss
from ..mesh import Group
from ..runtime import param_steps
from ..runtime.collectives import copy_to_tp
from ..runtime.lazy_logits import PendingLogits, lazy_logits, real_logits
from ..runtime.process_hooks import Patch, patch_attribute
from ..runtime.second_order import refuse_second_order
from ..tp.float8 import computes_float8
from ..tp.layers import ParallelLinear
from .layers import mean_loss, shard_grad_, shard_loss, shifted_targets


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed loss of `transform(hidden @ weight.T (+ bias))` against `target` on a vocab shard, chunk by chunk; each
    chunk's gradients for the hidden states, weight and bias are computed in the forward, so only they are kept: the
    backward scales them by the output's gradient.

    A half-precision head's are computed for the mean over the rows learnt from (1 / their count before the cast to
    the head's dtype, as one process's backward applies the mean's 1 / N to the logits' gradient): unscaled, an fp16
    head's gradient summed over many tokens overflows where one process's is finite. An fp32 head's are kept at unit
    scale, which rounds no differently."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        target: torch.Tensor,
        start: int,
        ignore_index: int,
        group: Group,
        chunk: int,
        transform: PendingLogits,
    ) -> torch.Tensor:
        total = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.zeros_like(hidden, dtype=torch.float32) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias = (
            torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        )
        ctx.count = (target != ignore_index).sum()
        ctx.prescaled = weight.dtype != torch.float32
        mean = 1 / ctx.count.clamp(min=1).float() if ctx.prescaled else 1.0
        for at in range(0, hidden.shape[0], chunk):
            h = hidden[at : at + chunk]
            raw = F.linear(h, weight, bias)
            logits = raw
            if transform.transforms:  # its gradient through the transforms by autograd, on this chunk only
                raw.requires_grad_()
                with torch.enable_grad():
                    logits = transform.transform(raw)
            loss, softmax, local, mine, valid = shard_loss(
                logits.detach(), target[at : at + chunk], start, ignore_index, group
            )
            total += (loss * valid).sum()
            # each row's share of the mean; 0 for rows not to learn from (a prompt, padding)
            dlogits = shard_grad_(softmax, local, mine).mul_(torch.where(valid, mean, 0).unsqueeze(-1))
            if transform.transforms:
                (dlogits,) = torch.autograd.grad(logits, raw, dlogits.to(logits.dtype))
            dlogits = dlogits.to(weight.dtype)  # the matmuls in the head's dtype, as its own backward runs them
            if grad_hidden is not None:
                grad_hidden[at : at + chunk] = dlogits @ weight
            if grad_weight is not None:  # summed over the chunks in fp32
                if weight.dtype == torch.float32:
                    grad_weight.addmm_(dlogits.t(), h)
                else:
                    grad_weight += dlogits.t() @ h
            if grad_bias is not None:
                grad_bias += dlogits.sum(0, dtype=torch.float32)
            del raw, logits, softmax, dlogits  # before the next chunk's: two chunks of logits at a time, not three
        ctx.save_for_backward(
            *(g.to(like.dtype) if g is not None else None for g, like in ((grad_hidden, hidden), (grad_weight, weight)))
        )
        ctx.grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)  # type: ignore[union-attr]
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_order(
            "the chunked loss, whose backward scales gradients computed in the forward",
            "wrap with loss_chunk=None for them",
        )
        grad_hidden, grad_weight = ctx.saved_tensors
        # prescaled gradients are the mean's: times the count; no row learnt from: all 0, whatever `grad` is (the mean
        # of no rows is NaN, its gradient infinite), as one process's are
        scale = torch.where(ctx.count > 0, grad * ctx.count if ctx.prescaled else grad, 0)
        scaled = [None if g is None else g * scale for g in (grad_hidden, grad_weight, ctx.grad_bias)]
        return (*scaled, None, None, None, None, None, None)


class ChunkedHead:
    """Arms the head for one call in a training forward with labels, where the chunked loss is exact: the head's
    class (`_chunked_class`) then returns `PendingLogits`; everywhere else it computes as its own class.

    Off (the whole logits) under FSDP2, autocast, torch.compile, a head wrapped by
    another module (PEFT's LoRA, whose adapter shares the head's block entry), an input not in the head's dtype, or
    `loss_chunk` of None or 0; not installed on a float8 or transposed (Conv1D) head. `chunked` counts the losses
    computed over chunks.
    """

    def __init__(self, head: nn.Linear, group: Group, chunk: int, state: Any):
        self.head, self.group, self.chunk, self.state = head, group, chunk, state
        self.armed = False
        self.chunked = 0

    def __deepcopy__(self, memo: dict) -> ChunkedHead:
        """A deep copy of the model (an EMA or reference model) gets its own, bound to its copy of the head and state;
        the process group is shared (a handle, not data)."""
        if self.group is not None:
            memo[id(self.group)] = self.group
        new = ChunkedHead.__new__(ChunkedHead)
        memo[id(self)] = new
        new.__dict__.update({key: copy.deepcopy(value, memo) for key, value in self.__dict__.items()})
        return new

    def before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The model's forward pre-hook: arm the model's own head (a deep copy's, in a copy: the hooks are shared) for
        one call in a training forward given labels; a head wrapped by another module (LoRA) is not armed."""
        chunked = _chunked_head(module)
        if chunked is None:
            return
        chunked.armed = (
            module.training
            and torch.is_grad_enabled()
            and kwargs.get("labels") is not None
            and not chunked.state.fsdp
            and not torch.compiler.is_compiling()
        )

    def after(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """The model's forward hook, also after a forward that raised (`output` None then): disarm; a replicated
        head's stand-in in the output becomes logits computed when read (a vocab-parallel one is gathered when read,
        by `LogitsGate`)."""
        chunked = _chunked_head(module)
        if chunked is None:
            return None
        chunked.armed = False
        if isinstance(chunked.head, ParallelLinear):
            return None
        if isinstance(output, tuple):
            return type(output)(real_logits(x) if torch.is_tensor(x) else x for x in output)
        logits = getattr(output, "logits", None)
        return lazy_logits(output, logits.materialize) if isinstance(logits, PendingLogits) else None

    def stand_in(self, head: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The stand-in for the model's own head call when armed, else None (the head computes its logits)."""
        if not self.armed or head is not self.head or x.dtype != self.head.weight.dtype:
            return None
        if torch.is_autocast_enabled(x.device.type):  # here, not in `before`: accelerate enters it inside the forward
            return None
        self.armed = False  # the model's own head call; any other is the head's
        width = self.head.weight.shape[0]
        return PendingLogits(copy_to_tp(x, self.group), self.logits, self.stale_after(), width, x.dtype)

    def stale_after(self) -> Callable[[], str | None]:
        """Says, when called, why logits computed from the head now would not be the ones of now (this forward):
        its weight or bias changed since, in place or by an optimizer step (`autotp.runtime.param_steps`)."""
        params = (self.head.weight, self.head.bias)
        for param in params:
            if param is not None:
                param_steps.watch(param)
        then = param_steps.stamp(params)

        def stale() -> str | None:
            if param_steps.stamp(params) == then:
                return None
            return (
                f"autotp: output.logits read after the LM head ({type(self.head).__name__}, "
                f"{tuple(self.head.weight.shape)}) changed since the forward (optimizer.step(), or an in-place "
                f"write): under the chunked loss (loss_chunk={self.chunk}) they are computed when first read, and "
                "the forward's head weights are gone. Read output.logits before optimizer.step(), or wrap with "
                "loss_chunk=None to have the forward compute them"
            )

        return stale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits (this rank's shard) of `hidden`, differentiably: what the stand-in stands for."""
        head = self.head
        if isinstance(head, ParallelLinear):
            return head.local_linear(hidden, head.bias)
        return F.linear(hidden, head.weight, head.bias)

    def loss_sum(
        self, logits: torch.Tensor, target: torch.Tensor, start: int, ignore_index: int
    ) -> torch.Tensor | None:
        """The summed loss over chunks when `logits` is this head's stand-in, not computed; else None."""
        if not isinstance(logits, PendingLogits) or logits.computed is not None or logits.head != self.logits:
            return None
        self.chunked += 1
        hidden = logits.hidden.reshape(-1, logits.hidden.shape[-1])
        head = self.head
        return _ChunkedLinearCrossEntropy.apply(
            hidden,
            head.weight,
            head.bias,
            target,
            start,
            ignore_index,
            self.group,
            self.chunk,
            logits,
        )


class WholeHeadLoss:
    """Stands in for a causal-LM model's `loss_function` (transformers' `ForCausalLMLoss`) when its head is replicated:
    over chunks (`ChunkedHead.loss_sum`) when given the head's stand-in, else the model's own loss."""

    def __init__(self, full_loss: Callable[..., torch.Tensor], chunked: ChunkedHead):
        self.full_loss, self.chunked = full_loss, chunked

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """transformers' `ForCausalLMLoss`; its other keywords (`label_smoothing`) it ignores too."""
        target = shifted_targets(labels, shift_labels, ignore_index, logits)
        total = self.chunked.loss_sum(logits, target, 0, ignore_index)
        if total is not None:
            return mean_loss(total, target, num_items_in_batch, ignore_index)
        # transformers' own, in its parameters' order
        return self.full_loss(
            real_logits(logits), labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
        )


def _chunked_head(model: nn.Module) -> ChunkedHead | None:
    """The `ChunkedHead` of the model's output embeddings, if they are a chunked head (not wrapped by LoRA)."""
    head = model.get_output_embeddings()
    return None if head is None else vars(head).get("autotp_chunked")


_CHUNKED: dict[type, type] = {}


def _chunked_class(cls: type[nn.Module]) -> type:
    """`cls` with a `forward` that returns the instance's `ChunkedHead` stand-in when it gives one (one subclass per
    class, of the same name)."""
    if cls not in _CHUNKED:

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            chunked = vars(self).get("autotp_chunked")
            pending = None if chunked is None else chunked.stand_in(self, x)
            return cls.forward(self, x) if pending is None else pending

        names = {"forward": forward, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        _CHUNKED[cls] = type(cls.__name__, (cls,), names)
    return _CHUNKED[cls]


def chunk_head(model: nn.Module, head: nn.Linear, group: Group, state: Any) -> ChunkedHead | None:
    """Install the chunked head and loss on `head` (the model's vocab-parallel or replicated LM head): its class, and
    the model's hooks. None where it cannot be chunked exactly (`loss_chunk` off, a float8 or Conv1D head)."""
    if not state.options.loss_chunk or computes_float8(head) or getattr(head, "transposed", False):
        return None
    chunked = ChunkedHead(head, group, state.options.loss_chunk, state)
    state.vocab_hooks += [
        patch_attribute(head, "autotp_chunked", chunked),
        patch_attribute(head, "__class__", _chunked_class(type(head))),
        model.register_forward_pre_hook(state.sharded_only(chunked.before), with_kwargs=True),
        # disarmed after a forward that raised too: an armed head called alone would return a stand-in
        model.register_forward_hook(state.sharded_only(chunked.after), with_kwargs=True, always_call=True),
    ]
    return chunked


def chunk_replicated_head(model: nn.Module, state: Any) -> Patch | None:
    """The chunked loss on a model whose head vocab parallelism left whole (at tp 1, or vocab_parallel off): a plain
    `nn.Linear` head of a model whose loss is transformers' causal-LM cross-entropy; else nothing."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear or getattr(model, "loss_function", None) is not causal_lm_loss():
        return None
    full_loss = model.loss_function
    chunked = chunk_head(model, head, None, state)
    if chunked is None:
        return None
    patch = patch_attribute(model, "loss_function", WholeHeadLoss(full_loss, chunked))
    state.vocab_hooks.append(patch)
    return patch
