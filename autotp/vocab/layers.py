"""Vocab parallelism: embedding rows and LM-head rows split by vocabulary, and a loss on sharded logits.

The embedding keeps its class (Gemma's scaled embedding included): hooks map ids into the shard,
zero the rows of ids another rank holds, and all-reduce. The LM head is an ordinary column-parallel
`LinearLayer`, so logits stay sharded; the cross-entropy works on the shards with three small
all-reduces and a local backward, so the batch x seq x vocab logits are never gathered for a loss.
A caller that wants logits (evaluation, generation, no labels) gets them gathered.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..compat.torch import assert_async
from ..mesh import Group, group_rank, group_size
from ..planning.sharding import Partition
from ..runtime.collectives import all_reduce, gather_from_tp, reduce_from_tp
from ..runtime.lazy_logits import lazy_logits, real_logits
from ..runtime.process_hooks import patched
from ..runtime.second_order import refuse_second_order
from ..runtime.shards import gather_parameter_, partition_parameter_, shard_parameter


class VocabParallelEmbedding:
    """Hooks that make an `nn.Embedding` (or subclass) look up only this rank's vocabulary rows; they do nothing while
    the model is gathered (`state.sharded_only`)."""

    def __init__(self, module: nn.Embedding, partition: Partition, group: Group, state):
        self.module, self.group = module, group
        rank = group_rank(group)
        ((self.start, self.count),) = partition.runs[rank]
        self.full_rows, self.full_padding = module.num_embeddings, module.padding_idx
        module.weight = shard_parameter(module.weight, partition, rank)
        self._set_rows(full=False)
        self._mask: torch.Tensor | None = None
        self._hooks = [
            module.register_forward_pre_hook(state.sharded_only(self._enter)),
            module.register_forward_hook(state.sharded_only(self._leave)),
            module.register_forward_hook(self._drop, always_call=True),  # a forward that raised keeps no mask
        ]
        module.autotp_region = self

    def release(self) -> None:
        """Leave the module a plain full embedding again (it must be gathered): before a vocabulary resize."""
        if self.module.num_embeddings != self.full_rows:
            raise RuntimeError("gather the embedding before releasing it")
        for hook in self._hooks:
            hook.remove()
        del self.module.autotp_region

    def _set_rows(self, full: bool) -> None:
        if full:
            self.module.num_embeddings, self.module.padding_idx = self.full_rows, self.full_padding
            return
        self.module.num_embeddings = self.count
        padding = self.full_padding
        self.module.padding_idx = (
            padding - self.start if padding is not None and 0 <= padding - self.start < self.count else None
        )

    def _enter(self, module, args):
        ids = args[0]
        # an id outside the whole vocabulary is masked on every rank, so it would look up zeros and train, silently,
        # where one process's embedding raises IndexError
        assert_async(
            ((ids >= 0) & (ids < self.full_rows)).all(),
            f"autotp: a token id outside the vocabulary of {self.full_rows} rows reached the vocab-parallel "
            f"{type(module).__name__} (one process raises IndexError there): check the tokenizer's ids against the "
            f"model's vocab_size, or resize_token_embeddings before autotp.wrap",
        )
        self._mask = (ids < self.start) | (ids >= self.start + self.count)
        return ((ids - self.start).masked_fill(self._mask, 0), *args[1:])

    def _leave(self, module, args, output):
        output = output.masked_fill(self._mask.unsqueeze(-1), 0)
        self._mask = None
        return reduce_from_tp(output, self.group)

    def _drop(self, module, args, output) -> None:
        self._mask = None

    def gather_(self) -> None:
        gather_parameter_(self.module.weight, self.group)
        self._set_rows(full=True)

    def partition_(self) -> None:
        partition_parameter_(self.module.weight)
        self._set_rows(full=False)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy on vocab-sharded logits: (max, then sum) of the local log-sum-exps all-reduced forward; local
    backward. The one full-size temporary is the local softmax (a fused kernel), kept for backward: on CPU every
    fresh full-size tensor also costs its page faults."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        target: torch.Tensor,
        start: int,
        ignore_index: int,
        group: dist.ProcessGroup,
    ) -> torch.Tensor:
        ctx.dtype = logits.dtype
        loss, softmax, local, mine, valid = shard_loss(logits, target, start, ignore_index, group)
        ctx.save_for_backward(softmax, local, mine, valid)
        return loss * valid

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        refuse_second_order(
            "the vocab-parallel loss, whose backward reads a softmax saved without a graph",
            "wrap with tp_size=1 for them",
        )
        softmax, local, mine, valid = ctx.saved_tensors
        out = shard_grad_(softmax, local, mine)
        # a row not learnt from gets 0 whatever its gradient (an infinite one: the mean of no rows), as in torch
        out *= torch.where(valid, grad, 0).unsqueeze(-1)
        return out.to(ctx.dtype), None, None, None, None


def shard_grad_(softmax: torch.Tensor, local: torch.Tensor, mine: torch.Tensor) -> torch.Tensor:
    """dloss/dlogits of each row (`shard_loss`'s softmax, overwritten), before scaling by the rows' gradients."""
    out = softmax
    # minus 1 at each row's target, where this rank holds it: a scatter, not a nonzero
    # (whose data-dependent shape breaks torch.compile's graph)
    target = local.clamp(0, out.shape[-1] - 1).unsqueeze(-1)
    out.scatter_add_(-1, target, -mine.to(out.dtype).unsqueeze(-1))
    return out


def shard_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    start: int,
    ignore_index: int,
    group: dist.ProcessGroup,
) -> tuple[torch.Tensor, ...]:
    """Each row's loss over the whole vocabulary from this rank's logit shard (three all-reduces), and what its
    gradient needs: the softmax normalised over the whole vocabulary, the targets local to the shard, which of them
    this rank holds, which rows count."""
    logits = logits.float()
    softmax = torch.softmax(logits, dim=-1)
    local_max = logits.max(dim=-1).values
    masked = local_max == float("-inf")  # a row this rank's whole shard masks out: its softmax is NaN
    softmax.masked_fill_(masked.unsqueeze(-1), 0.0)
    # the max's softmax is 1 / sum-exp
    local_lse = torch.where(masked, local_max, local_max - softmax.max(dim=-1).values.log())
    top = local_lse.clone()
    whole = group_size(group) == 1  # the whole vocabulary here (a replicated head): nothing to reduce
    if not whole:
        all_reduce(top, group, dist.ReduceOp.MAX)
    local = target - start
    valid = target != ignore_index
    mine = valid & (local >= 0) & (local < logits.shape[-1])
    picked = logits.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(mine, picked, torch.zeros_like(picked))  # not `* mine`: a masked logit is -inf
    sums = torch.stack([(local_lse - top).exp(), picked])
    if not whole:
        all_reduce(sums, group)
    lse = top + sums[0].log()  # log of the softmax denominator over the whole vocabulary
    loss = lse - sums[1]
    if not whole:  # else torch.softmax normalised it already
        softmax.mul_((local_lse - lse).exp().unsqueeze(-1))  # normalised over the whole vocabulary
    return loss, softmax, local, mine, valid


class VocabParallelLoss:
    """Stands in for an HF model's `loss_function` (ForCausalLM semantics) when its logits are vocab-sharded.

    Full-width logits (inside `GatherReplacedLayerParams`) go to the model's own loss function.
    `calls` counts sharded calls, so a model that computes its loss some other way is caught.
    """

    def __init__(self, partition: Partition, group: Group, full_loss: Callable[..., torch.Tensor]):
        self.group, self.full_loss = group, full_loss
        ((self.start, _),) = partition.runs[group_rank(group)]
        self.full_vocab = partition.full_size
        self.calls = 0
        # the loss summed over chunks from the head's stand-in (`autotp.vocab.chunked`), or None: set by apply_vocab
        self.chunked: Callable[..., torch.Tensor | None] | None = None

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
        """transformers' `ForCausalLMLoss` on the shards; its other keywords (`label_smoothing`) it ignores too."""
        if logits.shape[-1] == self.full_vocab:
            return self.full_loss(
                logits,
                labels,
                vocab_size=self.full_vocab,
                num_items_in_batch=num_items_in_batch,
                ignore_index=ignore_index,
                shift_labels=shift_labels,
                **kwargs,
            )
        self.calls += 1
        target = shifted_targets(labels, shift_labels, ignore_index, logits)
        args = (target, self.start, ignore_index)
        total = None if self.chunked is None else self.chunked(logits, *args)
        if total is None:
            total = logits_loss_sum(real_logits(logits), *args, self.group)
        return mean_loss(total, target, num_items_in_batch, ignore_index)


def logits_loss_sum(
    logits: torch.Tensor, target: torch.Tensor, start: int, ignore_index: int, group: Group
) -> torch.Tensor:
    """The loss summed over the rows of `logits`, this rank's shard of the vocabulary."""
    flat = logits.reshape(-1, logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(flat, target, start, ignore_index, group).sum()


def shifted_targets(
    labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int, logits: torch.Tensor
) -> torch.Tensor:
    """Each token's target, flat, as transformers' causal-LM loss takes it: `shift_labels`, else `labels` shifted
    left with `ignore_index` appended. One per position of `logits`, or refused as transformers refuses it (its
    cross-entropy's batch-size mismatch): the loss must not pair positions with other positions' labels."""
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    positions = math.prod(logits.shape[:-1])  # the shape only: a chunked head's stand-in computes nothing for it
    if shift_labels.numel() != positions:
        raise ValueError(
            f"autotp: {shift_labels.numel()} labels for {positions} positions of logits {tuple(logits.shape)} "
            "(transformers' loss refuses it too: its input and target batch sizes differ); with logits_to_keep, "
            "pass logits_to_keep=0 for a loss over every position, or labels of the kept positions only"
        )
    return shift_labels.reshape(-1).to(logits.device)


def mean_loss(total: torch.Tensor, target: torch.Tensor, num_items_in_batch: Any, ignore_index: int) -> torch.Tensor:
    """The summed loss divided as transformers divides it: by `num_items_in_batch` if given, else by the count of
    targets that are not `ignore_index` (no target: NaN, as transformers' mean of no rows is; the losses' backwards
    give such rows 0 gradient, whatever the division's)."""
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(total.device)
        return total / num_items_in_batch
    return total / (target != ignore_index).sum()


class LogitsGate:
    """Forward hooks on the model: logits the user sees are whole-vocabulary, and gathered only when someone reads them.

    A training forward whose loss went through `VocabParallelLoss` returns its output with the logits gathered lazily
    (`lazy_logits`): a step that reads only the loss never gathers batch x seq x vocab; code that reads `logits`
    (token accuracy, entropy, per-token log-probabilities) gets the full tensor, differentiably. Reading them is a
    collective: every TP rank reads them, or none. A tuple output (`return_dict=False`) has its logits gathered at
    once. A loss that did not go through the `VocabParallelLoss` was computed on this rank's logit shard alone, so it
    is refused before anything trains on it.

    The LM head called outside the model's forward (`model.lm_head(h)`, `get_output_embeddings()(h)`: chunked
    log-probabilities in RL code) returns whole logits too (`head_after`); only the model's own forward, whose loss
    is computed on the shards, keeps them sharded. So does the model's forward once the user replaced
    `model.loss_function` after wrap (`whole`): that function is theirs, and gets the logits one process computes.
    """

    def __init__(self, partition: Partition, group: Group, state, loss: VocabParallelLoss):
        self.partition, self.group, self.state, self.loss = partition, group, state, loss
        self._calls_before = 0
        self.whole = False  # this forward's head gathers its logits: the model's loss_function is the user's
        self.gathers = 0  # how many times logits were gathered (a training step reading only its loss: none)
        ((_, self.local),) = partition.runs[group_rank(group)]

    def before(self, module: nn.Module, args, kwargs) -> None:
        self._calls_before = self.loss.calls
        self.whole = module.loss_function is not patched(module, "loss_function")

    def head_after(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
        """The head's logits gathered, differentiably, when it was called outside the model's forward, or for a loss
        function the user set after wrap."""
        if (
            (self.state.forwards and not self.whole)
            or not torch.is_tensor(output)
            or output.shape[-1] != self.local
            or self.local == self.partition.full_size
        ):
            return None
        return self._gather(output)

    def after(self, module: nn.Module, args, kwargs, output):
        if group_size(self.group) == 1 or self.local == self.partition.full_size:
            return output
        if isinstance(output, tuple):
            return self._gather_tuple(output)
        logits = getattr(output, "logits", None)
        if logits is None or logits.shape[-1] != self.local:
            return output
        has_loss = getattr(output, "loss", None) is not None
        if has_loss and self.loss.calls == self._calls_before:
            raise RuntimeError(
                f"{type(module).__name__} computed its loss without self.loss_function, on this rank's "
                f"{logits.shape[-1]} of {self.partition.full_size} vocabulary logits; wrap it with vocab_parallel=False"
            )
        if module.training and has_loss:  # gathering batch x seq x vocab for a loss computed on shards wastes memory
            return lazy_logits(output, lambda: self._gather(logits))
        output.logits = self._gather(logits)
        return output

    def _gather(self, logits: torch.Tensor) -> torch.Tensor:
        self.gathers += 1
        logits = real_logits(logits)
        return gather_from_tp(logits, self.partition.with_dim(logits.ndim - 1), self.group)

    def _gather_tuple(self, output: tuple) -> tuple:
        """HF's tuple is (loss?, logits, ...): the first tensor of two or more dimensions is the logits."""
        at = next((i for i, x in enumerate(output) if torch.is_tensor(x) and x.ndim >= 2), None)
        if at is None or output[at].shape[-1] != self.local:
            return output
        return type(output)((*output[:at], self._gather(output[at]), *output[at + 1 :]))
