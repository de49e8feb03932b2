"""Data parallel x context parallel x tensor parallel: gradient sync, clipping, sampling (the groups: `autotp.mesh`).

A world of N ranks with tp_size T and cp_size C holds N/(C T) replicas (DP), each splitting its sequences over C
ranks (CP) and its weights over T (TP). TP groups are consecutive ranks, CP groups next: rank r is TP rank r % T,
CP rank (r // T) % C of replica r // (C T). The TP and CP ranks of one replica read the same batch. Gradients are
summed over CP and averaged over DP: each CP rank's gradient is C times its tokens' share
(`autotp.cp.apply`), so one average over DP x CP (`dp_cp_group`) does both. Without CP, DP x CP is DP.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset, DistributedSampler

from ..accessors import dp_cp_group, dp_rank, dp_size
from ..mesh import device_of, group_size, named_failure
from ..planning.placement import Box
from ..runtime.collectives import all_reduce_bucketed, any_rank
from ..runtime.rows import local_rows
from ..state import refuse_torch_fsdp, state_of, wrapped_model

_WHAT = "autotp.allreduce_gradients' all-reduce of the gradients"


def allreduce_gradients(model: nn.Module, average: bool = True) -> None:
    """Average (or sum) every gradient over the DP x CP group, in ~25 MB buckets; call after the last micro-batch.

    Under context parallelism this sums over CP and averages over DP (see the module doc); it must be called even
    with one replica. Under expert parallelism the experts' gradients are summed over their expert-DP group instead
    and divided by the same DP x CP size (`autotp.ep.grads`). With gradient accumulation, call it once per optimizer step: the gradients accumulated over
    the micro-batches are synchronised together. Under `autotp.fully_shard` it does nothing: FSDP has already
    reduce-scattered them over DP x CP, and the experts over expert-DP (`autotp.ep.fsdp`). A parameter that some
    replica's batch reached and this one's did not (the vision router of a text-only replica) gets a zero gradient
    first, so every rank reduces the same tensors and the average is one process's.
    """
    group = dp_cp_group(model)
    size = group_size(group)
    state = state_of(model)
    for dimension in state.dims.values():  # CP: marked summed; the experts over their own replicas (autotp.ep.grads)
        dimension.sync_gradients(model, state, size, average)
    if size == 1 or state.fsdp:
        return
    params = [p for p in model.parameters() if p.requires_grad and not hasattr(p, "autotp_expert")]
    for p, used in zip(params, any_rank([p.grad is not None for p in params], [group], device_of(group), _WHAT)):
        if used and p.grad is None:  # unused by this replica's batch only (a router of modality experts): its
            p.grad = torch.zeros_like(p)  # zero joins the average, as one process sums no term for those rows
    all_reduce_bucketed([p.grad for p in params if p.grad is not None], group, _WHAT, size if average else 1)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Clip gradients by the norm of the whole, unsharded model; returns that norm (before clipping).

    Sharded parameters contribute their shard from every TP rank, rows replicated on several ranks
    (shared KV heads) count once, replicated parameters count once. Call it after the DP (x CP) gradient
    sync, so every replica computes the same norm. Equals the single-process norm.
    """
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"norm_type must be 2.0 or inf, got {norm_type}")
    state = state_of(model)
    refuse_torch_fsdp(wrapped_model(model), state, deep=True)
    params = [p for p in model.parameters() if p.grad is not None]
    # no early return without gradients: a pipeline stage whose parameters are all frozen still joins every all-reduce
    device = params[0].grad.device if params else next(model.parameters(), torch.zeros(())).device
    sharded = torch.zeros((), dtype=torch.float64, device=device)
    replicated = torch.zeros((), dtype=torch.float64, device=device)
    dense, own = params, []
    for dimension in state.dims.values():  # the experts: each EP rank's once, complete over every rank (autotp.ep)
        dense, part = dimension.norm(dense, norm_type, state)
        own += [] if part is None else [part]
    for p in dense:
        grad, first = local_rows(p.grad.detach())  # under FSDP, this rank's rows of its TP shard
        grad = grad.double()
        shard = getattr(p, "autotp_shard", None)
        if shard is None:
            replicated = _combine(replicated, grad, norm_type)
            continue
        dim = shard.partition.dim
        if norm_type == 2.0:  # rows held by k ranks add 1/k of their square on each
            total = grad.pow(2).sum()
            for offset, length, holders in shard.partition.replicas(shard.rank):
                span = Box((offset,), (length,), (offset,))
                if dim == 0:  # the part of the span among this rank's rows
                    clipped = span.clip(0, first, grad.shape[0], local=True)
                    if clipped is None:
                        continue
                    span = clipped
                total -= grad.narrow(dim, span.at[0], span.sizes[0]).pow(2).sum() * (1 - 1 / len(holders))
            sharded = sharded + total
        else:
            sharded = _combine(sharded, grad, norm_type)
    op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
    if group_size(state.tp_group) > 1:
        with named_failure(state.tp_group, "autotp.clip_grad_norm_'s all-reduce of the gradient norm over TP"):
            dist.all_reduce(sharded, op=op, group=state.tp_group)
    if state.fsdp and group_size(state.dp_cp_group) > 1:  # each DP rank holds its rows of every tensor
        with named_failure(state.dp_cp_group, "autotp.clip_grad_norm_'s all-reduce of the gradient norm over DP"):
            for part in (sharded, replicated):
                dist.all_reduce(part, op=op, group=state.dp_cp_group)
    for part in own:
        replicated = replicated + part if norm_type == 2.0 else torch.maximum(replicated, part)
    total = sharded + replicated if norm_type == 2.0 else torch.maximum(sharded, replicated)
    for dimension in state.dims.values():  # a pipeline's stages: each adds its own layers' part (autotp.pp)
        total = dimension.reduce_norm(total, norm_type, state)
    norm = total.sqrt() if norm_type == 2.0 else total
    coef = max_norm / (norm.item() + 1e-6)
    if coef < 1:
        for p in params:
            p.grad.mul_(coef)
    return norm.float()


def _combine(acc: torch.Tensor, grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    return acc + grad.pow(2).sum() if norm_type == 2.0 else torch.maximum(acc, grad.abs().max())


def data_parallel_sampler(
    dataset: Dataset,
    model: nn.Module | None = None,
    *,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
    consumed_samples: int = 0,
) -> DistributedSampler:
    """A sampler giving each DP replica its own part of `dataset`, and all TP and CP ranks of a replica the same part.

    Replica r reads positions r, r + dp, r + 2 dp, ... of the epoch's order (shuffled by `seed` and the
    epoch), so a global batch of G samples is always positions [k G, (k + 1) G) whatever the DP size.
    `consumed_samples`, the global samples of this epoch already trained on (keep it in
    `save_checkpoint`'s state), makes the next pass start after them: a resume at another DP size with the
    same global batch reads the same samples in each step as the run that saved (only the padding that
    evens out the epoch's last batch differs). It must be a multiple of this run's DP size.
    """
    replicas = dp_size(model)
    if consumed_samples % replicas:
        raise ValueError(
            f"data_parallel_sampler: consumed_samples={consumed_samples} is not a multiple of the "
            f"{replicas} data-parallel replicas, so the replicas cannot start at one global position; "
            f"keep the global batch a multiple of the DP size"
        )
    return _ResumingSampler(
        dataset,
        num_replicas=replicas,
        rank=dp_rank(model),
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        skip=consumed_samples // replicas,
    )


class _ResumingSampler(DistributedSampler):
    """`DistributedSampler` whose next pass leaves out this replica's first `skip` samples (those a checkpoint's run
    consumed); the passes after it are whole."""

    def __init__(self, *args, skip: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        if skip > self.num_samples:
            raise ValueError(
                f"data_parallel_sampler: consumed_samples={skip * self.num_replicas} is more than one "
                f"epoch of {self.total_size} samples over {self.num_replicas} replicas"
            )
        self.skip = skip

    def __iter__(self):
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip
