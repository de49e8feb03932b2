"""Ranks that must read the same batch: the TP ranks of a replica (each computes on its shard of the same tokens) and
its CP ranks (each keeps its own tokens of the same whole sequence).

Fed different batches they train on a mixture no process computes, silently (a `DistributedSampler` over the whole
world does it); fed different lengths they die in a collective whose sizes differ. `check_same_batch` compares a
forward's tensors over one group with one all-reduce of six integers (what the rank is doing, a hash of the names,
shapes and dtypes, and a checksum of the contents computed where the tensors are); only when they differ do the
ranks' descriptions travel, so that every rank names the first difference. A rank reading a CP forward's logits (a
gather over CP) exchanges as many integers first, so one that reads them while another begins its next forward is
named on both, where it would otherwise hang in the gather or die in a mismatched collective; so does a CP backward
before its first collective (a rank that reads them while another goes on to its backward).
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

from ..mesh import Group, group_size, named_failure

_KINDS = {"TP": "tensor-parallel", "CP": "context-parallel", "PP": "pipeline-parallel"}
_WHY = {  # what the ranks of each kind of group must read
    "TP": "every TP rank of a replica must read the same batch",
    "CP": "every CP rank of a replica must read the same whole batch (autotp splits it over CP)",
    "PP": "every rank of a pipeline must read the same whole batch (autotp splits it into micro-batches)",
}
_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bit patterns as integers
_CHUNK = 1 << 24  # elements summed at once: a checksum of a long inputs_embeds never holds it all as int64
_MASK = (1 << 62) - 1  # keeps a checksum's negation in int64


def checksum(x: torch.Tensor) -> torch.Tensor:
    """An int64 of `x`'s bit patterns weighted by position, on `x`'s device: equal tensors give equal sums, and a
    reordered or changed one (almost surely) another."""
    flat = x.detach().contiguous().view(-1)
    flat = flat.view(_SAME_WIDTH[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=x.device)
    for start in range(0, flat.numel(), _CHUNK):
        part = flat[start : start + _CHUNK].long()
        total += (part * torch.arange(start + 1, start + 1 + part.numel(), device=x.device)).sum()
    return total & _MASK


# what a rank is doing at an exchange: checking a forward's inputs, reading its logits, or beginning its backward
FORWARD, READ, BACKWARD = 1, 2, 3
_DOING = {FORWARD: "began a forward", READ: "read a forward's logits (.logits)", BACKWARD: "began a backward"}


def _exchange(group: Group, doing: int, values: torch.Tensor, what: str) -> bool:
    """One all-reduce over `group` of what each rank is `doing` and two int64 `values`; raises on every rank if the
    ranks are doing different things, and returns whether their values agree."""
    vector = torch.cat([torch.tensor([doing], device=values.device), values])
    extremes = torch.cat([vector, -vector])
    with named_failure(
        group,
        f"{what} (reading a context-parallel forward's .logits is a collective: a rank that "
        f"reads them while another does not waits here)",
    ):
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    high, low = extremes.view(2, 3).tolist()
    if high[0] != -low[0]:
        raise RuntimeError(
            f"ranks {dist.get_process_group_ranks(group)} were at different calls: some "
            f"{_DOING[-low[0]]}, others {_DOING[high[0]]}. Reading a context-parallel forward's .logits "
            f"is a collective (the sequence is gathered from every CP rank): read them on every CP "
            f"rank or on none (compute a metric on every rank, and log it from one)"
        )
    return high[1:] == [-v for v in low[1:]]


def check_same_read(group: Group, device: torch.device, doing: int = READ) -> None:
    """Before gathering a forward's logits over CP (`doing` READ), or before a CP backward's first collective
    (BACKWARD): every rank of `group` is doing it (else every rank raises, naming both calls, rather than one hanging
    in the gather while another runs on into its backward's collectives)."""
    if group_size(group) > 1:
        _exchange(
            group,
            doing,
            torch.zeros(2, dtype=torch.int64, device=device),
            "reading a forward's logits" if doing == READ else "beginning a backward",
        )


def check_same_batch(group: Group, named: list[tuple[str, torch.Tensor]], kind: str) -> None:
    """Raise on every rank of `group` (a replica's "TP" or "CP" group), naming the first tensor that differs, unless
    every rank passed the same `named` tensors. Collective: every rank of the group calls it."""
    if group_size(group) == 1:
        return
    meta = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    device = named[0][1].device if named else torch.device("cpu")
    digest = int.from_bytes(hashlib.blake2b(repr(meta).encode(), digest_size=7).digest(), "little")
    content = torch.zeros((), dtype=torch.int64, device=device)
    for i, (_, t) in enumerate(named):
        content = (content * 1000003 + checksum(t).to(device) + i) & _MASK
    values = torch.stack([torch.tensor(digest, device=device), content])
    if _exchange(group, FORWARD, values, f"comparing the {_KINDS[kind]} ranks' inputs at a forward"):
        return
    mine = [(*m, int(checksum(t))) for m, (_, t) in zip(meta, named)]
    everyone: list = [None] * group_size(group)
    with named_failure(group, f"gathering the {_KINDS[kind]} ranks' inputs to name the one that differs"):
        dist.all_gather_object(everyone, mine, group=group)
    raise RuntimeError(_difference(everyone, dist.get_process_group_ranks(group), kind))


def _difference(everyone: list[list[tuple]], ranks: list[int], kind: str) -> str:
    """The first tensor in which a rank's inputs differ from the group's first rank's, as a sentence."""
    first = everyone[0]
    for rank, theirs in zip(ranks[1:], everyone[1:]):
        for index in range(max(len(first), len(theirs))):
            ours = first[index] if index < len(first) else None
            other = theirs[index] if index < len(theirs) else None
            if ours != other:
                differing = ours or other
                assert differing is not None  # always: `ours != other`, so not both None
                name = differing[0]
                values = " (same shape, other values)" if ours and other and ours[1:3] == other[1:3] else ""
                return (
                    f"{_KINDS[kind]} ranks got different inputs: {name} on rank {ranks[0]} "
                    f"{_described(ours)} differs from rank {rank}'s {_described(other)}{values}; {_WHY[kind]}: "
                    f"sample with autotp.data_parallel_sampler(dataset, model), not a DistributedSampler over the "
                    f"whole world"
                )
    return f"{_KINDS[kind]} ranks {ranks} got different inputs"


def _described(entry: tuple | None) -> str:
    return "(missing)" if entry is None else f"(shape {entry[1]}, {entry[2]})"
