"""Count the real collectives of a training step: 2 all-reduces per decoder layer forward, 2 backward.

Vocab parallelism adds, per step, 3 forward all-reduces (the embedding's partial lookups; the
cross-entropy's max, then its sum-exp and target logit together) and 1 backward (the LM head's
input gradient). Each torch.distributed entry point is wrapped by a counter that still runs the
real collective. The first training forward also checks once that the TP ranks' random generators agree (one
all-reduce of two int64s, `autotp.runtime.rng.StreamCheck`, repeated every 64 forwards): the counts are of a
steady-state step, after a first one whose extra all-reduce is asserted on its own.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

import autotp
from autotp.planning.report import summary
from autotp.testing.spawn import run_ranks
from models import batch, tiny_model

COLLECTIVES = tuple(
    name
    for name in (  # the *_single names are torch 2.13's; GPU users may run an older torch
        "all_reduce",
        "all_gather",
        "gather",
        "broadcast",
        "reduce_scatter",
        "all_to_all",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_gather_single",
        "reduce_scatter_single",
    )
    if hasattr(dist, name)
)


def count_step(rank: int, world: int, family: str, vocab_parallel: bool) -> dict:
    model = autotp.wrap(tiny_model(family), world, vocab_parallel=vocab_parallel)
    counts: dict[str, int] = {}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name):
        def call(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return originals[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    try:
        ids = batch()
        model(ids, labels=ids).loss.backward()  # the first step: the random-stream check runs once
        first = dict(counts)
        counts.clear()
        loss = model(ids, labels=ids).loss
        forward = dict(counts)
        counts.clear()
        loss.backward()
        backward = dict(counts)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return {"first": first, "forward": forward, "backward": backward, "layers": model.config.num_hidden_layers}


@pytest.mark.parametrize("vocab_parallel", [False, True])
@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("family,per_head_norms", [("llama", 0), ("qwen3", 2), ("gemma", 0)])
def test_collectives_per_layer(family: str, per_head_norms: int, tp: int, vocab_parallel: bool) -> None:
    for report in run_ranks(count_step, tp, family, vocab_parallel):
        layers = report["layers"]
        if tp == 1:
            assert report["first"] == {} and report["forward"] == {} and report["backward"] == {}, report
            continue
        vocab_forward, vocab_backward = (3, 1) if vocab_parallel else (0, 0)
        assert report["forward"] == {"all_reduce": 2 * layers + vocab_forward}, report
        assert report["backward"] == {"all_reduce": (2 + per_head_norms) * layers + vocab_backward}, report
        assert report["first"] == {"all_reduce": (4 + per_head_norms) * layers + vocab_forward + vocab_backward + 1}, (
            report
        )  # the first step's one extra: the random-stream check


def bytes_of_step(rank: int, world: int, family: str, config: dict) -> dict:
    """Bytes `autotp plan` predicts for one training step against the bytes real all-reduces moved."""
    model = autotp.wrap(tiny_model(family, **config), world)
    ids = batch()
    predicted = summary(model, model.autotp_state.plan, *ids.shape)["collective_bytes_per_step"]
    moved = {"bytes": 0}
    original = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        moved["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    model(ids, labels=ids).loss.backward()  # the first step also checks the random streams once (16 bytes)
    dist.all_reduce = counting
    try:
        model(ids, labels=ids).loss.backward()
    finally:
        dist.all_reduce = original
    return {"predicted": predicted, "moved": moved["bytes"]}


@pytest.mark.parametrize(
    "family,config",
    [
        ("llama", {}),
        ("qwen3", {}),
        ("gpt2", {}),
        ("mixtral", {}),
        ("llama", {"num_key_value_heads": 1}),  # replicated KV rows add their gradient sums
    ],
)
def test_plan_collective_bytes_equal_the_bytes_moved(family: str, config: dict) -> None:
    for report in run_ranks(bytes_of_step, 2, family, config):
        assert report["predicted"] == report["moved"], report
