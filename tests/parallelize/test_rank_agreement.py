"""Ranks must agree before wrap touches the model: configs, options and plans compared (each WrapOptions field either
compared or named per-rank, and taken by keyword everywhere), sizes refused at once when they differ, and a rank
left waiting for one that wrapped alone at tp 1 told the likely cause."""

from __future__ import annotations

import inspect
import time
from dataclasses import MISSING, fields

import pytest
import torch

import autotp
from autotp.options import AGREED_OPTIONS, PER_RANK_OPTIONS, WrapOptions
from autotp.testing import run_ranks
from cp_workers import CP_FAMILIES
from ep_workers import moe_model
from models import tiny_model

DISAGREEMENTS = {  # rank 1's difference -> what the error names
    "intermediate_size": (
        {"config": {"intermediate_size": 128}},
        "config key intermediate_size is 96 on rank 0 but 128",
    ),
    "num_hidden_layers": ({"config": {"num_hidden_layers": 3}}, "config key num_hidden_layers is 2 on rank 0 but 3"),
    "vocab_parallel": ({"options": {"vocab_parallel": False}}, "option vocab_parallel is True on rank 0 but False"),
    "sequence_parallel": (
        {"options": {"sequence_parallel": True}},
        "option sequence_parallel is False on rank 0 but True",
    ),
}


def disagreeing(rank: int, world: int, case: str) -> str:
    change = DISAGREEMENTS[case][0] if rank == 1 else {}
    model = tiny_model("llama", **change.get("config", {}))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError) as err:
        autotp.wrap(model, world, timeout=20, **change.get("options", {}))
    assert not autotp.tp.apply.parallel_layers(model)  # refused before anything changed
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return str(err.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", list(DISAGREEMENTS))
def test_ranks_that_built_or_wrapped_differently_are_named_before_anything_changes(case: str) -> None:
    for message in run_ranks(disagreeing, 2, case):
        assert DISAGREEMENTS[case][1] + " on rank 1" in message, message
        assert "ranks disagree before sharding" in message


def test_every_wrap_option_is_compared_between_ranks_or_named_per_rank() -> None:
    """A field added to WrapOptions without deciding whether the ranks must agree on it fails here."""
    names = {f.name for f in fields(WrapOptions)}
    assert AGREED_OPTIONS | PER_RANK_OPTIONS == names, (
        names - AGREED_OPTIONS - PER_RANK_OPTIONS,
        (AGREED_OPTIONS | PER_RANK_OPTIONS) - names,
    )
    assert not AGREED_OPTIONS & PER_RANK_OPTIONS
    assert "cp_size" in AGREED_OPTIONS


def test_wrap_explain_and_from_pretrained_take_wrap_options_by_keyword() -> None:
    """WrapOptions is keyword-only (a field added in the middle cannot shift the others), and every entry point takes
    each of its fields, under its name and with its default."""
    with pytest.raises(TypeError):
        WrapOptions(None)
    options = {f.name: f.default for f in fields(WrapOptions) if f.name != "tp_size"}  # tp_size: positional, below
    assert MISSING not in options.values()
    for entry in autotp.wrap, autotp.explain, autotp.from_pretrained:
        parameters = inspect.signature(entry).parameters
        taken = {name: p.default for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
        assert {name: taken.get(name, "(absent)") for name in options} == options, entry.__name__
        assert list(parameters)[1] == "tp_size", entry.__name__


def different_sizes(rank: int, world: int, sizes: tuple[tuple[int, int], ...]) -> tuple[float, str]:
    """Each rank wraps at its own (tp_size, cp_size); a short timeout, which a prompt refusal never reaches."""
    tp_size, cp_size = sizes[rank]
    model = tiny_model("llama", **CP_FAMILIES["llama"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    start = time.monotonic()
    with pytest.raises(ValueError) as err:
        autotp.wrap(model, tp_size, cp_size=cp_size, timeout=20)
    elapsed = time.monotonic() - start
    assert not autotp.tp.apply.parallel_layers(model) and autotp.state.find_state(model) is None
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    return elapsed, str(err.value)


@pytest.mark.timeout(90)  # before the fix, the ranks diverged in the group creation: one waited out the timeout
@pytest.mark.parametrize("sizes", [((2, 2), (2, 1)), ((2, 1), (1, 2))], ids=["cp", "tp"])
def test_ranks_with_different_sizes_are_refused_before_any_group_is_built(sizes: tuple) -> None:
    for elapsed, message in run_ranks(different_sizes, 2, sizes):
        (tp0, cp0), (tp1, cp1) = sizes
        assert f"rank 0: tp_size={tp0}, cp_size={cp0}; rank 1: tp_size={tp1}, cp_size={cp1}" in message, message
        assert "Every rank must call wrap with the same tp_size and cp_size" in message
        assert elapsed < 10, elapsed  # a few seconds at most; the timeout is 20 s


def alone_at_tp1(rank: int, world: int, axis: str = "cp") -> str:
    """Rank 1 wraps at every size 1, which runs no collective (some ranks only may), and goes on; rank 0 at
    `axis`_size 2 (cp: a dense model; ep: a MoE model)."""
    model = moe_model("qwen3_moe") if axis == "ep" else tiny_model("llama", **CP_FAMILIES["llama"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        autotp.wrap(model, 1, **{f"{axis}_size": 2 if rank == 0 else 1}, timeout=20)
        return "wrapped"
    except RuntimeError as err:
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return str(err)


@pytest.mark.timeout(120)  # rank 0 fails when rank 1 leaves (at once here), else at the world's 60 s timeout
@pytest.mark.parametrize("axis", ["cp", "ep"])
def test_a_rank_waiting_for_one_that_wrapped_alone_at_tp1_is_told_the_likely_cause(axis: str) -> None:
    """Every size of WrapOptions.sizes is named, ep_size too (before: only tp_size and cp_size, though ep differed)."""
    waiting, alone = run_ranks(alone_at_tp1, 2, axis)
    assert alone == "wrapped"
    assert "comparing the ranks' sizes and plans in wrap over ranks [0, 1] failed" in waiting, waiting
    names = [f.name for f in fields(WrapOptions) if f.name.endswith("_size")]  # every axis's size, a new one too
    assert len(names) >= 3 and {"tp_size", "cp_size", "ep_size"} <= set(names)
    listed = ", ".join(names[:-1]) + f" and {names[-1]}"
    at_one = ", ".join(f"{n}=1" for n in names[:-1]) + f" and {names[-1]}=1"
    assert (
        f"Every rank must call wrap with the same {listed}: a rank at {at_one} without tp_group runs no collective"
    ) in waiting, waiting
