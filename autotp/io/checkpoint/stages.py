"""A training checkpoint under a pipeline: each rank saves and loads only what its stages own.

Each stage holds its own layers, the embedding on the first stage and the final norm and the head on the last
(`autotp.pp.release` frees the others; a tied head keeps the embedding's weight). `autotp.pp.cut.owner` names the stage that trains and saves each
tensor: a rank saves (and loads) the tensors its stages own, and the optimizer state of the parameters it trains,
each under its full name, so the checkpoint holds the keys one process's holds, each once, and any layout (another
pp, another cut, one process) reads it. A tied embedding is one process's two names of one weight: the first stage
saves it as the embedding, the last as the head, and both load it with its optimizer state.
"""

from __future__ import annotations

from typing import Callable

import torch.distributed as dist
from torch import nn

from ...mesh import group_size, named_failure
from ...pp.cut import owner, trainers
from ...pp.dimension import PipelineParallelism
from ...state import find_state


def _pipeline(model: nn.Module) -> PipelineParallelism | None:
    state = find_state(model)
    return None if state is None else state.dim(PipelineParallelism)


def owned(model: nn.Module) -> Callable[[str], bool]:
    """Whether this rank saves and loads the tensor of that state-dict name (every name at pp 1)."""
    pipeline = _pipeline(model)
    if pipeline is None:
        return lambda name: True
    stage, mine = owner(model, pipeline.cut), set(pipeline.stages)
    return lambda name: stage(name) in mine


def elsewhere(model: nn.Module) -> Callable[[str], bool]:
    """Whether a saved name is another stage's: in a layer another stage runs (absent here), or outside the layers
    and owned by another stage. A loader checks the rest against the model."""
    pipeline = _pipeline(model)
    if pipeline is None:
        return lambda name: False
    cut, mine = pipeline.cut, owned(model)
    others, root = cut.prefixes(pipeline.stages), f"{cut.base}.{cut.layers}." if cut.base else f"{cut.layers}."
    return lambda name: name.startswith(others) or (not name.startswith(root) and not mine(name))


def trained(model: nn.Module, names: list[list[str]]) -> list[list[str]]:
    """The parameters of each optimizer group (by `optimizer_names`) whose state this rank loads: those it trains,
    that is any of whose names its stages own (the last stage trains a tied embedding under the head's name)."""
    pipeline = _pipeline(model)
    if pipeline is None:
        return names
    by_id, params = trainers(model, pipeline.cut), dict(model.named_parameters())
    return [[n for n in group if by_id[id(params[n])].intersection(pipeline.stages)] for group in names]


def optimizer_params(model: nn.Module, names: list[list[str]], group: dist.ProcessGroup | None) -> list[list[str]]:
    """The optimizer's parameter names as one process's optimizer holds them, for the checkpoint's record: at pp > 1
    each rank's own (`names` its stages own) gathered over `group` (the world) and put in stage order."""
    pipeline = _pipeline(model)
    if pipeline is None:
        return names
    stage = owner(model, pipeline.cut)
    mine = [[(stage(n), n) for n in g if stage(n) in pipeline.stages] for g in names]
    every: list[list[list[tuple[int, str]]]] = [[] for _ in range(dist.get_world_size())]
    assert group is not None  # always: a pipeline runs under torch.distributed
    with named_failure(group, "autotp.save_checkpoint's gather of the optimizer's parameter names over the stages"):
        dist.all_gather_object(every, mine, group=group)
    counts = sorted({len(groups) for groups in every})
    if len(counts) > 1:
        raise ValueError(
            f"autotp.save_checkpoint at pp_size={group_size(pipeline.runner.group)}: the "
            f"optimizers of the ranks hold {counts} parameter groups; each stage's optimizer must hold the same "
            f"groups (as one process's, built the same way on every rank), so that they name one optimizer"
        )
    merged = []
    for index in range(counts[0]):
        pairs = dict.fromkeys(pair for groups in every for pair in groups[index])  # replicas and TP ranks: once
        merged.append([n for _, n in sorted(pairs, key=lambda pair: pair[0])])  # stable: each stage's own order
    return merged
